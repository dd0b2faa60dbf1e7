"""Frozen weights mapped read-only from the safetensors files (shared by a node's ranks) equal a
normal load, converted once when the file's dtype differs, built without a private copy."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from cpudist.data.batches import collate
from cpudist.model.loss import CausalLMLoss
from tests.helpers import lora_model, loss_and_grads, random_split


def _mapped_from(param: torch.Tensor, directory: Path) -> bool:
    """True when the parameter lives in a whole-file mapping of a safetensors file there."""
    sizes = {f.stat().st_size for f in directory.glob("*.safetensors")}
    return param.untyped_storage().nbytes() in sizes


def test_shared_weights_equal_a_normal_load(tiny_llama: Path, tmp_path: Path) -> None:
    plain = dict(lora_model(tiny_llama, tmp_path, share=False).named_parameters())
    shared = lora_model(tiny_llama, tmp_path, share=True)
    frozen = [(n, p) for n, p in shared.named_parameters() if not p.requires_grad]
    assert frozen and all(_mapped_from(p, tiny_llama) for _, p in frozen)
    assert not (tmp_path / "converted").exists()  # same dtype as the file: nothing converted
    for name, param in shared.named_parameters():
        assert torch.equal(param, plain[name]), name
    batch = collate(random_split([10, 6], shared.config.vocab_size), [0, 1], pad_id=0)
    assert loss_and_grads(CausalLMLoss(shared, 0), batch)[0] == pytest.approx(
        loss_and_grads(CausalLMLoss(lora_model(tiny_llama, tmp_path, share=False), 0), batch)[0])


def test_bf16_weights_from_an_fp32_file_are_converted_once_and_shared(
        tiny_qwen: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture[str]) -> None:
    plain = dict(lora_model(tiny_qwen, tmp_path, dtype="bfloat16", share=False).named_parameters())
    with caplog.at_level(logging.INFO, logger="cpudist"):
        shared = lora_model(tiny_qwen, tmp_path, dtype="bfloat16", share=True)
    # The conversion runs in a spawned child that logs as this process does: its last line.
    assert re.search(rf"converting {tiny_qwen.name}: \d+ MB in [\d.]+ s", capfd.readouterr().err)
    converted = list((tmp_path / "converted").iterdir())
    converted = [d for d in converted if d.is_dir()]
    assert len(converted) == 1 and (converted[0] / "done").exists()
    frozen = [(n, p) for n, p in shared.named_parameters() if not p.requires_grad]
    assert all(p.dtype == torch.bfloat16 and _mapped_from(p, converted[0]) for _, p in frozen)
    for name, param in shared.named_parameters():
        assert param.dtype == plain[name].dtype and torch.equal(param, plain[name]), name
    stamp = (converted[0] / "done").stat().st_mtime_ns
    lora_model(tiny_qwen, tmp_path, dtype="bfloat16", share=True)
    assert (converted[0] / "done").stat().st_mtime_ns == stamp  # reused, not rewritten
    # The hand-written converted file is plain safetensors: the library reads it back as a cast.
    from safetensors.torch import load_file

    source, target = load_file(tiny_qwen / "model.safetensors"), load_file(
        converted[0] / "model.safetensors")
    assert target.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(target[name], tensor.to(torch.bfloat16)), name


def test_mapped_weights_are_built_without_a_private_copy(tiny_llama: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    plain = lora_model(tiny_llama, tmp_path, share=False)

    def copying_load(*_: object, **__: object) -> None:
        raise AssertionError("from_pretrained would fill a private copy of every weight first")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", copying_load)
    shared = lora_model(tiny_llama, tmp_path, share=True)
    base = shared.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight  # still tied
    assert all(_mapped_from(p, tiny_llama) for p in shared.parameters() if not p.requires_grad)
    batch = collate(random_split([10, 6], shared.config.vocab_size), [0, 1], pad_id=0)
    with torch.no_grad():  # rotary buffers and every weight as a normal load has them
        assert torch.equal(shared(**batch.as_kwargs()).logits, plain(**batch.as_kwargs()).logits)


def test_weights_that_do_not_fit_by_name_load_normally_then_map(
        tiny_llama: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    odd = tmp_path / "odd-model"
    shutil.copytree(tiny_llama, odd)
    tensors = load_file(odd / "model.safetensors")
    tensors["extra.unused_weight"] = torch.ones(3)  # from_pretrained ignores it; assign can't
    save_file(tensors, str(odd / "model.safetensors"), metadata={"format": "pt"})
    plain = dict(lora_model(tiny_llama, tmp_path, share=False).named_parameters())
    shared = lora_model(odd, tmp_path, share=True)
    for name, param in shared.named_parameters():
        assert torch.equal(param, plain[name]), name
        assert param.requires_grad or _mapped_from(param, odd), name


