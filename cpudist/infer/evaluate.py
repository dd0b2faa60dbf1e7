"""`cpudist eval --data FILE`: the validation figures a run logs (the same objective and scoring
code, so the two give the same loss for the same file), with token accuracy; on preference pairs,
how often base and adapter prefer the chosen answer, and the DPO figures."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from cpudist.errors import UserError
from cpudist.infer.session import Session
from cpudist.model.loss import CausalLMLoss, LossOutput, label_positions
from cpudist.objectives.evaluation import evaluate
from cpudist.objectives.sft import SFT
from cpudist.records import DataEvalResult, PreferenceEvalResult


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


def evaluate_file(session: Session, limit: int | None = None
                  ) -> DataEvalResult | PreferenceEvalResult:
    """Loss, perplexity and token accuracy of the session's model on data.path (all of it: the
    validation split of a run is its own file here); preference pairs: evaluate_pairs."""
    from cpudist.data.read import resolve_data_paths
    from cpudist.data.tokenize import load_tokenized

    data_config = session.config.data
    try:
        paths = resolve_data_paths(data_config.path, data_config.cache_dir)
    except UserError as exc:
        raise UserError(str(exc).replace("(data.path)", "(--data)")) from exc
    path = paths[0]
    if data_config.format == "preference":
        return evaluate_pairs(session, path, limit)
    data, stats = load_tokenized(paths, session.tokenizer, data_config)
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
        dtype=session.precision.describe(), data=", ".join(map(str, paths)))


class PairPreferences(nn.Module):
    """DPO's loss module (the training code's validation figures) with the base as reference, plus
    counts of pairs whose chosen answer the base and the adapter give the higher log-probability
    (a tie counts half)."""

    def __init__(self, inner: nn.Module, has_adapter: bool) -> None:
        from cpudist.objectives.reference import Reference

        super().__init__()
        self.inner = inner
        self.reference = Reference(inner.model, None) if has_adapter else None
        self.pairs = 0
        self.base = self.adapter = 0.0

    @staticmethod
    def _prefers(logps: torch.Tensor) -> float:
        pairs = logps.shape[0] // 2
        difference = logps[:pairs] - logps[pairs:]
        return float((difference > 0).sum() + 0.5 * (difference == 0).sum())

    def forward(self, **batch: torch.Tensor) -> LossOutput:
        with self.reference.active() if self.reference else contextlib.nullcontext():
            base, _ = self.inner.row_logps(batch["input_ids"], batch["attention_mask"], batch["labels"])
        self.base += self._prefers(base)
        self.pairs += base.shape[0] // 2
        output = self.inner(**batch, reference=base)
        self.adapter += self._prefers(self.inner.last_logps)
        return output


def evaluate_pairs(session: Session, path: Path, limit: int | None = None) -> PreferenceEvalResult:
    """How often the base and base + adapter prefer the chosen answers of a preference file, and
    the adapter's DPO figures with the base as reference (as a run's validation computes them)."""
    from cpudist.data.preference import load_pairs
    from cpudist.objectives.preference import DPO, PairLoss

    config = session.config
    data, stats = load_pairs(path, session.tokenizer, config.data)
    has_adapter = hasattr(session.model, "disable_adapter")
    scorer = PairPreferences(PairLoss(session.model, config, "dpo"), has_adapter)
    figures = evaluate(DPO(config), scorer, data, config.train.batch_size, session.pad_id,
                       session.precision, session.process.placement, limit)
    adapter = figures if has_adapter else {}
    return PreferenceEvalResult(
        base_accuracy=scorer.base / scorer.pairs,
        adapter_accuracy=scorer.adapter / scorer.pairs if has_adapter else None,
        reward_accuracy=adapter.get("val_reward_accuracy"),
        reward_margin=adapter.get("val_reward_margin"), loss=adapter.get("val_loss"),
        beta=config.preference.beta, pairs=scorer.pairs, truncated=stats["truncated"],
        dropped=stats["dropped_long_prompt"] + stats["dropped_identical"],
        dtype=session.precision.describe(), data=str(path))
