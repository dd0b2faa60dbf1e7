"""MKL's kernels on CPUs that are not Intel's: a preloaded answer to its vendor check.

PyTorch's x86 wheels link MKL in, and MKL runs every fp32 GEMM (`mm`, `addmm`, `bmm` in fp32)
and, inside CPU flash attention (what `sdpa` runs), the bf16 GEMMs of its forward and backward
(`cblas_gemm_bf16bf16f32`). MKL chooses its kernels by CPU vendor first: on a CPU whose vendor is
not GenuineIntel it runs code that leaves AVX-512 unused. On an AMD Zen 5 with AVX-512 and
AVX512-BF16 that halved the fp32 GEMM rate (0.22 against 0.52 TFLOP/s on the bench's probe) and
ran flash attention's bf16 products in fp32 at about a tenth of the CPU's bf16 GEMM rate (its
forward on the Qwen2.5-7B shape took 22 ms in bf16, as long as in fp32). MKL asks its exported
function `mkl_serv_intel_cpu_true()`; a library preloaded before libtorch that defines it to
return 1 makes MKL choose its kernels by the CPU's feature bits, as it does on Intel CPUs. On
that Zen 5 the attention forward then took 6 ms and an fp32 training step half its time;
measured steps are in docs/PERFORMANCE.md ("MKL on AMD CPUs").

The library is one line of C, built on first use with the C compiler that torch.compile also needs
(`cc`, or $CC) into the user's cache ($XDG_CACHE_HOME/cpudist, else ~/.cache/cpudist), and put in
LD_PRELOAD with the allocator (cpudist.runtime.allocator), so the compute commands, the ranks
they run as and the bench's children all get it. CPUDIST_MKL_SHIM chooses: auto (default)
preloads it on x86 CPUs that are not Intel's and have AVX-512 (AMD Zen 4 and later, where it was
measured), on preloads it on any x86 CPU that is not Intel's (AVX2-only ones: not measured), off
never. Without a C compiler the processes run as PyTorch ships and `cpudist env` says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from cpudist.errors import UserError
from cpudist.runtime.hardware import cpu_info
from cpudist.runtime.memory import mapped_files

ENV = "CPUDIST_MKL_SHIM"
CHOICES = ("auto", "on", "off")
SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
# The built file's name starts with this, so a preload list can tell it from other libraries.
PREFIX = "libcpudist_mkl_shim"


def requested(environ: Mapping[str, str] | None = None) -> str:
    request = (os.environ if environ is None else environ).get(ENV) or "auto"
    if request not in CHOICES:
        raise UserError(f"{ENV}={request}: choose one of {', '.join(CHOICES)}")
    return request


def why_not(request: str) -> str | None:
    """Why this machine does not want the shim under `request`, or None when it does."""
    info = cpu_info()
    if request == "off":
        return f"{ENV}=off"
    if platform.machine() not in ("x86_64", "AMD64"):
        return "not an x86 CPU (no MKL in PyTorch's wheel)"
    if info.vendor == "GenuineIntel":
        return "an Intel CPU: MKL already chooses its kernels by the CPU's features"
    if request == "auto" and "avx512f" not in info.flags:
        return f"no AVX-512 (auto preloads it only where it was measured; {ENV}=on forces it)"
    return None


def is_shim(entry: str) -> bool:
    return Path(entry).name.startswith(PREFIX)


def _ours(path: Path) -> bool:
    """Owned by this user and writable by no one else (a shared /tmp must not supply it)."""
    status = path.stat()
    return status.st_uid == os.getuid() and not status.st_mode & 0o022


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cpudist"


def c_compiler() -> str | None:
    """The C compiler the shim is built with: $CC, else cc, gcc or clang on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which(
        "clang")


@functools.cache
def build() -> tuple[str | None, str]:
    """(path of the built library, "") or (None, why it could not be built). Built once per
    machine and source; written under a temporary name and renamed, so concurrent ranks never
    preload half a file. Every process preloads it, so a file or directory that another user
    could have written is passed over (then a private directory under the temporary one)."""
    compiler = c_compiler()
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"cpudist-{os.getuid()}"):
        target = directory / f"{PREFIX}-{digest}.so"
        try:
            if target.is_file():
                if _ours(directory) and _ours(target):
                    return str(target), ""
                continue  # every process would preload it: only a file of this user's will do
            if compiler is None:
                return None, "no C compiler (cc) to build it (apt-get install gcc)"
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _ours(directory):
                continue
            with tempfile.TemporaryDirectory(dir=directory) as tmp:
                source, built = Path(tmp) / "shim.c", Path(tmp) / "shim.so"
                source.write_text(SOURCE)
                done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(built),
                                       str(source)], capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    return None, f"{compiler} failed: {done.stderr.strip()[:200]}"
                built.chmod(0o755)
                built.replace(target)
            return str(target), ""
        except OSError:
            continue  # an unwritable cache: try the next place
        except subprocess.TimeoutExpired:
            return None, f"{compiler} took over 120 s"
    return None, "no writable cache directory for it"


def _choice(environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(the shim's path, "") where this machine wants it and it is built, else (None, why not)."""
    reason = why_not(requested(environ))
    return build() if reason is None else (None, reason)


def library(environ: Mapping[str, str] | None = None) -> str | None:
    """The shim's path when this machine wants it (CPUDIST_MKL_SHIM) and it could be built."""
    return _choice(environ)[0]


def for_compute_commands() -> str:
    """What the processes cpudist starts get (`cpudist env`)."""
    path, reason = _choice()
    if path:
        return f"kernels chosen by the CPU's features: {path} preloaded ({ENV}={requested()})"
    return f"as shipped: {reason}"


def describe(maps: Path = Path("/proc/self/maps")) -> str:
    """One line on MKL's kernel choice in this process, for logs and result files."""
    if any(is_shim(path) for path in mapped_files(maps) or ()):
        return "kernels chosen by the CPU's features (cpudist's shim preloaded)"
    path, reason = _choice()
    return f"as shipped ({'not preloaded in this process' if path else reason})"
