"""`bench --profile`: each operator's time lands in its category, and the GEMM time is split by
shape with the rate each shape ran at."""

from __future__ import annotations

from pathlib import Path

import torch

from cpudist.bench.profile import CATEGORIES, gemm_roles, profile_step, profile_table


def test_a_step_is_split_by_category_and_gemm_shape() -> None:
    a, b = torch.randn(256, 128), torch.randn(128, 192)
    bias = torch.randn(256, 192)
    q = k = v = torch.randn(1, 2, 64, 32)
    x = torch.randn(512, 512)

    out = torch.empty(256, 192)

    def step() -> None:
        torch.mm(a, b)
        torch.mm(a, b, out=out)  # the loss head's matmuls write into reused buffers
        torch.addmm(bias, a, b)
        torch.bmm(torch.randn(3, 16, 8), torch.randn(3, 8, 4))
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
        torch.relu(x)
        x.to(torch.float64)

    profile = profile_step(step, lambda batch, m, k, n: "frozen linear" if batch == 1 else "batched")
    categories = profile["categories_ms"]
    assert list(categories) == list(CATEGORIES)
    for name in ("GEMM", "attention", "element-wise", "casts"):
        assert categories[name] > 0, name
    assert sum(categories.values()) >= profile["wall_ms"] * 0.99  # the rest is Python's
    shapes = {(g["batch"], g["m"], g["k"], g["n"]): g for g in profile["gemm_shapes"]}
    # mm (with or without out=) and addmm of the same factors are one shape: three calls.
    assert shapes[(1, 256, 128, 192)]["calls"] == 3
    assert shapes[(3, 16, 8, 4)]["calls"] == 1
    assert set(shapes) == {(1, 256, 128, 192), (3, 16, 8, 4)}  # attention's own matmuls are its own
    big = shapes[(1, 256, 128, 192)]
    assert big["tflops"] == 2 * 256 * 128 * 192 * 3 / (big["ms"] / 1e3) / 1e12
    ms = [g["ms"] for g in profile["gemm_shapes"]]
    assert ms == sorted(ms, reverse=True)

    table = profile_table(profile, peak_tflops=2 * big["tflops"])
    assert "| 1 x 256 x 128 x 192 | frozen linear | 3 |" in table and "(50 %)" in table


def test_gemm_roles_tell_the_head_lora_and_frozen_matmuls_apart(tiny_qwen: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_qwen),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
    role = gemm_roles(model)
    vocab, tokens = model.config.vocab_size, 48
    assert role(1, tokens, 64, vocab) == "LM head"
    assert role(1, tokens, 4, 64) == "LoRA"  # B: rank -> out
    assert role(1, 64, tokens, 4) == "LoRA"  # A's gradient
    assert role(1, tokens, 64, 12) == "LoRA"  # q/k/v's three A matrices in one GEMM
    assert role(1, tokens, 64, 128) == "frozen linear"
    assert role(2, 16, 8, 16) == "batched"
