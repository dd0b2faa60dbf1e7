"""MKL's shim: which machines get it, building it, and preloading it ahead of libtorch."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpudist.errors import UserError
from cpudist.runtime import mkl_shim
from cpudist.runtime.hardware import CpuInfo


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """build() into an empty cache of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    mkl_shim.build.cache_clear()
    yield tmp_path / "cache" / "cpudist"
    mkl_shim.build.cache_clear()


def _built(cache: Path) -> str:
    path, why = mkl_shim.build()
    if path is None and why.startswith("no C compiler"):
        pytest.skip(why)
    assert path is not None, why
    assert Path(path).parent == cache and mkl_shim.is_shim(path)
    return path


def test_which_cpus_want_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mkl_shim.platform, "machine", lambda: "x86_64")

    def on(vendor: str, *flags: str) -> None:
        monkeypatch.setattr(mkl_shim, "cpu_info", lambda: CpuInfo("cpu", tuple(flags), vendor))

    on("AuthenticAMD", "avx2", "avx512f", "avx512_bf16")
    assert mkl_shim.why_not("auto") is None and mkl_shim.why_not("on") is None
    assert mkl_shim.why_not("off") == "CPUDIST_MKL_SHIM=off"
    on("AuthenticAMD", "avx2", "fma")  # AVX2 only: not measured, so only when asked for
    assert "no AVX-512" in mkl_shim.why_not("auto") and mkl_shim.why_not("on") is None
    on("GenuineIntel", "avx2", "avx512_bf16", "amx_bf16")  # MKL's own vendor: nothing to do
    assert "an Intel CPU" in mkl_shim.why_not("on")
    monkeypatch.setattr(mkl_shim.platform, "machine", lambda: "aarch64")
    assert "not an x86 CPU" in mkl_shim.why_not("on")
    assert mkl_shim.requested({}) == "auto"
    with pytest.raises(UserError, match="CPUDIST_MKL_SHIM=yes: choose one of auto, on, off"):
        mkl_shim.requested({"CPUDIST_MKL_SHIM": "yes"})


def test_built_once_and_answers_mkl_vendor_check_with_yes(fresh_build: Path) -> None:
    path = _built(fresh_build)
    assert ctypes.CDLL(path).mkl_serv_intel_cpu_true() == 1
    mtime = os.stat(path).st_mtime_ns
    mkl_shim.build.cache_clear()
    assert mkl_shim.build() == (path, "") and os.stat(path).st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in fresh_build.iterdir()] == [Path(path).name]  # no leftovers


def test_a_file_others_could_have_written_is_never_preloaded(
        fresh_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(_built(fresh_build))
    path.chmod(0o777)  # writable by anyone: it could hold anything by now
    monkeypatch.setattr(mkl_shim.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    mkl_shim.build.cache_clear()
    again, _ = mkl_shim.build()
    assert again is not None and Path(again).parent == tmp_path / "tmp" / f"cpudist-{os.getuid()}"
    assert oct(Path(again).parent.stat().st_mode & 0o777) == "0o700"


def test_without_a_compiler_it_says_so(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(mkl_shim.shutil, "which", lambda name: None)
    assert mkl_shim.build() == (None, "no C compiler (cc) to build it (apt-get install gcc)")


def test_preload_env_puts_the_shim_after_the_allocator_and_drops_stale_ones() -> None:
    from cpudist.runtime.allocator import preload_env

    old = "/home/u/.cache/cpudist/libcpudist_mkl_shim-000000000000.so"
    env = preload_env("jemalloc", "/lib/libjemalloc.so.2", f"{old}:/opt/a.so", "/c/libcpudist_mkl_shim-1.so")
    assert env["LD_PRELOAD"] == "/lib/libjemalloc.so.2:/c/libcpudist_mkl_shim-1.so:/opt/a.so"
    assert preload_env(None, None, f"/opt/a.so:{old}")["LD_PRELOAD"] == "/opt/a.so"


def test_mkl_inside_libtorch_calls_the_preloaded_definition(tmp_path: Path) -> None:
    """What the shim relies on, across the process boundary: MKL, linked into libtorch_cpu, looks
    its vendor check up through the dynamic linker, so a preloaded definition is the one it runs.
    A stand-in with the shim's symbol counts its calls during one fp32 matmul (MKL's sgemm)."""
    from cpudist.runtime.hardware import cpu_info

    compiler = mkl_shim.c_compiler()
    if compiler is None or sys.platform != "linux" or mkl_shim.platform.machine() != "x86_64":
        pytest.skip("needs a C compiler and PyTorch's x86 wheel (MKL inside)")
    if cpu_info().vendor == "GenuineIntel":
        pytest.skip("the shim is for CPUs that are not Intel's")
    source, probe = tmp_path / "probe.c", tmp_path / "libprobe.so"
    source.write_text("int calls = 0;\n"
                      "int mkl_serv_intel_cpu_true(void) { calls++; return 1; }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(probe), str(source)], check=True)
    count = ("import ctypes, torch\n"
             "torch.randn(64, 64) @ torch.randn(64, 64)\n"
             f"print(ctypes.c_int.in_dll(ctypes.CDLL({str(probe)!r}), 'calls').value)\n")
    done = subprocess.run([sys.executable, "-c", count], capture_output=True, text=True,
                          env={**os.environ, "LD_PRELOAD": str(probe)}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) > 0


def test_describe_reads_this_process_s_mapped_libraries(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPUDIST_MKL_SHIM", "off")
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /home/u/.cache/cpudist/libcpudist_mkl_shim-ab.so\n")
    assert mkl_shim.describe(maps) == "kernels chosen by the CPU's features (cpudist's shim preloaded)"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert mkl_shim.describe(maps) == "as shipped (CPUDIST_MKL_SHIM=off)"
