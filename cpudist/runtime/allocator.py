"""Which malloc the compute processes run on, and putting it in place before they start.

glibc malloc gives big blocks back to the kernel as soon as they are freed (blocks over 32 MB are
mapped and unmapped each time, the heap top is trimmed), so every training step page-faults and
zero-fills its activations again. An allocator told never to hand pages back reuses them. mimalloc
ships with cpudist (the cmeel-mimalloc wheel is a dependency), so README's install brings the fast
path with no apt step; jemalloc and tcmalloc are used when asked for and installed. Measured side
by side in docs/PERFORMANCE.md ("Allocator").

Preloading has to happen before a process starts, so the compute commands (train, bench, eval,
generate, merge) run themselves again, once, with LD_PRELOAD set (`ensure`); `cpudist launch`
and `cpudist scaling` put the same variables into the ranks' environment. The same LD_PRELOAD
carries MKL's shim (cpudist.runtime.mkl_shim) where the machine wants it. CPUDIST_ALLOCATOR
(auto | mimalloc | jemalloc | tcmalloc | none, default auto) chooses; auto takes the first of
AUTO_ORDER that loads, and glibc malloc when none does.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cpudist.errors import UserError
from cpudist.runtime import mkl_shim
from cpudist.runtime.memory import mapped_files

Allocator = Literal["auto", "mimalloc", "jemalloc", "tcmalloc", "none"]
CHOICES: tuple[Allocator, ...] = ("auto", "mimalloc", "jemalloc", "tcmalloc", "none")
ENV = "CPUDIST_ALLOCATOR"
# Set in the environment of the process run again, so a preload that fails can never loop.
_REEXECUTED = "CPUDIST_ALLOCATOR_REEXECUTED"


@dataclass(frozen=True)
class Library:
    patterns: tuple[str, ...]  # file names to look for, best first
    settings: dict[str, str]  # variables that tune it the way cpudist wants
    apt: str  # where a system copy comes from


LIBRARIES: dict[str, Library] = {
    # Ships with cpudist (the cmeel-mimalloc wheel, a dependency); freed pages are kept for reuse.
    "mimalloc": Library(("libmimalloc.so.3", "libmimalloc.so*"), {"MIMALLOC_PURGE_DELAY": "-1"},
                        "libmimalloc2.0"),
    "jemalloc": Library(("libjemalloc.so.2", "libjemalloc.so*"),
                        {"MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}, "libjemalloc2"),
    "tcmalloc": Library(("libtcmalloc.so*", "libtcmalloc_minimal.so*"), {},
                        "libgoogle-perftools4"),
}
AUTO_ORDER = ("mimalloc", "jemalloc", "tcmalloc")
JEMALLOC_CONF = LIBRARIES["jemalloc"].settings["MALLOC_CONF"]


def _lib_dirs() -> list[Path]:
    machine = platform.machine()
    # The wheel's own prefix first (cmeel-mimalloc installs its library there).
    dirs = [Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix" / "lib", Path(sys.prefix) / "lib",
            Path(f"/usr/lib/{machine}-linux-gnu"), Path(f"/lib/{machine}-linux-gnu"),
            Path("/usr/lib64"), Path("/usr/local/lib"), Path("/usr/lib"), Path("/lib64")]
    return [d for d in dirs if d.is_dir()]


@functools.cache
def _loads(path: str) -> bool:
    """Whether the library preloads here: one with a missing dependency (mimalloc needs
    libatomic.so.1) would kill every process started with it. Checked by preloading it into a
    tiny program, as it will be used (dlopen would refuse jemalloc's static TLS anyway)."""
    true = shutil.which("true") or "/bin/true"
    try:
        done = subprocess.run([true], env={**os.environ, "LD_PRELOAD": path}, capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "ld.so" not in done.stderr


def find_allocator(name: str, dirs: Sequence[Path] | None = None) -> str | None:
    """Path of the allocator's library in the usual places (one that loads), or None."""
    for directory in dirs if dirs is not None else _lib_dirs():
        for pattern in LIBRARIES[name].patterns:
            # Shortest name first: prefer libjemalloc.so.2 over libjemalloc.so.2.debug-like names.
            for match in sorted(directory.glob(pattern), key=lambda p: (len(p.name), p.name)):
                if _loads(str(match)):
                    return str(match)
    return None


def choose_allocator(request: str, dirs: Sequence[Path] | None = None
                     ) -> tuple[str | None, str | None]:
    """(allocator name, library path) for a request; (None, None) for glibc malloc."""
    if request not in CHOICES:
        raise UserError(f"{ENV}={request}: choose one of {', '.join(CHOICES)}")
    if request == "none":
        return None, None
    if request == "auto":
        for name in AUTO_ORDER:
            lib = find_allocator(name, dirs)
            if lib:
                return name, lib
        return None, None
    lib = find_allocator(request, dirs)
    if lib is None:
        raise UserError(
            f"allocator {request}: lib{request} not found (or does not load) in "
            f"{', '.join(map(str, _lib_dirs()))}; install it (apt-get install "
            f"{LIBRARIES[request].apt}) or use auto or none")
    return request, lib


def requested(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The allocator asked for: a flag's value, else ENV, else auto."""
    return explicit or (os.environ if environ is None else environ).get(ENV) or "auto"


def _is_allocator(entry: str) -> bool:
    return any(Path(entry).match(pattern)
               for library in LIBRARIES.values() for pattern in library.patterns)


def preload_env(name: str | None, lib: str | None, ld_preload: str | None,
                shim: str | None = None) -> dict[str, str]:
    """Variables that make a new process run on allocator `name` at `lib` (None: glibc malloc)
    and, given `shim`, with cpudist.runtime.mkl_shim's library: LD_PRELOAD (the allocator, then
    the shim, other preloads kept after them, other allocators and shims dropped), the
    allocator's settings (keep freed pages for reuse), and ENV so a cpudist command started with
    them keeps this choice."""
    kept = [e for e in (ld_preload or "").split(":")
            if e and not _is_allocator(e) and not mkl_shim.is_shim(e)]
    env = {ENV: name or "none", "LD_PRELOAD": ":".join([p for p in (lib, shim) if p] + kept)}
    if name is not None:
        env.update(LIBRARIES[name].settings)
    return env


def in_use(maps: Path = Path("/proc/self/maps")) -> str:
    """The allocator this process runs on, from its mapped libraries."""
    mapped = mapped_files(maps)
    if mapped is None:
        return "unknown"
    for name, library in LIBRARIES.items():
        if any(Path(path).match(pattern) for path in mapped for pattern in library.patterns):
            settings = ",".join(f"{key}={os.environ[key]}" for key in library.settings
                                if key in os.environ)
            return f"{name} ({settings})" if settings else name
    return "glibc malloc"


def ensure(request: str | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Run this process again (same pid, same arguments) on the requested allocator, and with
    MKL's shim where this machine wants it (cpudist.runtime.mkl_shim), when it runs without them;
    call before anything big is allocated. request: default ENV, else auto. Each process checks
    for itself, so the ranks on another node build and preload their node's own shim."""
    environ = os.environ if environ is None else environ
    request = requested(request, environ)
    if os.environ.pop(_REEXECUTED, None) or sys.platform != "linux":
        return  # this is the run again (the marker must not reach child processes)
    name, lib = choose_allocator(request)
    shim = mkl_shim.library(environ)
    if in_use().split(" ")[0] == (name or "glibc") and (
            shim is None or str(Path(shim).resolve()) in (mapped_files() or set())):
        return
    env = {**environ, **preload_env(name, lib, environ.get("LD_PRELOAD"), shim), _REEXECUTED: "1"}
    if not env["LD_PRELOAD"]:
        del env["LD_PRELOAD"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
