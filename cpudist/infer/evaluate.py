"""Evaluation: the validation loss a run logs, and `cpudist eval` on a data file (the same code, so
the two give the same number for the same file), with token accuracy."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cpudist.data.batches import collate, eval_batches
from cpudist.data.tokenize import TokenizedSplit
from cpudist.model.loss import label_positions
from cpudist.runtime.cluster import Placement
from cpudist.runtime.comm import allreduce
from cpudist.runtime.precision import Precision
from cpudist.train.session import Session


@torch.no_grad()
def evaluate(loss_module: nn.Module, data: TokenizedSplit, batch_size: int, pad_id: int,
             precision: Precision, placement: Placement, limit: int | None = None
             ) -> dict[str, float]:
    """Mean loss over every label token of data (this rank takes its strided share; all ranks are
    summed) and perplexity; {} when data has no label token."""
    was_training = loss_module.training
    loss_module.eval()
    total = count = 0.0
    for indices in eval_batches(data, batch_size, placement.rank, placement.world_size, limit):
        batch = collate(data, indices, pad_id)
        with precision.autocast():
            loss_sum, n = loss_module(**batch.as_kwargs())
        total += float(loss_sum)
        count += float(n)
    total, count = allreduce([total, count], placement)
    loss_module.train(was_training)
    if count == 0:
        return {}
    loss = total / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def evaluate_session(session: Session, data: TokenizedSplit, limit: int | None = None,
                     loss: nn.Module | None = None) -> dict[str, float]:
    """evaluate() with the session's loss module (or `loss`), batch size, precision and rank."""
    return evaluate(loss or session.loss, data, session.config.train.batch_size, session.pad_id,
                    session.precision, session.process.placement, limit)


class TokenAccuracy(nn.Module):
    """A loss module plus a count of label positions whose argmax prediction is the label.

    The loss itself comes from the wrapped module unchanged; the decoder's hidden states are
    caught with a hook and put through the LM head again for the argmax (soft-capping and logit
    scaling do not change an argmax).
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.correct = self.counted = 0
        self._hidden: torch.Tensor | None = None
        inner.decoder.register_forward_hook(self._catch)

    def _catch(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self._hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def forward(self, **batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total, count = self.inner(**batch)
        assert self._hidden is not None
        flat_index, targets = label_positions(batch["labels"])
        rows = self._hidden.reshape(-1, self._hidden.shape[-1]).index_select(0, flat_index)
        chunk = self.inner.chunk_size or 1024
        for start in range(0, rows.shape[0], chunk):
            predicted = self.inner.head(rows[start : start + chunk]).argmax(dim=-1)
            self.correct += int((predicted == targets[start : start + chunk]).sum())
        self.counted += int(targets.numel())
        self._hidden = None
        return total, count


def evaluate_file(session: Session, limit: int | None = None) -> dict[str, Any]:
    """Loss, perplexity and token accuracy of the session's model on data.path (all of it: the
    validation split of a run is its own file here)."""
    from cpudist.data.read import resolve_data_path
    from cpudist.data.tokenize import load_tokenized
    from cpudist.errors import UserError

    data_config = session.config.data
    try:
        path = resolve_data_path(data_config.path, data_config.cache_dir)
    except UserError as exc:
        raise UserError(str(exc).replace("(data.path)", "(--data)")) from exc
    data, stats = load_tokenized(path, session.tokenizer, data_config)
    scorer = TokenAccuracy(session.loss)
    result = evaluate_session(session, data, limit, loss=scorer)
    if not result:
        raise UserError(f"--data {data_config.path}: no label tokens to evaluate")
    return {
        "loss": result["val_loss"], "perplexity": result["val_ppl"],
        "token_accuracy": scorer.correct / scorer.counted, "label_tokens": scorer.counted,
        "samples": len(data), "truncated": stats["truncated"], "dropped": stats["dropped_no_labels"],
        "dtype": session.precision.describe(), "data": str(path),
    }
