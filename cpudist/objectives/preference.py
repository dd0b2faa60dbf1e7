"""Preference tuning: DPO (sigmoid loss, beta, label smoothing) and ORPO (reference-free), on pairs
of a chosen and a rejected answer to one prompt (data.format=preference).

Chosen and rejected go through the model in one batch (chosen rows first), and the label-only
chunked LM head (cpudist.model.loss.chunked_row_logps) gives each row's summed answer-token
log-probability without full-vocabulary logits. The unit of the loss is the pair.

DPO's reference is the same base with the adapter disabled, or, when the run starts from a saved
adapter (model.init_adapter), the base with that adapter's weights swapped in (cpudist.objectives.
reference). It is computed once before training and cached with the tokenized data, or at every
step (preference.reference).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cpudist.config import Config
from cpudist.data.preference import PreferenceSplit, load_pairs
from cpudist.data.tokenize import IGNORE, build_datasets
from cpudist.errors import UserError
from cpudist.model.loss import CausalLMLoss, LossOutput, chunked_row_logps, full_row_logps
from cpudist.objectives.base import Datasets, Objective, Prompt

if TYPE_CHECKING:
    from cpudist.objectives.reference import Reference
    from cpudist.train.engine import Engine

log = logging.getLogger("cpudist")


@dataclass(frozen=True)
class PairBatch:
    """Pairs as one batch: chosen rows, then rejected rows, right-padded; `reference` holds the
    reference log-probabilities of those rows when they were precomputed."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    reference: torch.Tensor | None = None
    position_ids: None = None  # never packed (the bench's sample lengths read it)

    @property
    def pairs(self) -> int:
        return self.input_ids.shape[0] // 2

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def label_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE).sum())

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        kwargs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                  "labels": self.labels}
        if self.reference is not None:
            kwargs["reference"] = self.reference
        return kwargs


def collate_pairs(data: PreferenceSplit, indices: list[int], pad_id: int) -> PairBatch:
    """The pairs' chosen rows then rejected rows, right-padded; labels on the answers only."""
    rows = [(data.prompt[i], data.chosen[i]) for i in indices]
    rows += [(data.prompt[i], data.rejected[i]) for i in indices]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (prompt, answer) in enumerate(rows):
        sequence = torch.tensor(prompt + answer, dtype=torch.long)
        ids[row, : len(sequence)] = sequence
        labels[row, len(prompt) : len(sequence)] = sequence[len(prompt) :]
        mask[row, : len(sequence)] = 1
    reference = None
    if data.reference is not None:
        chosen = [data.reference[i][0] for i in indices]
        rejected = [data.reference[i][1] for i in indices]
        reference = torch.tensor(chosen + rejected, dtype=torch.float64)
    return PairBatch(ids, mask, labels, reference)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (branch at -ln 2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class PairLoss(nn.Module):
    """What DDP wraps for preference pairs: forward(batch) -> LossOutput summed over the pairs,
    with the reward sums of PreferenceObjective.metric_names."""

    def __init__(self, model: nn.Module, config: Config, kind: str) -> None:
        super().__init__()
        self.inner = CausalLMLoss(model, config.train.loss_chunk_size)
        self.settings = config.preference
        self.kind = kind
        self.reference_source: Reference | None = None  # set by prepare when computed per step
        self.last_logps = torch.empty(0)

    @property
    def model(self) -> nn.Module:
        return self.inner.model

    def row_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed answer log-probability, answer tokens) of every row, in one forward."""
        inner = self.inner
        if not inner.chunked:
            logits = inner.model(input_ids=input_ids, attention_mask=attention_mask).logits
            return full_row_logps(logits, labels)
        hidden = inner.decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return chunked_row_logps(hidden, inner.head, labels, inner.chunk_size, inner.softcap)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                reference: torch.Tensor | None = None) -> LossOutput:
        if self.kind == "dpo" and reference is None:
            if self.reference_source is None:
                raise RuntimeError("DPO batch without reference log-probabilities")
            with torch.no_grad(), self.reference_source.active():
                reference, _ = self.row_logps(input_ids, attention_mask, labels)
        logps, counts = self.row_logps(input_ids, attention_mask, labels)
        self.last_logps = logps.detach()  # for scorers that count preferences (cpudist eval)
        pairs = logps.shape[0] // 2
        chosen, rejected = logps[:pairs], logps[pairs:]
        if self.kind == "dpo":
            assert reference is not None
            ref = reference.to(torch.float32)
            losses, reward_c, reward_r = self.dpo(chosen, rejected, ref[:pairs], ref[pairs:])
            extra = {}
        else:
            losses, reward_c, reward_r, nll = self.orpo(chosen, rejected, counts[:pairs],
                                                        counts[pairs:])
            extra = {"nll": nll.detach().sum()}
        margin = (reward_c - reward_r).detach()
        # A tie (a fresh adapter: every margin 0) counts half, so chance is 0.5.
        correct = (margin > 0).float() + 0.5 * (margin == 0).float()
        return LossOutput(losses.sum(), torch.tensor(pairs), {
            "reward_chosen": reward_c.detach().sum(), "reward_rejected": reward_r.detach().sum(),
            "reward_correct": correct.sum(), **extra})

    def dpo(self, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
            ref_rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sigmoid DPO per pair, with conservative label smoothing: (losses, rewards)."""
        beta, smoothing = self.settings.beta, self.settings.label_smoothing
        logits = beta * ((chosen - rejected) - (ref_chosen - ref_rejected))
        losses = -F.logsigmoid(logits) * (1 - smoothing) - F.logsigmoid(-logits) * smoothing
        return losses, beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)

    def orpo(self, chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
             rejected_tokens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """ORPO per pair: the chosen answer's mean token NLL minus lambda x log sigmoid of the log
        odds ratio of the answers' mean log-probabilities: (losses, rewards, NLL)."""
        lam = self.settings.orpo_lambda
        mean_c = chosen / chosen_tokens.clamp(min=1)
        mean_r = rejected / rejected_tokens.clamp(min=1)
        log_odds = (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r))
        nll = -mean_c
        return nll - lam * F.logsigmoid(log_odds), lam * mean_c, lam * mean_r, nll


class PreferenceObjective(Objective):
    """What DPO and ORPO share: pairs, their batches, rewards and evaluation."""

    metric_names: ClassVar[tuple[str, ...]] = ("reward_chosen", "reward_rejected", "reward_correct")
    sequences_per_sample: ClassVar[int] = 2

    def load_data(self, tokenizer: Any) -> Datasets:
        config = self.config
        if config.data.format != "preference":
            raise UserError(f"train.objective={self.name} trains on preference pairs: set "
                            f"data.format=preference (prompt, chosen, rejected); it is "
                            f"{config.data.format}")
        if config.data.packing:
            raise UserError(f"data.packing=true does not apply to train.objective={self.name} "
                            "(a pair's two sequences are batched together); set it false")
        train, val, stats = build_datasets(config.data, tokenizer, config.train.seed, load=load_pairs)
        return Datasets(train, val, (
            f"{stats['source']} -> {stats['train']} train / {stats['val']} validation pairs; "
            f"{stats['truncated']} of {stats['samples']} truncated to {config.data.max_length} "
            "tokens per sequence (the prompt's end, the answers' starts kept); dropped: "
            f"{stats['dropped_long_prompt']} with a prompt filling data.max_length, "
            f"{stats['dropped_identical']} with identical answers"), counts=stats)

    def loss_module(self, model: nn.Module) -> nn.Module:
        return PairLoss(model, self.config, self.name)

    def make_batch(self, data: PreferenceSplit, indices: list[int], pad_id: int) -> PairBatch:
        return collate_pairs(data, indices, pad_id)

    def weight(self, batch: PairBatch) -> float:  # type: ignore[override]
        return float(batch.pairs)

    def step_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        pairs = max(units, 1.0)
        chosen, rejected = sums["reward_chosen"] / pairs, sums["reward_rejected"] / pairs
        return {"reward_chosen": chosen, "reward_rejected": rejected,
                "reward_margin": chosen - rejected, "reward_accuracy": sums["reward_correct"] / pairs}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        if sums["units"] == 0:
            return {}
        figures = self.step_metrics(sums, sums["units"])
        return {"val_loss": sums["loss"] / sums["units"],
                **{f"val_{name}": value for name, value in figures.items()}}

    def describe_eval(self, before: dict[str, float], after: dict[str, float]) -> str:
        return (f"validation reward accuracy: before {before['val_reward_accuracy']:.3f} -> after "
                f"{after['val_reward_accuracy']:.3f} (reward margin "
                f"{before['val_reward_margin']:.4f} -> {after['val_reward_margin']:.4f}; loss "
                f"{before['val_loss']:.4f} -> {after['val_loss']:.4f})")

    def held_out_prompts(self, val: PreferenceSplit, count: int) -> list[Prompt]:
        return [Prompt(list(val.prompt[i]), list(val.chosen[i])) for i in range(min(count, len(val)))]


class DPO(PreferenceObjective):
    name: ClassVar[str] = "dpo"

    def prepare(self, engine: Engine) -> str:
        from cpudist.objectives.reference import prepare_reference

        return prepare_reference(engine)


class ORPO(PreferenceObjective):
    name: ClassVar[str] = "orpo"
    metric_names: ClassVar[tuple[str, ...]] = (*PreferenceObjective.metric_names, "nll")

    def step_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        return {**super().step_metrics(sums, units), "nll": sums["nll"] / max(units, 1.0)}
