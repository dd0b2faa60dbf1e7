"""How a cpudist process ends: the errors a user can cause and fix (printed as one line, no
traceback unless --debug), and the exit status of each way a command ends, so that a scheduler's
retry policy (Slurm --requeue, torchrun --max-restarts, Kubernetes podFailurePolicy, `cpudist
launch --restarts`) can tell "done" from "retry" from "do not retry" (docs/OPERATIONS.md)."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """The exit status of a cpudist command, one per way it can end."""

    FINISHED = 0
    INTERNAL_ERROR = 1  # a bug (cpudist's or a library's): Python's own status for an exception
    BAD_INPUT = 2  # a config, data or flag to fix (argparse uses 2 for bad flags too)
    MEMORY_PLAN = 3  # refused before loading: the run would not fit the node's memory
    PREEMPTED = 75  # stopped by a signal after writing a checkpoint (sysexits' EX_TEMPFAIL)
    LOST_PEER = 76  # another rank died, hung or became unreachable (sysexits' EX_PROTOCOL)
    INTERRUPTED = 130  # Ctrl-C without a checkpoint (128 + SIGINT, as shells report it)

    @property
    def retry(self) -> bool:
        """Whether starting the same job again (resuming) can help."""
        return self in (ExitCode.PREEMPTED, ExitCode.LOST_PEER)

    def describe(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    ExitCode.FINISHED: "finished",
    ExitCode.INTERNAL_ERROR: "internal error (do not retry; report it with the --debug traceback)",
    ExitCode.BAD_INPUT: "bad input or config (do not retry; fix what the message names)",
    ExitCode.MEMORY_PLAN: "refused by the memory plan (do not retry on this node; see cpudist plan)",
    ExitCode.PREEMPTED: "preempted with a checkpoint (retry: the job resumes from it)",
    ExitCode.LOST_PEER: "lost a peer rank (retry: the job resumes from the newest checkpoint)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
}


class UserError(Exception):
    """Bad input: the message names the file, line or key, and what to do."""

    exit_code = ExitCode.BAD_INPUT


class PlanRefused(UserError):
    """The memory plan says the run does not fit its node: no retry on the same nodes helps."""

    exit_code = ExitCode.MEMORY_PLAN


class Preempted(Exception):
    """A run stopped by a signal (SIGTERM, SIGUSR1, Ctrl-C) at a step boundary, after writing its
    checkpoint; the same command with train.resume=auto continues it."""

    exit_code = ExitCode.PREEMPTED

    def __init__(self, signal_name: str, step: int, checkpoints: str) -> None:
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint saved in "
                         f"{checkpoints}; resume with train.resume=auto")
        self.signal_name = signal_name
        self.step = step
        self.checkpoints = checkpoints

