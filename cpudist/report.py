"""Rank-0 reporting during a run: console progress, OUTPUT/metrics.jsonl, optional TensorBoard.

Pictures and the HTML report are made from metrics.jsonl afterwards (cpudist.plots).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("cpudist")


def peak_rss_gb() -> float:
    import resource

    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


class MetricsLog:
    """Append-only metrics.jsonl; on resume, lines past the checkpoint's step are dropped."""

    def __init__(self, path: Path, resume_step: int | None, tensorboard_dir: Path | None) -> None:
        self.path = path
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        self.writer = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.warning("output.tensorboard=true but tensorboard is not installed "
                            "(pip install 'cpudist[tensorboard]'); writing metrics.jsonl only")
            else:
                self.writer = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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
