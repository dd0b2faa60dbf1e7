"""A tied input embedding that trains (peft.method=full) adds its rows to the LM head's gradient.

nn.Embedding's backward builds a dense vocabulary-sized gradient (zero-filled, then the batch's
rows added), and autograd then adds it to the LM head's dense gradient of the same tied weight
into a third tensor: for Qwen2.5-0.5B 0.51 GiB of temporaries at the very end of backward, where
every weight gradient is already held, so they set the step's peak. Here the chunked loss head
(cpudist.model.loss) leaves its dense gradient of the weight on the weight, and the embedding's
backward adds its rows to that tensor in place and contributes nothing itself: autograd
accumulates the one tensor, with the same value, and no temporary is made (docs/PERFORMANCE.md,
"Full fine-tuning: where the memory goes").

Autograd runs the embedding's backward after the head's (the head consumes the decoder's output)
and before it accumulates the weight's gradient (which waits for both), so the head's tensor is
still the one autograd holds. Without a head gradient left on the weight (a head other than
cpudist's chunked one), the embedding returns the dense gradient nn.Embedding would.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The attribute of a tied weight that holds the head's gradient of the running backward.
_HEAD_GRADIENT = "_cpudist_head_gradient"


def leave_head_gradient(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """Called by the loss head's backward with the dense gradient it returns for `weight`: kept
    for the tied embedding's backward to add its rows to."""
    if hasattr(weight, _HEAD_GRADIENT):
        setattr(weight, _HEAD_GRADIENT, grad)


class _TiedEmbedding(torch.autograd.Function):
    """weight[ids]; backward adds each id's row gradient (none for padding_idx, as nn.Embedding)
    to the head's gradient left on the weight, or returns them as a dense gradient."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor,
                padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        ctx.padding_idx = padding_idx
        return F.embedding(ids, weight.detach())

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        rows = ids.reshape(-1)
        values = grad_output.reshape(rows.shape[0], -1).to(weight.dtype)
        if ctx.padding_idx is not None:
            keep = rows != ctx.padding_idx
            rows, values = rows[keep], values[keep]
        head_gradient = getattr(weight, _HEAD_GRADIENT, None)
        setattr(weight, _HEAD_GRADIENT, None)
        if head_gradient is not None and head_gradient.shape == weight.shape:
            head_gradient.index_add_(0, rows, values)
            return None, None, None
        return torch.zeros_like(weight).index_add_(0, rows, values), None, None


def _forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return _TiedEmbedding.apply(self.weight, ids, self.padding_idx)


def share_tied_embedding_gradient(model: nn.Module) -> bool:
    """Gives the input embedding the forward above when it is tied to the LM head and plain (no
    max_norm, no scale_grad_by_freq); returns whether it did. The module, its weight and its
    state-dict name stay as they are."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if (type(embedding) is not nn.Embedding or head is None
            or getattr(head, "weight", None) is not embedding.weight
            or embedding.max_norm is not None or embedding.scale_grad_by_freq):
        return False
    setattr(embedding.weight, _HEAD_GRADIENT, None)
    embedding.forward = types.MethodType(_forward, embedding)
    return True
