"""lora.fast_path: the same numbers as PEFT's forward, in PEFT's save format, and PEFT's forward
wherever the fast path cannot serve a layer exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpudist.config import Config, LoraConfig, ModelConfig
from cpudist.model.fast_lora import LoraUp
from cpudist.model.load import build_model
from cpudist.runtime.precision import choose_precision


def _model(path: Path, cache: Path, fast: bool, dtype: str = "float32",
           **lora: object) -> torch.nn.Module:
    torch.manual_seed(0)
    # alpha / r = 1.5: not a power of two, so scaling the rank-sized product instead of the
    # output changes the rounding, and the comparison below has to hold with tolerance.
    settings: dict[str, object] = {"r": 4, "alpha": 6.0, "dropout": 0.0, **lora}
    model, _, _ = build_model(
        Config(model=ModelConfig(path=str(path), dtype=dtype, share_frozen_weights=False,
                                 cache_dir=str(cache)),
               lora=LoraConfig(fast_path=fast, **settings)), choose_precision(dtype))
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # random B: the adapter's branch contributes, both matrices learn
            param.data = torch.randn(param.shape, generator=generator) * 0.05
    return model


def _forward_backward(model: torch.nn.Module, dtype: str = "float32"
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(2))
    with choose_precision(dtype).autocast():
        logits = model(input_ids=ids).logits.float()
        logits.square().mean().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()
             if param.requires_grad}
    return logits.detach(), grads


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama", "tiny_mistral", "tiny_qwen3",
                                     "tiny_gemma", "tiny_gemma2", "tiny_gemma3", "tiny_phi3"])
def test_fast_path_matches_peft_forward_and_gradients(fixture: str, request: pytest.FixtureRequest,
                                                      tmp_path: Path) -> None:
    path = request.getfixturevalue(fixture)
    fast = _model(path, tmp_path, fast=True)
    plain = _model(path, tmp_path, fast=False)
    # The fast path is really installed, with q/k/v and gate/up sharing their A GEMM (Phi-3 has
    # them fused into one projection each already).
    patched = [m for m in fast.modules() if hasattr(m, "_cpudist_shared")]
    assert patched
    assert any(m._cpudist_shared is not None for m in patched) == (fixture != "tiny_phi3")
    assert not any(hasattr(m, "_cpudist_shared") for m in plain.modules())
    logits_fast, grads_fast = _forward_backward(fast)
    logits_plain, grads_plain = _forward_backward(plain)
    torch.testing.assert_close(logits_fast, logits_plain, rtol=1e-5, atol=1e-5)
    assert grads_fast.keys() == grads_plain.keys()
    for name in grads_plain:
        # Relative to each gradient's own norm: these gradients are small enough that an absolute
        # tolerance of 1e-6 let a systematic 0.1 % error through; fp32 rounding gives < 1e-5.
        error = float((grads_fast[name] - grads_plain[name]).norm() / grads_plain[name].norm())
        assert error <= 1e-4, f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_up_backward_equals_autograds(dtype: str) -> None:
    """LoraUp's transposed GEMMs give autograd's gradients, in the parameters' own dtype."""
    generator = torch.Generator().manual_seed(5)
    h32 = torch.randn(3, 40, 8, generator=generator)
    weight = torch.randn(96, 8, generator=generator).requires_grad_()
    bias = torch.randn(96, generator=generator).requires_grad_()
    grad = torch.randn(3, 40, 96, generator=generator)
    results = []
    for up in (LoraUp.apply, torch.nn.functional.linear):
        h = h32.to(getattr(torch, dtype), copy=True).requires_grad_()
        weight.grad = bias.grad = None
        with choose_precision(dtype).autocast():
            out = up(h, weight, bias)
        out.backward(grad.to(out.dtype))
        results.append((out.detach(), h.grad, weight.grad, bias.grad))
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 2e-2, "atol": 5e-2}
    for mine, autograds in zip(results[0], results[1], strict=True):
        assert mine.dtype == autograds.dtype and mine.shape == autograds.shape
        torch.testing.assert_close(mine, autograds, **tolerance)
    assert results[0][2].dtype == torch.float32  # the weight's gradient arrives in its own dtype


def test_fast_path_in_bf16_stays_within_bf16_rounding(tiny_qwen: Path, tmp_path: Path) -> None:
    logits_fast, grads_fast = _forward_backward(_model(tiny_qwen, tmp_path, True, "bfloat16"),
                                                "bfloat16")
    logits_plain, grads_plain = _forward_backward(_model(tiny_qwen, tmp_path, False, "bfloat16"),
                                                  "bfloat16")
    scale = logits_plain.abs().max()
    assert (logits_fast - logits_plain).abs().max() <= 0.03 * scale
    total_fast = torch.cat([g.flatten() for g in grads_fast.values()])
    total_plain = torch.cat([g.flatten() for g in grads_plain.values()])
    assert (total_fast - total_plain).norm() <= 0.03 * total_plain.norm()


def test_disabled_adapter_and_dropout_use_peft_forward(tiny_qwen: Path, tmp_path: Path) -> None:
    fast = _model(tiny_qwen, tmp_path, fast=True)
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with fast.disable_adapter():
            base_logits = fast(input_ids=ids).logits
        adapted = fast(input_ids=ids).logits
        plain = _model(tiny_qwen, tmp_path, fast=False)
        with plain.disable_adapter():
            plain_base = plain(input_ids=ids).logits
    torch.testing.assert_close(base_logits, plain_base)
    assert not torch.allclose(base_logits, adapted)  # the adapter is on again after the context
    with_dropout = _model(tiny_qwen, tmp_path, fast=True, dropout=0.1)
    assert not any(hasattr(m, "_cpudist_shared") for m in with_dropout.modules())


def test_adapter_trained_on_fast_path_loads_in_plain_peft(tiny_qwen: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    fast = _model(tiny_qwen, tmp_path, fast=True)
    fast.save_pretrained(tmp_path / "adapter", safe_serialization=True)
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(4))
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, fast(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
