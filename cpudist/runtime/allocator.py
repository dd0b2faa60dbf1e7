"""Which malloc the compute processes run on, and putting it in place before they start.

glibc malloc gives big blocks back to the kernel as soon as they are freed (blocks over 32 MB are
mapped and unmapped each time, the heap top is trimmed), so every training step page-faults and
zero-fills its activations again. jemalloc told never to hand pages back reuses them. Measured on
the Qwen2.5-0.5B shape, 2 threads (docs/PERFORMANCE.md): fp32 48.2 -> 36.5 s/step with peak RSS
9.3 -> 7.3 GB; bf16 12.1 -> 10.5 s/step, 5.9 -> 5.2 GB. jemalloc's default decay was slower.

Preloading has to happen before a process starts, so the compute commands (train, bench, eval,
generate, merge) run themselves again, once, with LD_PRELOAD set (`ensure`); `cpudist launch`
and `cpudist scaling` put the same variables into the ranks' environment. CPUDIST_ALLOCATOR
(auto | jemalloc | tcmalloc | none, default auto) chooses; auto falls back to glibc malloc when
neither library is installed (apt-get install libjemalloc2).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from cpudist.errors import UserError

Allocator = Literal["auto", "jemalloc", "tcmalloc", "none"]
CHOICES: tuple[Allocator, ...] = ("auto", "jemalloc", "tcmalloc", "none")
ENV = "CPUDIST_ALLOCATOR"
# Set in the environment of the process run again, so a preload that fails can never loop.
_REEXECUTED = "CPUDIST_ALLOCATOR_REEXECUTED"
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
LIBRARY_NAMES = {"jemalloc": ("libjemalloc.so", "libjemalloc.so.2"),
                 "tcmalloc": ("libtcmalloc.so", "libtcmalloc_minimal.so")}


def _lib_dirs() -> list[Path]:
    machine = platform.machine()
    dirs = [Path(sys.prefix) / "lib", Path(f"/usr/lib/{machine}-linux-gnu"),
            Path(f"/lib/{machine}-linux-gnu"), Path("/usr/lib64"), Path("/usr/local/lib"),
            Path("/usr/lib"), Path("/lib64")]
    return [d for d in dirs if d.is_dir()]


def find_allocator(name: str, dirs: Sequence[Path] | None = None) -> str | None:
    """Path of libjemalloc / libtcmalloc(_minimal) in the usual places, or None."""
    patterns = {"jemalloc": ["libjemalloc.so*"],
                "tcmalloc": ["libtcmalloc.so*", "libtcmalloc_minimal.so*"]}[name]
    for directory in dirs if dirs is not None else _lib_dirs():
        for pattern in patterns:
            # Shortest name first: prefer libjemalloc.so.2 over libjemalloc.so.2.debug-like names.
            matches = sorted(directory.glob(pattern), key=lambda p: (len(p.name), p.name))
            if matches:
                return str(matches[0])
    return None


def choose_allocator(request: str, dirs: Sequence[Path] | None = None
                     ) -> tuple[str | None, str | None]:
    """(allocator name, library path) for a request; (None, None) for glibc malloc."""
    if request not in CHOICES:
        raise UserError(f"{ENV}={request}: choose one of {', '.join(CHOICES)}")
    if request == "none":
        return None, None
    if request == "auto":
        for name in ("jemalloc", "tcmalloc"):
            lib = find_allocator(name, dirs)
            if lib:
                return name, lib
        return None, None
    lib = find_allocator(request, dirs)
    if lib is None:
        package = {"jemalloc": "libjemalloc2", "tcmalloc": "libgoogle-perftools4"}[request]
        raise UserError(
            f"allocator {request}: lib{request} not found in {', '.join(map(str, _lib_dirs()))}; "
            f"install it (apt-get install {package}) or use auto or none")
    return request, lib


def requested(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The allocator asked for: a flag's value, else ENV, else auto."""
    return explicit or (os.environ if environ is None else environ).get(ENV) or "auto"


def _is_allocator(entry: str) -> bool:
    return any(Path(entry).name.startswith(prefix)
               for names in LIBRARY_NAMES.values() for prefix in names)


def preload_env(name: str | None, lib: str | None, ld_preload: str | None) -> dict[str, str]:
    """Variables that make a new process run on allocator `name` at `lib` (None: glibc malloc):
    LD_PRELOAD (other preloads kept after it, other allocators dropped), MALLOC_CONF for jemalloc,
    and ENV so a cpudist command started with them keeps this choice."""
    kept = [e for e in (ld_preload or "").split(":") if e and not _is_allocator(e)]
    env = {ENV: name or "none", "LD_PRELOAD": ":".join([lib, *kept] if lib else kept)}
    if name == "jemalloc":
        env["MALLOC_CONF"] = JEMALLOC_CONF
    return env


def in_use(maps: Path = Path("/proc/self/maps")) -> str:
    """The allocator this process runs on, from its mapped libraries."""
    try:
        text = maps.read_text()
    except OSError:
        return "unknown"
    for name, prefixes in LIBRARY_NAMES.items():
        if any(f"/{prefix}" in text for prefix in prefixes):
            conf = os.environ.get("MALLOC_CONF", "")
            return f"{name} ({conf})" if conf and name == "jemalloc" else name
    return "glibc malloc"


def ensure(request: str | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Run this process again (same pid, same arguments) on the requested allocator when it runs
    on another one; call before anything big is allocated. request: default ENV, else auto."""
    environ = os.environ if environ is None else environ
    request = requested(request, environ)
    if os.environ.pop(_REEXECUTED, None) or sys.platform != "linux":
        return  # this is the run again (the marker must not reach child processes)
    name, lib = choose_allocator(request)
    if in_use().split(" ")[0] == (name or "glibc"):
        return
    env = {**environ, **preload_env(name, lib, environ.get("LD_PRELOAD")), _REEXECUTED: "1"}
    if not env["LD_PRELOAD"]:
        del env["LD_PRELOAD"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
