"""Objectives: what a kind of training trains on and how it is scored (base.py has the
interface). OBJECTIVES maps train.objective to its class."""

from __future__ import annotations

from cpudist.config import Config
from cpudist.data.formats import objectives_of
from cpudist.errors import UserError
from cpudist.objectives.base import Datasets, ModelBatch, Objective, Prompt, Split
from cpudist.objectives.classification import Classification
from cpudist.objectives.preference import DPO, ORPO
from cpudist.objectives.sft import SFT

OBJECTIVES: dict[str, type[Objective]] = {"sft": SFT, "classification": Classification,
                                          "dpo": DPO, "orpo": ORPO}


def objective_name(config: Config) -> str:
    """train.objective, with auto resolved from data.format; a format the objective cannot read
    is a UserError naming both settings."""
    allowed = objectives_of(config.data.format)
    name = config.train.objective
    if name == "auto":
        return config.objective_name()
    if name not in allowed:
        raise UserError(f"train.objective={name} cannot train on data.format={config.data.format} "
                        f"(its records are for {' or '.join(allowed)}); use train.objective=auto "
                        "or a data format of that objective")
    return name


def objective_for(config: Config) -> Objective:
    """The objective train.objective names (auto: the one data.format calls for)."""
    return OBJECTIVES[objective_name(config)](config)


__all__ = ["OBJECTIVES", "Datasets", "ModelBatch", "Objective", "Prompt", "Split", "objective_for",
           "objective_name"]
