"""Faults injected from outside the training step, for tests and rehearsals.

Read once when a run starts, from the environment; nothing here runs unless a variable is set:

  CPUDIST_FAULT_NAN_AT_STEP=3,4   the loss of those optimizer steps is NaN on this rank (documented
                                  in docs/OPERATIONS.md: exercises the non-finite step handling)
  CPUDIST_FAULT_SLOW_STEP_S=0.2   every optimizer step takes that much longer (a bigger model's
                                  pace, so that the soak test's kills land mid-run)
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch import nn

log = logging.getLogger("cpudist")
NAN_AT_STEP = "CPUDIST_FAULT_NAN_AT_STEP"
SLOW_STEP = "CPUDIST_FAULT_SLOW_STEP_S"


def nan_steps(environ: dict[str, str] | None = None) -> set[int]:
    raw = (os.environ if environ is None else environ).get(NAN_AT_STEP, "")
    return {int(part) for part in raw.split(",") if part.strip().isdigit()}


def install(loss_module: nn.Module, grad_accum: int, start_step: int) -> None:
    """Hook the faults the environment asks for into loss_module's forward, which returns a
    cpudist.model.loss.LossOutput (no-op when none).

    The hook counts training forwards (grad enabled, training mode: evaluation does neither) to
    know the optimizer step: grad_accum of them per step, after start_step done steps.
    """
    slow = float(os.environ.get(SLOW_STEP) or 0)
    if slow > 0:
        _slow_down(loss_module, grad_accum, slow)
    steps = nan_steps()
    if not steps:
        return
    log.warning("%s=%s: the loss of steps %s is NaN on this rank", NAN_AT_STEP,
                os.environ[NAN_AT_STEP], sorted(steps))
    forwards = [0]

    def poison(module: nn.Module, _args: Any, _kwargs: Any, output: Any) -> Any:
        import torch

        if not (module.training and torch.is_grad_enabled()):
            return output
        step = start_step + forwards[0] // grad_accum + 1
        forwards[0] += 1
        if step in steps:
            return output._replace(total=output.total * float("nan"))
        return output

    loss_module.register_forward_hook(poison, with_kwargs=True)


def _slow_down(loss_module: nn.Module, grad_accum: int, seconds: float) -> None:
    log.warning("%s=%g: every optimizer step sleeps %g s", SLOW_STEP, seconds, seconds)
    forwards = [0]

    def sleep(module: nn.Module, _args: Any) -> None:
        import time

        import torch

        if module.training and torch.is_grad_enabled():
            if forwards[0] % grad_accum == 0:
                time.sleep(seconds)
            forwards[0] += 1

    loss_module.register_forward_pre_hook(sleep)
