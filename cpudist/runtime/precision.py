"""Precision: the dtype a run computes in, why, and how its frozen weights are stored.

One object travels from the config to every place that needs it (model loading, the autocast
around forward and backward, evaluation, generation, the bench's GEMM peak, logs), so no code
tests dtype strings. bf16 autocast runs only where the CPU has AVX512-BF16 or AMX: elsewhere bf16
is emulated and much slower than fp32. LoRA weights and their optimizer state stay fp32 always.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from cpudist.runtime.hardware import BF16_FLAGS, CpuInfo, cpu_info

if TYPE_CHECKING:
    import torch

ComputeDtype = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class Precision:
    compute: ComputeDtype  # dtype of the matmuls (autocast target)
    reason: str  # why: the CPU feature found, or the setting that asked for it

    @property
    def bf16(self) -> bool:
        return self.compute == "bfloat16"

    @property
    def compute_dtype(self) -> torch.dtype:
        import torch

        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def frozen_dtype(self) -> torch.dtype:
        """Storage dtype of the frozen base weights: the compute dtype, so no step re-casts them."""
        return self.compute_dtype

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context forward and backward run in."""
        import torch

        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16)

    def describe(self) -> str:
        """One line for logs and result files, e.g. 'bfloat16: CPU has avx512_bf16'."""
        return f"{self.compute}: {self.reason}"


def choose_precision(requested: str, info: CpuInfo | None = None) -> Precision:
    """The precision for model.dtype = auto | float32 | bfloat16 on this CPU."""
    info = info or cpu_info()
    if requested in ("float32", "bfloat16"):
        note = ""
        if requested == "bfloat16" and not info.fast_bf16:
            note = " (warning: this CPU has no AVX512-BF16/AMX, bf16 will be much slower than fp32)"
        return Precision(requested, f"set by model.dtype{note}")  # type: ignore[arg-type]
    if requested != "auto":
        raise ValueError(f"model.dtype={requested!r}: choose auto, float32 or bfloat16")
    if info.fast_bf16:
        found = [flag for flag in BF16_FLAGS if flag in info.flags]
        return Precision("bfloat16", f"CPU has {', '.join(found)}")
    return Precision("float32", "CPU has no AVX512-BF16 or AMX, so bf16 would be emulated and slow")
