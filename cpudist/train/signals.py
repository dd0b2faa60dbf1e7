"""Stopping a run cleanly: SIGTERM, SIGINT and SIGUSR1 ask for a checkpoint at the next step."""

from __future__ import annotations

import signal
from typing import Any


class StopFlag:
    """Set by SIGTERM/SIGINT/SIGUSR1; checked (and agreed across ranks) at step boundaries."""

    def __init__(self, enabled: bool) -> None:
        self.signal: int | None = None
        if enabled:
            # SIGUSR1 too: Open MPI's mpirun forwards it to every rank without killing them, while
            # on SIGTERM/SIGINT it sends the ranks SIGTERM and then SIGKILL 0.25 s later.
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum
