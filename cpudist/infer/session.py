"""A model loaded in a rank, with what runs it: what eval and generate use, and what the engine
(cpudist.train.engine) trains."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from cpudist.config import Config
from cpudist.model.adapters import resolve_adapter
from cpudist.model.load import LM_HEAD, Head, load_for_inference
from cpudist.model.provenance import saved_head
from cpudist.runtime.precision import Precision, choose_precision
from cpudist.runtime.process import Process


@dataclass
class Session:
    """A model loaded in this rank: what eval and generate run, and what the engine trains."""

    config: Config
    process: Process
    precision: Precision
    model: nn.Module  # the peft model (base + adapter)
    tokenizer: Any
    model_dir: Path
    head: Head = LM_HEAD  # what the model computes: next-token logits, or a classifier's labels

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)


def open_session(config: Config, process: Process, adapter: str | Path | None = None,
                 flag: str = "--base") -> Session:
    """Base model (+ the saved adapter at `adapter`) for evaluation and generation, in eval mode.
    flag: the option that named the base, for errors about it."""
    adapter_dir = resolve_adapter(str(adapter)) if adapter else None  # fail before the slow load
    precision = choose_precision(config.model.dtype)
    head = saved_head(adapter_dir) if adapter_dir is not None else LM_HEAD
    model, tokenizer, model_dir = load_for_inference(config.model, adapter_dir, precision, flag,
                                                     head)
    return Session(config, process, precision, model, tokenizer, model_dir, head)
