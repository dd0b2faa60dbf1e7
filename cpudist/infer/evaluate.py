"""`cpudist eval --data FILE`: the validation figures a run logs (the same objective and scoring
code, so the two give the same loss for the same file), with token accuracy."""

from __future__ import annotations

import torch
from torch import nn

from cpudist.errors import UserError
from cpudist.infer.session import Session
from cpudist.model.loss import CausalLMLoss, LossOutput, label_positions
from cpudist.objectives.evaluation import evaluate
from cpudist.objectives.sft import SFT
from cpudist.records import DataEvalResult


class TokenAccuracy(nn.Module):
    """A causal-LM loss module plus a count of label positions whose argmax prediction is the label.

    The loss itself comes from the wrapped module unchanged; its hidden states are put through
    the LM head again for the argmax (soft-capping and logit scaling do not change an argmax).
    """

    def __init__(self, inner: CausalLMLoss) -> None:
        super().__init__()
        self.inner = inner
        self.correct = self.counted = 0
        inner.keep_hidden = True

    def forward(self, **batch: torch.Tensor) -> LossOutput:
        output = self.inner(**batch)
        hidden = self.inner.last_hidden
        assert hidden is not None
        flat_index, targets = label_positions(batch["labels"])
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_index)
        chunk = self.inner.chunk_size or 1024
        for start in range(0, rows.shape[0], chunk):
            predicted = self.inner.head(rows[start : start + chunk]).argmax(dim=-1)
            self.correct += int((predicted == targets[start : start + chunk]).sum())
        self.counted += int(targets.numel())
        self.inner.last_hidden = None
        return output


def evaluate_file(session: Session, limit: int | None = None) -> DataEvalResult:
    """Loss, perplexity and token accuracy of the session's model on data.path (all of it: the
    validation split of a run is its own file here)."""
    from cpudist.data.read import resolve_data_path
    from cpudist.data.tokenize import load_tokenized

    data_config = session.config.data
    try:
        path = resolve_data_path(data_config.path, data_config.cache_dir)
    except UserError as exc:
        raise UserError(str(exc).replace("(data.path)", "(--data)")) from exc
    data, stats = load_tokenized(path, session.tokenizer, data_config)
    objective = SFT(session.config)
    loss = objective.loss_module(session.model)
    assert isinstance(loss, CausalLMLoss)
    scorer = TokenAccuracy(loss)
    figures = evaluate(objective, scorer, data, session.config.train.batch_size, session.pad_id,
                       session.precision, session.process.placement, limit)
    if not figures:
        raise UserError(f"--data {data_config.path}: no label tokens to evaluate")
    return DataEvalResult(
        loss=figures["val_loss"], perplexity=figures["val_ppl"],
        token_accuracy=scorer.correct / scorer.counted, label_tokens=scorer.counted,
        samples=len(data), truncated=stats["truncated"], dropped=stats["dropped_no_labels"],
        dtype=session.precision.describe(), data=str(path))
