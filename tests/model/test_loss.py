"""The label-only chunked loss head computes what the full-logits path does, in fp32 and bf16, on
padded and on packed rows; activation checkpointing is on from the first step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpudist.data.batches import collate, pack
from cpudist.data.tokenize import TokenizedSplit
from cpudist.model import loss as loss_module
from cpudist.model.loss import CausalLMLoss, packed_attention_mask
from tests.helpers import grad_atol, lora_model, loss_and_grads, random_split


@pytest.mark.parametrize("kind", ["tiny_qwen", "tiny_llama", "tiny_gemma2"])
def test_chunked_label_only_loss_equals_full_logits(kind: str, request: pytest.FixtureRequest,
                                                     tmp_path: Path) -> None:
    model = lora_model(request.getfixturevalue(kind), tmp_path)
    batch = collate(random_split([17, 9, 23], model.config.vocab_size), [0, 1, 2], pad_id=0)
    full = loss_and_grads(CausalLMLoss(model, chunk_size=0), batch)
    chunked = loss_and_grads(CausalLMLoss(model, chunk_size=5), batch)
    assert full[1] == chunked[1] == batch.label_tokens == (14 + 6 + 20)
    assert chunked[0] == pytest.approx(full[0], rel=1e-5)
    assert full[2].keys() == chunked[2].keys() and len(full[2]) > 0
    for name, grad in full[2].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-4, atol=grad_atol(grad), msg=name)


@pytest.mark.parametrize("kind", ["tiny_qwen", "tiny_gemma2"])
def test_chunked_loss_in_bf16_matches_the_full_logits_path(kind: str, request: pytest.FixtureRequest,
                                                           tmp_path: Path) -> None:
    # bf16 weights under autocast (the path taken on AVX512-BF16/AMX CPUs): both paths round the
    # logits to bf16 and the logit gradient to bf16 before the head's matmul, in other orders.
    model = lora_model(request.getfixturevalue(kind), tmp_path, dtype="bfloat16")
    batch = collate(random_split([17, 9, 23], model.config.vocab_size), [0, 1, 2], pad_id=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = loss_and_grads(CausalLMLoss(model, chunk_size=0), batch)
        chunked = loss_and_grads(CausalLMLoss(model, chunk_size=5), batch)
    assert chunked[0] == pytest.approx(full[0], rel=1e-3)
    for name, grad in full[2].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(chunked[2][name], grad, rtol=2e-2, atol=2e-2 * float(grad.abs().max()),
                                   msg=name)


def test_soft_capped_head_is_chunked_and_the_cap_matters(tiny_gemma2: Path, tmp_path: Path) -> None:
    # Gemma 2's final_logit_softcapping is applied chunk by chunk (no full-vocabulary logits);
    # the same loss without the cap differs, so the equality above is about the cap.
    model = lora_model(tiny_gemma2, tmp_path)
    loss = CausalLMLoss(model, chunk_size=5)
    assert loss.chunked and loss.softcap == 0.05
    batch = collate(random_split([17, 9], model.config.vocab_size), [0, 1], pad_id=0)
    _, _, capped = loss_and_grads(loss, batch)
    loss.softcap = None
    _, _, plain = loss_and_grads(loss, batch)
    # A random model's loss is near ln(vocab) either way; its gradients are not.
    for name, grad in plain.items():
        assert (capped[name] - grad).abs().max() > 0.1 * grad.abs().max(), name


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_softmax_in_row_slices_gives_the_same_gradient(rows: int, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    # The bf16 head takes its fp32 softmax a few rows at a time (softmax_rows); rows are
    # independent, so any slicing (1 row, a remainder of 3 into a 5-row chunk, the whole chunk)
    # gives the bit-identical hidden-state gradient; only the loss sum's order changes.
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 32, generator=generator).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(1000, 32, generator=generator) * 0.3).to(torch.bfloat16)
    targets = torch.randint(0, 1000, (13,), generator=generator)

    def loss_and_grad(softmax_rows: int) -> tuple[float, torch.Tensor]:
        monkeypatch.setattr(loss_module, "softmax_rows", lambda: softmax_rows)
        hidden.grad = None
        total = loss_module._ChunkedLinearCrossEntropy.apply(hidden, weight, None, targets, 5)
        total.backward()
        return float(total), hidden.grad.clone()

    whole_loss, whole_grad = loss_and_grad(5)
    sliced_loss, sliced_grad = loss_and_grad(rows)
    assert torch.equal(sliced_grad, whole_grad)
    assert sliced_loss == pytest.approx(whole_loss, rel=1e-6)
    reference = torch.nn.functional.cross_entropy((hidden.float() @ weight.float().t()), targets,
                                                  reduction="sum")
    assert sliced_loss == pytest.approx(float(reference), rel=1e-2)


def test_packed_rows_equal_separate_samples(tiny_qwen: Path, tmp_path: Path) -> None:
    model = lora_model(tiny_qwen, tmp_path)
    data = random_split([12, 7, 20, 5], model.config.vocab_size)
    packed = pack(data, [0, 1, 2, 3], pad_id=0, max_length=32)
    plain = collate(data, [0, 1, 2, 3], pad_id=0)
    assert packed.input_ids.shape[0] < 4  # several samples share a row
    assert packed.tokens == plain.tokens == 44
    assert packed.label_tokens == plain.label_tokens

    # Hidden states of each packed segment equal that sample run on its own.
    module = CausalLMLoss(model, chunk_size=0)
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
        separate = loss_and_grads(CausalLMLoss(model, chunk), plain)
        together = loss_and_grads(CausalLMLoss(model, chunk), packed)
        assert together[1] == separate[1]
        assert together[0] == pytest.approx(separate[0], rel=1e-5)
        for name, grad in separate[2].items():
            torch.testing.assert_close(together[2][name], grad, rtol=1e-4, atol=grad_atol(grad), msg=name)


def _segment_of(batch, index: int, data: TokenizedSplit) -> tuple[int, int]:
    """(row, start column) of sample `index` in a packed batch (samples packed in order)."""
    ids = torch.tensor(data.input_ids[index])
    for row in range(batch.input_ids.shape[0]):
        for start in range(batch.input_ids.shape[1] - len(ids) + 1):
            if (batch.position_ids[row, start] == 0
                    and torch.equal(batch.input_ids[row, start:start + len(ids)], ids)):
                return row, start
    raise AssertionError(f"sample {index} not in the packed batch")


def test_activation_checkpointing_is_active_from_the_first_step(tiny_qwen: Path,
                                                                 tmp_path: Path) -> None:
    """The decoder layers only checkpoint in training mode; build_model must leave them there."""
    def saved_bytes(checkpointing: bool) -> int:
        model = lora_model(tiny_qwen, tmp_path, gradient_checkpointing=checkpointing)
        batch = collate(random_split([40, 40], model.config.vocab_size), [0, 1], pad_id=0)
        total = 0

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            CausalLMLoss(model, 16)(**batch.as_kwargs())  # chunked: only layer activations
        return total

    assert saved_bytes(True) < 0.5 * saved_bytes(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("block", [8192, 64])  # the weight's gradient in one block, or in five
def test_a_trainable_head_gets_the_gradients_of_plain_autograd(dtype: torch.dtype, per_row: bool,
                                                               softcap: float | None, block: int,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    # peft.method=full: the head (with a bias here) trains. The chunked head keeps each row's
    # logit gradient for the weight's gradient; plain autograd over full logits is the reference,
    # under bf16 autocast too (where both round the logits and their gradient to bf16).
    import torch.nn.functional as F

    monkeypatch.setattr(loss_module, "_WEIGHT_GRADIENT_BLOCK", block)

    from cpudist.model.loss import chunked_lm_loss, chunked_row_logps

    torch.manual_seed(0)
    vocab, width, rows, length = 300, 32, 3, 11
    head = torch.nn.Linear(width, vocab)
    hidden = torch.randn(rows, length, width)
    labels = torch.randint(0, vocab, (rows, length))
    labels[0, :4] = -100

    def reference(x: torch.Tensor) -> torch.Tensor:
        logits = head(x[:, :-1]).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        nll = F.cross_entropy(logits.reshape(-1, vocab), labels[:, 1:].reshape(-1),
                              reduction="none").view(rows, length - 1)
        return -nll.sum(1) if per_row else nll.sum()

    def chunked(x: torch.Tensor) -> torch.Tensor:
        if per_row:
            return chunked_row_logps(x, head, labels, 4, softcap)[0]
        return chunked_lm_loss(x, head, labels, 4, softcap)[0]

    results = []
    for fn in (reference, chunked):
        head.zero_grad()
        x = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = fn(x)
        # Weights per sum, so that each sequence's incoming gradient differs (DPO's case).
        (out * torch.arange(1, out.numel() + 1).view(out.shape)).sum().backward()
        results.append([out.detach(), x.grad, head.weight.grad.clone(), head.bias.grad.clone()])
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for name, want, got in zip(("loss", "hidden", "weight", "bias"), *results, strict=True):
        assert want.abs().max() > 0, name
        torch.testing.assert_close(got, want, rtol=tolerance,
                                   atol=tolerance * float(want.abs().max()), msg=name)


def test_head_gemms_run_on_a_multiple_of_16_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 512-token sequence has 511 label rows; oneDNN's GEMMs run markedly slower on such odd
    # counts, so the rows are padded with zeros, which change neither the loss nor a gradient.
    from cpudist.model.loss import chunked_lm_loss

    torch.manual_seed(0)
    vocab, width = 50, 8
    head = torch.nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(1, 12, width, requires_grad=True)
    labels = torch.randint(0, vocab, (1, 12))  # 11 label rows
    mm, rows_seen = torch.mm, []

    def recording(a: torch.Tensor, b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        if vocab in (a.shape[1], b.shape[1]):  # the head's GEMMs, not the test's own
            rows_seen.append(a.shape[0])
        return mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "mm", recording)
    total, count = chunked_lm_loss(hidden, head, labels, 512)
    total.backward()
    monkeypatch.undo()
    logits = head(hidden[0, :-1].detach())
    want = torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="sum")
    assert count == 11 and rows_seen and all(rows % 16 == 0 for rows in rows_seen)
    torch.testing.assert_close(total.detach(), want)
    assert hidden.grad is not None and hidden.grad.shape == hidden.shape
