"""Each optimisation computes the same thing as the plain path: chunked label-only loss, packed
rows, and weights mapped from shared (or dtype-converted) files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import cpudist_cmd, run, tiny_overrides

from cpudist.config import LoraConfig, ModelConfig
from cpudist.data import IGNORE, TokenizedSplit, collate, pack
from cpudist.loss import CausalLMLoss
from cpudist.model import build_model, trainable_parameters


def _model(path: Path, cache: Path, dtype: str = "float32", share: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model, _, _, _ = build_model(
        ModelConfig(path=str(path), dtype=dtype, share_frozen_weights=share, cache_dir=str(cache)),
        LoraConfig(r=4, alpha=8, dropout=0.0))
    # LoRA B starts at zero; random B makes both LoRA matrices receive gradient.
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    return model


def _split(lengths: list[int], vocab: int, prompt: int = 3) -> TokenizedSplit:
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    labels = [[IGNORE] * prompt + row[prompt:] for row in ids]
    return TokenizedSplit(ids, labels)


def _atol(reference: torch.Tensor) -> float:
    # fp32 sums in a different order: differences scale with the gradient's own size.
    return 1e-4 * float(reference.abs().max())


def _loss_and_grads(module: CausalLMLoss, batch) -> tuple[float, int, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    total, count = module(**batch.as_kwargs())
    total.backward()
    grads = {name: p.grad.clone() for name, p in trainable_parameters(module)}
    return float(total.detach()), int(count), grads


@pytest.mark.parametrize("kind", ["tiny_qwen", "tiny_llama"])
def test_chunked_label_only_loss_equals_full_logits(kind: str, request: pytest.FixtureRequest,
                                                     tmp_path: Path) -> None:
    model = _model(request.getfixturevalue(kind), tmp_path)
    batch = collate(_split([17, 9, 23], model.config.vocab_size), [0, 1, 2], pad_id=0)
    full = _loss_and_grads(CausalLMLoss(model, chunk_size=0), batch)
    chunked = _loss_and_grads(CausalLMLoss(model, chunk_size=5), batch)
    assert full[1] == chunked[1] == batch.label_tokens == (14 + 6 + 20)
    assert chunked[0] == pytest.approx(full[0], rel=1e-5)
    assert full[2].keys() == chunked[2].keys() and len(full[2]) > 0
    for name, grad in full[2].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-4, atol=_atol(grad), msg=name)


def test_chunked_loss_in_bf16_matches_the_full_logits_path(tiny_qwen: Path, tmp_path: Path) -> None:
    # bf16 weights under autocast (the path taken on AVX512-BF16/AMX CPUs): both paths round the
    # logits to bf16 and the logit gradient to bf16 before the head's matmul, in other orders.
    model = _model(tiny_qwen, tmp_path, dtype="bfloat16")
    batch = collate(_split([17, 9, 23], model.config.vocab_size), [0, 1, 2], pad_id=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = _loss_and_grads(CausalLMLoss(model, chunk_size=0), batch)
        chunked = _loss_and_grads(CausalLMLoss(model, chunk_size=5), batch)
    assert chunked[0] == pytest.approx(full[0], rel=1e-3)
    for name, grad in full[2].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(chunked[2][name], grad, rtol=2e-2, atol=2e-2 * float(grad.abs().max()),
                                   msg=name)


def test_packed_rows_equal_separate_samples(tiny_qwen: Path, tmp_path: Path) -> None:
    model = _model(tiny_qwen, tmp_path)
    data = _split([12, 7, 20, 5], model.config.vocab_size)
    packed = pack(data, [0, 1, 2, 3], pad_id=0, max_length=32)
    plain = collate(data, [0, 1, 2, 3], pad_id=0)
    assert packed.input_ids.shape[0] < 4  # several samples share a row
    assert packed.tokens == plain.tokens == 44
    assert packed.label_tokens == plain.label_tokens

    # Hidden states of each packed segment equal that sample run on its own.
    module = CausalLMLoss(model, chunk_size=0)
    from cpudist.loss import packed_attention_mask

    with torch.no_grad():
        hidden = module.decoder(input_ids=packed.input_ids,
                                attention_mask=packed_attention_mask(packed.attention_mask,
                                                                     torch.float32),
                                position_ids=packed.position_ids).last_hidden_state
        for index, ids in enumerate(data.input_ids):
            alone = module.decoder(input_ids=torch.tensor([ids])).last_hidden_state[0]
            row, start = _segment_of(packed, index, data)
            torch.testing.assert_close(hidden[row, start:start + len(ids)], alone, rtol=1e-4,
                                       atol=1e-5)

    # Same training loss and gradients, with the chunked and the full-logits head.
    for chunk in (0, 4):
        separate = _loss_and_grads(CausalLMLoss(model, chunk), plain)
        together = _loss_and_grads(CausalLMLoss(model, chunk), packed)
        assert together[1] == separate[1]
        assert together[0] == pytest.approx(separate[0], rel=1e-5)
        for name, grad in separate[2].items():
            torch.testing.assert_close(together[2][name], grad, rtol=1e-4, atol=_atol(grad), msg=name)


def _segment_of(batch, index: int, data: TokenizedSplit) -> tuple[int, int]:
    """(row, start column) of sample `index` in a packed batch (samples packed in order)."""
    ids = torch.tensor(data.input_ids[index])
    for row in range(batch.input_ids.shape[0]):
        for start in range(batch.input_ids.shape[1] - len(ids) + 1):
            if (batch.position_ids[row, start] == 0
                    and torch.equal(batch.input_ids[row, start:start + len(ids)], ids)):
                return row, start
    raise AssertionError(f"sample {index} not in the packed batch")


def _mapped_from(param: torch.Tensor, directory: Path) -> bool:
    """True when the parameter lives in a whole-file mapping of a safetensors file there."""
    sizes = {f.stat().st_size for f in directory.glob("*.safetensors")}
    return param.untyped_storage().nbytes() in sizes


def test_shared_weights_equal_a_normal_load(tiny_llama: Path, tmp_path: Path) -> None:
    plain = dict(_model(tiny_llama, tmp_path, share=False).named_parameters())
    shared = _model(tiny_llama, tmp_path, share=True)
    frozen = [(n, p) for n, p in shared.named_parameters() if not p.requires_grad]
    assert frozen and all(_mapped_from(p, tiny_llama) for _, p in frozen)
    assert not (tmp_path / "converted").exists()  # same dtype as the file: nothing converted
    for name, param in shared.named_parameters():
        assert torch.equal(param, plain[name]), name
    batch = collate(_split([10, 6], shared.config.vocab_size), [0, 1], pad_id=0)
    assert _loss_and_grads(CausalLMLoss(shared, 0), batch)[0] == pytest.approx(
        _loss_and_grads(CausalLMLoss(_model(tiny_llama, tmp_path, share=False), 0), batch)[0])


def test_bf16_weights_from_an_fp32_file_are_converted_once_and_shared(
        tiny_qwen: Path, tmp_path: Path) -> None:
    plain = dict(_model(tiny_qwen, tmp_path, dtype="bfloat16", share=False).named_parameters())
    shared = _model(tiny_qwen, tmp_path, dtype="bfloat16", share=True)
    converted = list((tmp_path / "converted").iterdir())
    converted = [d for d in converted if d.is_dir()]
    assert len(converted) == 1 and (converted[0] / "done").exists()
    frozen = [(n, p) for n, p in shared.named_parameters() if not p.requires_grad]
    assert all(p.dtype == torch.bfloat16 and _mapped_from(p, converted[0]) for _, p in frozen)
    for name, param in shared.named_parameters():
        assert param.dtype == plain[name].dtype and torch.equal(param, plain[name]), name
    stamp = (converted[0] / "done").stat().st_mtime_ns
    _model(tiny_qwen, tmp_path, dtype="bfloat16", share=True)
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

    plain = _model(tiny_llama, tmp_path, share=False)

    def copying_load(*_: object, **__: object) -> None:
        raise AssertionError("from_pretrained would fill a private copy of every weight first")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", copying_load)
    shared = _model(tiny_llama, tmp_path, share=True)
    base = shared.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight  # still tied
    assert all(_mapped_from(p, tiny_llama) for p in shared.parameters() if not p.requires_grad)
    batch = collate(_split([10, 6], shared.config.vocab_size), [0, 1], pad_id=0)
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
    plain = dict(_model(tiny_llama, tmp_path, share=False).named_parameters())
    shared = _model(odd, tmp_path, share=True)
    for name, param in shared.named_parameters():
        assert torch.equal(param, plain[name]), name
        assert param.requires_grad or _mapped_from(param, odd), name


def test_training_with_packing_matches_padding(tiny_qwen: Path, chat_file: Path,
                                               tmp_path: Path) -> None:
    losses = {}
    for packing in (False, True):
        out = tmp_path / f"packing-{packing}"
        result = run([*cpudist_cmd(), "train", *tiny_overrides(
            tiny_qwen, chat_file, out, data__packing=packing, train__max_steps=2,
            data__group_by_length=False, train__eval_batches=1)])
        assert result.returncode == 0, result.stderr[-2000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[packing] = [r["loss"] for r in records if "loss" in r]
    assert len(losses[True]) == 2
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


def test_activation_checkpointing_is_active_from_the_first_step(tiny_qwen: Path,
                                                                 tmp_path: Path) -> None:
    """The decoder layers only checkpoint in training mode; build_model must leave them there."""
    from cpudist.data import collate

    def saved_bytes(checkpointing: bool) -> int:
        torch.manual_seed(0)
        model, _, _, _ = build_model(
            ModelConfig(path=str(tiny_qwen), dtype="float32", cache_dir=str(tmp_path),
                        gradient_checkpointing=checkpointing), LoraConfig(r=4, dropout=0.0))
        batch = collate(_split([40, 40], model.config.vocab_size), [0, 1], pad_id=0)
        total = 0

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            CausalLMLoss(model, 16)(**batch.as_kwargs())  # chunked: only layer activations
        return total

    assert saved_bytes(True) < 0.5 * saved_bytes(False)
