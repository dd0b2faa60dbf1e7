"""Scoring a validation split with an objective's loss module: what a run logs as its validation
figures and what `cpudist eval --data` reports (the same code, so they agree on the same file)."""

from __future__ import annotations

import torch
from torch import nn

from cpudist.data.batches import eval_batches
from cpudist.model.loss import LossOutput
from cpudist.objectives.base import Objective, Split
from cpudist.runtime.cluster import Placement
from cpudist.runtime.comm import allreduce
from cpudist.runtime.precision import Precision


def add_sums(sums: dict[str, float], output: LossOutput) -> None:
    """Add a batch's LossOutput into running sums ("loss", "units" and the metric names)."""
    sums["loss"] += float(output.total.detach())
    sums["units"] += float(output.count)
    for name, value in output.metrics.items():
        sums[name] += float(value.detach())


def zero_sums(objective: Objective) -> dict[str, float]:
    return {"loss": 0.0, "units": 0.0, **{name: 0.0 for name in objective.metric_names}}


def allreduce_sums(sums: dict[str, float], placement: Placement) -> dict[str, float]:
    """The sums over every rank (the same keys in the same order on each)."""
    return dict(zip(sums, allreduce(list(sums.values()), placement), strict=True))


@torch.no_grad()
def evaluate(objective: Objective, module: nn.Module, data: Split, batch_size: int, pad_id: int,
             precision: Precision, placement: Placement, limit: int | None = None
             ) -> dict[str, float]:
    """The objective's validation figures over data (this rank takes its strided share, every
    rank's sums are added); {} when data has nothing to score."""
    was_training = module.training
    module.eval()
    sums = zero_sums(objective)
    for indices in eval_batches(data, batch_size, placement.rank, placement.world_size, limit):
        batch = objective.eval_batch(data, indices, pad_id)
        with precision.autocast():
            add_sums(sums, module(**batch.as_kwargs()))
    module.train(was_training)
    return objective.eval_metrics(allreduce_sums(sums, placement))
