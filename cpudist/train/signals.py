"""Stopping a run cleanly: SIGTERM, SIGINT and SIGUSR1 ask for a checkpoint at the next step."""

from __future__ import annotations

import signal
from typing import Any

# SIGUSR1 too: Open MPI's mpirun forwards it to every rank without killing them, while on
# SIGTERM/SIGINT it sends the ranks SIGTERM and then SIGKILL 0.25 s later.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopFlag:
    """Set by SIGTERM/SIGINT/SIGUSR1; checked (and agreed across ranks) at step boundaries.
    `restore` puts the handlers that were there before back (a run inside a larger program, such
    as a script using the Python API, leaves its signals as it found them)."""

    def __init__(self, enabled: bool) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        if enabled:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> StopFlag:
        return self

    def __exit__(self, *_: object) -> None:
        self.restore()

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum
