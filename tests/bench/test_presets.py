"""Bench presets: the exact architectures of the models people fine-tune, written with random
weights one tensor at a time (bf16 shards and their index), read by cpudist's own path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cpudist.bench import presets
from cpudist.bench.presets import PRESETS, preset_dir, write_random_model
from tests.helpers import MODEL_CACHE

# Parameter counts of the published checkpoints (tied embeddings counted once).
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512,
             "llama-3-8b": 8_030_261_248, "mistral-7b": 7_248_023_552,
             "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360,
             "gemma-2-9b": 9_241_705_984, "gemma-3-1b": 999_885_952,
             "phi-4-mini": 3_836_021_760}  # Phi-4 mini's page rounds it: 3.84 B


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_architectures(name: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = PRESETS[name]
    config = AutoConfig.for_model(preset.model_type, **preset.config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    attention = model.model.layers[0].self_attn
    if name.startswith("qwen2"):  # Qwen2 attention has q/k/v biases
        assert attention.q_proj.bias is not None
    if name.startswith("qwen3"):  # Qwen3 has none, and RMS norms of Q and K per head
        assert attention.q_proj.bias is None and attention.q_norm.weight.shape == (128,)
    if name.startswith("gemma"):  # 256-wide heads; the layer kinds alternate as released
        assert attention.q_proj.weight.shape[0] == 256 * config.num_attention_heads
        expected = ["sliding_attention", "full_attention"] if name.startswith("gemma-2") else (
            ["sliding_attention"] * 5 + ["full_attention"])
        assert config.layer_types[:len(expected)] == expected
    if name.startswith("phi"):  # q/k/v in one projection, gate/up in another
        assert attention.qkv_proj.weight.shape == (3072 + 2 * 1024, 3072)
        assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 8192, 3072)


def test_random_model_is_written_in_shards_one_tensor_at_a_time(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    from transformers import AutoModelForCausalLM

    from cpudist.config import ModelConfig
    from cpudist.model.load import load_base_model
    from cpudist.runtime.precision import choose_precision

    settings = dict(PRESETS["qwen2.5-7b"].config, vocab_size=512, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
    monkeypatch.setattr(presets, "SHARD_BYTES", 100_000)  # force several shards
    write_random_model("qwen2", settings, tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((tmp_path / s).is_file() for s in shards)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reference.dtype == torch.bfloat16
    norm = reference.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert float(reference.model.layers[1].mlp.up_proj.weight.float().std()) == pytest.approx(
        0.02, rel=0.05)
    # cpudist's mapped build reads the sharded directory to the same weights.
    mapped = load_base_model(ModelConfig(path=str(tmp_path), dtype="bfloat16",
                                         cache_dir=str(tmp_path / "cache")), tmp_path,
                             choose_precision("bfloat16"), map_weights=True)
    for name, param in reference.named_parameters():
        assert torch.equal(mapped.get_parameter(name), param), name


def test_cut_presets_keep_the_first_layers_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cache = str(MODEL_CACHE)
    one = preset_dir("qwen2.5-0.5b", layers=1, model_cache=cache, root=tmp_path)
    two = preset_dir("qwen2.5-0.5b", layers=2, model_cache=cache, root=tmp_path)
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert "model.layers.1.mlp.up_proj.weight" in b and "model.layers.1.mlp.up_proj.weight" not in a
    for name, tensor in a.items():
        assert torch.equal(b[name], tensor), name
    assert (one / "tokenizer.json").exists() and json.loads(
        (one / "config.json").read_text())["num_hidden_layers"] == 1
