"""dtype policy from CPU flags, and `cpudist env` on this machine."""

from __future__ import annotations

from pathlib import Path

from cpudist.hardware import choose_dtype, cpu_info
from tests.conftest import cpudist_cmd, run

ZEN3 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx avx2 fma f16c\n"
SAPPHIRE = ("model name\t: Intel Xeon 8480+\n"
            "flags\t\t: avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile\n")


def _info(tmp_path: Path, text: str):  # noqa: ANN202
    file = tmp_path / "cpuinfo"
    file.write_text(text)
    cpu_info.cache_clear()
    try:
        return cpu_info(str(file))
    finally:
        cpu_info.cache_clear()


def test_avx2_only_cpu_trains_in_fp32(tmp_path: Path) -> None:
    info = _info(tmp_path, ZEN3)
    assert info.model == "AMD EPYC 7B13" and info.flags == ("avx2", "fma")
    dtype, why = choose_dtype("auto", info)
    assert dtype == "float32" and "no AVX512-BF16 or AMX" in why


def test_amx_cpu_trains_in_bf16_and_overrides_win(tmp_path: Path) -> None:
    info = _info(tmp_path, SAPPHIRE)
    assert choose_dtype("auto", info) == ("bfloat16", "CPU has avx512_bf16, amx_bf16")
    assert choose_dtype("float32", info)[0] == "float32"
    zen3 = _info(tmp_path, ZEN3)
    dtype, why = choose_dtype("bfloat16", zen3)
    assert dtype == "bfloat16" and "slower" in why


def test_env_command_reports_machine() -> None:
    result = run([*cpudist_cmd(), "env"], timeout=120)
    assert result.returncode == 0, result.stderr
    keys = [line.split("  ")[0] for line in result.stdout.splitlines()]
    for key in ("cpu", "isa", "dtype (auto)", "threads per rank", "torch", "transformers", "peft",
                "mpi library", "oneccl bindings", "ipex"):
        assert key in keys, key
    expected, _ = choose_dtype("auto")
    assert any(line.startswith("dtype (auto)") and expected in line for line in result.stdout.splitlines())
    from cpudist.allocator import choose_allocator

    malloc = next(line for line in result.stdout.splitlines() if line.startswith("malloc"))
    assert (choose_allocator("auto")[0] or "glibc malloc") in malloc and "CPUDIST_ALLOCATOR=auto" in malloc
