"""A trained tied embedding adds its rows to the LM head's gradient in place: the same gradient
as nn.Embedding's, padding rows excluded, and no second vocabulary-sized tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from cpudist.model.loss import CausalLMLoss
from cpudist.model.tied_embedding import share_tied_embedding_gradient


class WeightSizedTensors(TorchDispatchMode):
    """The storages of every op output shaped like `shape` while it is on."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.storages = shape, set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.shape == self.shape:
                self.storages.add(tensor.untyped_storage().data_ptr())
        return out


def weight_gradient(model_dir: Path, shared: bool, chunk: int) -> tuple[torch.Tensor, int]:
    """(the tied weight's gradient after one backward, how many vocabulary-sized tensors its
    backward made)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.model.embed_tokens.padding_idx = 0  # rows of id 0 must get no embedding gradient
    if shared:
        assert share_tied_embedding_gradient(model)
    ids = torch.tensor([[0, 5, 9, 5, 0, 17, 3, 9], [2, 2, 0, 11, 4, 4, 4, 8]])
    labels = ids.clone()
    labels[1, :3] = -100
    total = CausalLMLoss(model, chunk)(ids, torch.ones_like(ids), labels).total
    weight = model.get_input_embeddings().weight
    with WeightSizedTensors(weight.shape) as made:
        total.backward()
    return weight.grad, len(made.storages)


@pytest.mark.parametrize("chunk", [4, 0])  # the chunked label-only head, then HF's own logits
def test_tied_embedding_gradient_equals_nn_embedding(tiny_qwen: Path, chunk: int) -> None:
    want, plain_made = weight_gradient(tiny_qwen, False, chunk)
    got, made = weight_gradient(tiny_qwen, True, chunk)
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # With cpudist's head the embedding adds its rows to the head's tensor, the one tensor of the
    # weight's size (nn.Embedding's backward zero-fills a dense one, then autograd adds them);
    # HF's head leaves none, so the embedding makes its dense gradient as nn.Embedding does.
    if chunk:
        assert made == 1 and plain_made > 1
    else:
        assert made == plain_made


def test_only_a_plain_tied_embedding_is_changed(tiny_qwen: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32)
    model.model.embed_tokens.max_norm = 1.0  # nn.Embedding renormalises rows in place: keep it
    assert not share_tied_embedding_gradient(model)
    model.model.embed_tokens.max_norm = None
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    assert not share_tied_embedding_gradient(model)
