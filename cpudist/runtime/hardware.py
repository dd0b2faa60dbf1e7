"""What this machine has: CPU model, the ISA features that decide matmul speed, physical cores.

The compute dtype that follows from the features is decided in cpudist.runtime.precision."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# Flags that matter for matmul speed; bf16 is only fast with AVX512-BF16 or AMX.
_INTERESTING = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8", "avx_vnni", "avx_ne_convert")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: tuple[str, ...]  # the interesting subset, in _INTERESTING order
    vendor: str = ""  # vendor_id: GenuineIntel, AuthenticAMD, ... ("" where not reported)

    @property
    def fast_bf16(self) -> bool:
        return any(flag in self.flags for flag in BF16_FLAGS)


@lru_cache(maxsize=1)
def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    path = Path(cpuinfo_path)
    model, flags, vendor = platform.processor() or platform.machine(), set(), ""
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
            elif key == "vendor_id" and not vendor:
                vendor = value.strip()
    return CpuInfo(model=model, flags=tuple(f for f in _INTERESTING if f in flags), vendor=vendor)


def physical_cores() -> int:
    """Physical cores of this machine (SMT siblings counted once)."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1
