"""The objective interface: what a kind of training trains on, and how it is scored.

The engine (cpudist.train.engine), DDP, checkpoints, resume on any world size, the memory plan
and the bench are written once against this interface. An objective says:

- what its data is: `load_data(tokenizer)` gives a training and a validation split (anything with
  `len()` and `lengths()`: the global batch order deals samples to ranks by their lengths);
- what the model computes: `model_head` (next-token logits by default, or a classifier sized by
  the data's labels);
- what a batch is: `make_batch` (training) and `eval_batch` (validation) turn sample indices into
  a Batch: the tensors the loss module takes, its real tokens, its label tokens (the positions
  that carry loss, for throughput) and `weight(batch)`, what the loss is a mean over;
- how loss and per-step metrics are computed: `loss_module(model)` is the nn.Module DDP wraps; its
  forward returns a cpudist.model.loss.LossOutput of sums over the batch (loss, units, and the
  objective's own `metric_names`), which the engine adds up over micro-batches and ranks;
- what evaluation reports: `eval_metrics(sums)` names the validation figures ("val_loss", ...),
  `describe_eval` puts a before/after pair in words;
- what a run shows besides its figures: `held_out_prompts` (answered before and after training);
- what is saved besides the adapter: `save_extras(directory)`;
- what must be done once the engine is set up and its checkpoint applied, before the first step
  (a pass over the data such as DPO's reference log-probabilities): `prepare(engine)`.

To add an objective, subclass Objective and register it in cpudist.objectives.OBJECTIVES; the
name becomes a value of train.objective.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from cpudist.config import Config
from cpudist.model.load import LM_HEAD, Head

if TYPE_CHECKING:
    from cpudist.train.engine import Engine


class Split(Protocol):
    """A split of samples, as batching needs it."""

    def __len__(self) -> int: ...

    def lengths(self) -> list[int]: ...


class ModelBatch(Protocol):
    """A batch as the engine needs it: the loss module's inputs and what it holds."""

    @property
    def tokens(self) -> int: ...  # real (non-padding) tokens fed to the model

    @property
    def label_tokens(self) -> int: ...  # positions that carry loss

    def as_kwargs(self) -> dict[str, torch.Tensor]: ...


@dataclass
class Datasets:
    train: Any  # a Split the objective batches
    val: Any
    description: str  # for the log: where the samples come from, and how many
    # The loader's counts (cpudist.data.tokenize.build_datasets: "cache_hit", "sources", ...)
    counts: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0  # reading and tokenizing, or reading the cache (set by the engine)


@dataclass(frozen=True)
class Prompt:
    """A held-out prompt (token ids up to its answer) and its reference answer's ids."""

    ids: list[int]
    reference: list[int]


class Objective(ABC):
    """What varies between kinds of training; see the module docstring."""

    name: ClassVar[str]
    # The sums a loss module reports besides loss and units (LossOutput.metrics), in a fixed
    # order: every rank allreduces the same vector even when it saw no batch.
    metric_names: ClassVar[tuple[str, ...]] = ()
    # Sequences a sample puts through the model (a preference pair: 2), for the memory plan.
    sequences_per_sample: ClassVar[int] = 1

    def __init__(self, config: Config) -> None:
        self.config = config

    @abstractmethod
    def load_data(self, tokenizer: Any) -> Datasets:
        """The training and validation splits (every rank calls it; node-wide work is cached)."""

    def model_head(self, tokenizer: Any) -> Head:
        """What the model computes on top of its backbone (by default next-token logits); asked
        after load_data, so a head can be sized by the data."""
        return LM_HEAD

    @abstractmethod
    def loss_module(self, model: nn.Module) -> nn.Module:
        """The module a step runs (and DDP wraps): forward(**batch.as_kwargs()) -> LossOutput."""

    @abstractmethod
    def make_batch(self, data: Any, indices: list[int], pad_id: int) -> ModelBatch:
        """The training batch of these samples."""

    def eval_batch(self, data: Any, indices: list[int], pad_id: int) -> ModelBatch:
        """The validation batch of these samples (by default as in training)."""
        return self.make_batch(data, indices, pad_id)

    @abstractmethod
    def weight(self, batch: ModelBatch) -> float:
        """The units the loss of this batch is a mean over (label tokens, rows, pairs)."""

    def step_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        """The objective's own per-step figures from a step's metric sums over all ranks."""
        return {}

    @abstractmethod
    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Named validation figures from sums over the whole split ("loss", "units" and the
        metric_names); {} when the split had nothing to score."""

    @abstractmethod
    def describe_eval(self, before: dict[str, float], after: dict[str, float]) -> str:
        """One line comparing validation figures before and after training."""

    def held_out_prompts(self, val: Any, count: int) -> Sequence[Prompt]:
        """Held-out prompts the run answers before and after training (none by default)."""
        return []

    def save_extras(self, directory: Path) -> None:
        """Files besides the adapter that reloading the trained model needs (none by default)."""
        return None

    def prepare(self, engine: Engine) -> str:
        """Work after the engine is built and its checkpoint applied, before the first step and
        the validation before training (every rank calls it; none by default). Returns what it
        did, in a few words for the bench's table ("" for nothing)."""
        return ""
