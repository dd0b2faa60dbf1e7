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
    model_type: str  # a transformers model type (its config class and causal-LM class), or builtin
    config: dict[str, Any]
    about: str


PRESETS: dict[str, Preset] = {
    "qwen2.5-0.5b": Preset("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
        "Qwen/Qwen2.5-0.5B-Instruct's architecture, 494 M parameters"),
    "qwen2.5-7b": Preset("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
        "Qwen/Qwen2.5-7B-Instruct's architecture (q/k/v biases), 7.6 B parameters, 15.2 GB"),
    "llama-3-8b": Preset("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False),
        "meta-llama/Meta-Llama-3-8B-Instruct's architecture, 8.0 B parameters, 16.1 GB"),
    "mistral-7b": Preset("mistral", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        sliding_window=None),
        "mistralai/Mistral-7B-Instruct-v0.3's architecture, 7.2 B parameters, 14.5 GB"),
    "qwen3-0.6b": Preset("qwen3", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
        "Qwen/Qwen3-0.6B's architecture (128-wide heads, Q/K norms), 596 M parameters"),
    "qwen3-8b": Preset("qwen3", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
        "Qwen/Qwen3-8B's architecture, 8.2 B parameters, 16.4 GB"),
    "gemma-2-9b": Preset("gemma2", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True),
        "google/gemma-2-9b-it's architecture (soft-capped logits, eager attention), 9.2 B "
        "parameters, 18.5 GB"),
    "gemma-3-1b": Preset("gemma3_text", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True),
        "google/gemma-3-1b-it's architecture (5 sliding layers to 1 global), 1.0 B parameters"),
    # LongRoPE's factors are left out: they change which positions rotate how, not the work.
    "phi-4-mini": Preset("phi3", dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
        max_position_embeddings=131072, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, pad_token_id=199999),
        "microsoft/Phi-4-mini-instruct's architecture (fused qkv and gate/up projections, a "
        "quarter of each head unrotated), 3.8 B parameters"),
    # The real quickstart model (pretrained weights of the built-in smollm2-135m-instruct).
    "smollm2-135m": Preset("builtin", {"name": "smollm2-135m-instruct"},
                           "the built-in SmolLM2-135M-Instruct, pretrained weights"),
}
SHARD_BYTES = 5 * 1024**3  # as save_pretrained shards by default
INIT_STD = 0.02  # transformers' initializer_range: keeps random-weight activations finite in bf16


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
    from transformers import AutoTokenizer

    source = _builtin_tokenizer_dir(model_cache)
    tokenizer = AutoTokenizer.from_pretrained(source)
    with replacing(target) as tmp:
        tmp.mkdir()
        if preset.model_type == "builtin":
            _write_builtin(source, layers, tmp)
        else:
            settings = dict(preset.config)
            if layers is not None:
                settings["num_hidden_layers"] = layers
            settings.update(bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, initializer_range=INIT_STD)
            write_random_model(preset.model_type, settings, tmp)
        tokenizer.save_pretrained(tmp)


def _write_builtin(source: Path, layers: int | None, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if layers is not None and layers < model.config.num_hidden_layers:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(target, safe_serialization=True)


def write_random_model(model_type: str, settings: dict[str, Any], target: Path) -> None:
    """A Hugging Face model directory (config.json, bf16 safetensors shards and their index) of
    the architecture, with random weights made and written one tensor at a time: a 7B model
    never needs more memory than its largest tensor. Each tensor's values depend only on its name
    (normal(0, 0.02) for matrices, ones for norms, zeros for biases), so a cut model
    (--layers) holds the same first layers as the whole one."""
    import zlib

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from cpudist.model.safetensors_io import Spec, write_file, write_index

    config = AutoConfig.for_model(model_type, **settings)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    specs = {name: Spec(torch.bfloat16, tuple(p.shape)) for name, p in skeleton.named_parameters()}
    del skeleton

    def make(name: str) -> torch.Tensor:
        shape = specs[name].shape
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=torch.bfloat16)
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out = torch.empty(shape, dtype=torch.bfloat16)
        rows = max(1, (1 << 24) // max(1, out[0].numel()))  # 64 MB of fp32 at a time
        for start in range(0, shape[0], rows):
            chunk = torch.randn((min(rows, shape[0] - start), *shape[1:]), generator=generator)
            out[start : start + rows] = chunk.mul_(INIT_STD)
        return out

    shards: list[dict[str, Spec]] = [{}]
    size = 0
    for name, spec in specs.items():
        if shards[-1] and size + spec.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = spec
        size += spec.nbytes
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        file = (f"model-{number:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                else "model.safetensors")
        write_file(target / file, shard, make)
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        write_index(target, weight_map, sum(spec.nbytes for spec in specs.values()))
    config.save_pretrained(target)
