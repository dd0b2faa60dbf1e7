"""The precision policy: bf16 only where the CPU has AVX512-BF16 or AMX, from /proc/cpuinfo flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpudist.runtime.hardware import cpu_info
from cpudist.runtime.precision import Precision, choose_precision

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
    precision = choose_precision("auto", info)
    assert precision.compute == "float32" and "no AVX512-BF16 or AMX" in precision.reason
    assert not precision.bf16


def test_amx_cpu_trains_in_bf16_and_overrides_win(tmp_path: Path) -> None:
    info = _info(tmp_path, SAPPHIRE)
    assert choose_precision("auto", info) == Precision("bfloat16", "CPU has avx512_bf16, amx_bf16")
    assert choose_precision("float32", info).compute == "float32"
    zen3 = _info(tmp_path, ZEN3)
    precision = choose_precision("bfloat16", zen3)
    assert precision.compute == "bfloat16" and "slower" in precision.reason
    with pytest.raises(ValueError, match="model.dtype='fp16'"):
        choose_precision("fp16", zen3)


def test_precision_drives_autocast_and_frozen_storage() -> None:
    import torch

    bf16, fp32 = Precision("bfloat16", "test"), Precision("float32", "test")
    assert bf16.frozen_dtype == bf16.compute_dtype == torch.bfloat16
    assert fp32.frozen_dtype == torch.float32
    with bf16.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with fp32.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert bf16.describe() == "bfloat16: test"


