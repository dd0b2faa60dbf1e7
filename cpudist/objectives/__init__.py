"""Objectives: what a kind of training trains on and how it is scored (base.py has the
interface). OBJECTIVES maps train.objective to its class."""

from __future__ import annotations

from cpudist.config import Config
from cpudist.objectives.base import Datasets, ModelBatch, Objective, Prompt, Split
from cpudist.objectives.preference import DPO, ORPO
from cpudist.objectives.sft import SFT

OBJECTIVES: dict[str, type[Objective]] = {"sft": SFT, "dpo": DPO, "orpo": ORPO}


def objective_for(config: Config) -> Objective:
    """The objective train.objective names, for this config."""
    return OBJECTIVES[config.train.objective](config)


__all__ = ["OBJECTIVES", "Datasets", "ModelBatch", "Objective", "Prompt", "Split", "objective_for"]
