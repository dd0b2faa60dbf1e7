"""What this process holds in memory: peak resident set, and the proportional set size that counts
pages shared with the node's other ranks (the mapped frozen weights) once per node."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

GB = 1024**3
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
                 Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))  # cgroup v1


def mapped_files(maps: Path = Path("/proc/self/maps")) -> set[str] | None:
    """The files this process has mapped (its libraries among them), or None where maps cannot
    be read."""
    try:
        text = maps.read_text()
    except OSError:
        return None
    return {line.split()[-1] for line in text.splitlines() if "/" in line}


def peak_rss_gb() -> float:
    """Largest resident set of this process so far (ru_maxrss), in GB."""
    import resource

    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


class PssSampler:
    """Largest proportional set size of this process, sampled in the background (psutil)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        import psutil

        self.process = psutil.Process()
        self.peak = 0
        self.interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        with contextlib.suppress(OSError, AttributeError):  # no smaps: no PSS figure
            self.peak = max(self.peak, self.process.memory_full_info().pss)
        return self.peak

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PssSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def node_memory_gb() -> tuple[float, str]:
    """(GB this node's job may use, where that figure comes from): the smallest of MemTotal, the
    cgroup memory limit and Slurm's memory per node."""
    from cpudist.runtime.cluster import slurm_node_memory_mb

    limits: list[tuple[float, str]] = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                limits.append((int(line.split()[1]) * 1024 / GB, "MemTotal"))
    for path in CGROUP_LIMITS:
        with contextlib.suppress(OSError, ValueError):
            text = path.read_text().strip()
            if text != "max" and int(text) < 1 << 60:
                limits.append((int(text) / GB, f"cgroup limit {path}"))
    slurm = slurm_node_memory_mb()
    if slurm:
        limits.append((slurm * 1024**2 / GB, "Slurm memory per node"))
    if not limits:
        import psutil

        return psutil.virtual_memory().total / GB, "psutil"
    return min(limits)
