"""Console progress on rank 0: a progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("cpudist")


class Progress:
    """A progress bar on a terminal; plain log lines otherwise (CI logs, files, mpirun output)."""

    def __init__(self, total: int, start: int, enabled: bool, allow_bar: bool = True) -> None:
        self.total = total
        self.enabled = enabled
        self.bar = None
        self.started = time.perf_counter()
        self.start_step = start
        # Under mpirun the bar's carriage-return redraws end up in captured logs: plain lines there.
        if enabled and allow_bar and sys.stdout.isatty():
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
        log.info("step %d/%d  loss %.4f  lr %.2e  %.0f tok/s  eta %s", step, self.total, loss, lr,
                 tokens_per_s, _duration(eta))

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)
        elif self.enabled:
            log.info(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
