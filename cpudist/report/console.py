"""Console progress on rank 0: a progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("cpudist")
# Progress lines (steps, rows, conversions) have a logger of their own: `--quiet` silences it,
# leaving the rest of the log (cpudist.cli).
progress_log = logging.getLogger("cpudist.progress")


class Progress:
    """A progress bar on a terminal; plain log lines otherwise (CI logs, files, mpirun output)."""

    def __init__(self, total: int, start: int, enabled: bool, allow_bar: bool = True) -> None:
        self.total = total
        self.shown = enabled  # messages (validation figures), shown under --quiet too
        self.enabled = enabled and progress_log.isEnabledFor(logging.INFO)  # the step lines
        self.bar = None
        self.started = time.perf_counter()
        self.start_step = start
        # Under mpirun the bar's carriage-return redraws end up in captured logs: plain lines there.
        if self.enabled and allow_bar and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)

    def update(self, step: int, loss: float, tokens_per_s: float, lr: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}", lr=f"{lr:.2e}")
            self.bar.update(step - self.bar.n)
            return
        done = step - self.start_step
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(done, 1) * (self.total - step)
        progress_log.info("step %d/%d  loss %.4f  lr %.2e  %.0f tok/s  eta %s", step, self.total,
                          loss, lr, tokens_per_s, _duration(eta))

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)
        elif self.shown:
            log.info(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RowProgress:
    """Work before training counted in rows (reading and tokenizing a dataset) or another unit
    (MB of a model conversion): a log line with the amount done, its rate and an ETA at most
    every `every` seconds, and one when it ends. Lines go through the "cpudist" logger, so only
    rank 0 prints them (other ranks log warnings only)."""

    def __init__(self, what: str, total: int, every: float = 10.0, unit: str = "rows") -> None:
        self.what = what
        self.total = total  # an estimate (lines of a file); 0 when unknown
        self.every = every
        self.unit = unit
        self.started = self.last = time.perf_counter()

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every:
            return
        self.last = now
        rate = done / max(now - self.started, 1e-9)
        left = max(self.total - done, 0)
        eta = f", eta {_duration(left / rate)}" if self.total and rate > 0 else ""
        of = f" of ~{self.total:,}" if self.total else ""
        progress_log.info("%s: %s%s %s, %.0f %s/s%s", self.what, f"{done:,}", of, self.unit,
                          rate, self.unit, eta)

    def finish(self, done: int) -> float:
        """Log the total; returns the seconds it took."""
        seconds = time.perf_counter() - self.started
        progress_log.info("%s: %s %s in %.1f s (%.0f %s/s)", self.what, f"{done:,}", self.unit,
                          seconds, done / max(seconds, 1e-9), self.unit)
        return seconds


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
