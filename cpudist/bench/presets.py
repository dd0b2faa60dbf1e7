"""Bench models: random weights in exact architectures, written once with SmolLM2's tokenizer into
.cache/bench/ so cpudist and its peers read the same files; and the real built-in model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpudist.errors import UserError
from cpudist.files import file_lock, replacing

BENCH_CACHE = Path(".cache/bench")


@dataclass(frozen=True)
class Preset:
    family: str  # qwen2 | llama | builtin
    config: dict[str, Any]


PRESETS: dict[str, Preset] = {
    # Exact Qwen2.5-0.5B architecture (random weights).
    "qwen2.5-0.5b": Preset("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # The real quickstart model (pretrained weights of the built-in smollm2-135m-instruct).
    "smollm2-135m": Preset("builtin", {"name": "smollm2-135m-instruct"}),
    # Llama-2-7B shape, for memory arithmetic on big nodes (shrink with --layers elsewhere).
    "llama-7b": Preset("llama", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
}


def _builtin_tokenizer_dir(cache_dir: str) -> Path:
    from cpudist.config import ModelConfig
    from cpudist.model.load import resolve_model_path

    return resolve_model_path(ModelConfig(cache_dir=cache_dir))


def preset_dir(name: str, layers: int | None = None, model_cache: str = ".cache/models",
               root: Path = BENCH_CACHE) -> Path:
    """The preset's model directory (safetensors + tokenizer), written once under a file lock."""
    if name not in PRESETS:
        raise UserError(f"--preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    if layers is not None and layers < 1:
        raise UserError(f"--layers {layers}: needs at least 1 layer")
    target = root / (f"{name}-L{layers}" if layers else name)
    with file_lock(root / f".{target.name}.lock"):
        if not (target / "config.json").exists():
            _write_preset(PRESETS[name], layers, model_cache, target)
    return target


def _write_preset(preset: Preset, layers: int | None, model_cache: str, target: Path) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    source = _builtin_tokenizer_dir(model_cache)
    tokenizer = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    if preset.family == "builtin":
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        if layers is not None and layers < model.config.num_hidden_layers:
            model.model.layers = model.model.layers[:layers]
            model.config.num_hidden_layers = layers
            if getattr(model.config, "layer_types", None):
                model.config.layer_types = model.config.layer_types[:layers]
    else:
        settings = dict(preset.config)
        if layers is not None:
            settings["num_hidden_layers"] = layers
        settings.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        config_cls, model_cls = ((Qwen2Config, Qwen2ForCausalLM) if preset.family == "qwen2"
                                 else (LlamaConfig, LlamaForCausalLM))
        # Small init keeps random-weight activations and losses finite in bf16.
        model = model_cls(config_cls(initializer_range=0.02, **settings))
    with replacing(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
