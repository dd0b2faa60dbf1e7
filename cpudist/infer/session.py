"""A model loaded in a rank, with what runs it: what eval and generate use, and what the engine
(cpudist.train.engine) trains."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from cpudist.config import Config, ModelConfig
from cpudist.model.adapters import resolve_adapter
from cpudist.model.load import (
    LM_HEAD,
    Head,
    declared_head,
    load_for_inference,
    model_path_of_flag,
)
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
    model_dir = model_path_of_flag(config.model, flag)
    head = saved_head(adapter_dir) if adapter_dir is not None else declared_head(model_dir)
    model, tokenizer = load_for_inference(config.model, model_dir, adapter_dir, precision, head)
    return Session(config, process, precision, model, tokenizer, model_dir, head)


def trained_head(model: ModelConfig, adapter_dir: Path | None) -> Head:
    """What base (+ adapter) computes, known before any slow load: the saved adapter's head, or
    without one the base's own (a classifier trained with peft.method=full scores labels)."""
    if adapter_dir is not None:
        return saved_head(adapter_dir)
    return declared_head(model_path_of_flag(model, "--base"))


def check_generative_model(model: ModelConfig, adapter_dir: Path | None, what: str) -> None:
    """A one-line error when base (+ adapter) is a classifier: `what` (a command) needs text out."""
    from cpudist.errors import UserError
    from cpudist.model.adapters import SEQ_CLS, check_generative

    check_generative(adapter_dir, what)
    if adapter_dir is None and trained_head(model, None).task == SEQ_CLS:
        raise UserError(f"{what}: {model.path} is a classifier (its head scores labels; it writes "
                        f"no text); run it with `cpudist predict --base {model.path} --data FILE` "
                        "or `cpudist eval`")
