"""The int4 unpack on the 7B's weight shapes: eager, the compiled one-kernel unpack cpudist uses,
and the stacked-halves version it replaced (Inductor writes both halves to buffers and
concatenates them). Median of 7 calls after 2 warm-up calls, into one reused output buffer.

    python docs/bench/issue33/unpack_kernels.py > docs/bench/issue33/unpack_kernels.txt
"""

from __future__ import annotations

import statistics
import time

import torch

from cpudist.model.quantize import METHODS, _dequantize_int4, _unpack_int4_halves


def stacked_halves(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   out: torch.Tensor) -> None:
    rows, _ = packed.shape
    n = scales.shape[1] // 2
    codes = torch.stack([packed & 15, packed >> 4], dim=1).view(rows, 2, n, -1).float()
    out.view(rows, 2, n, -1).copy_(codes * scales.view(rows, 2, n, 1).float()
                                   + zeros.view(rows, 2, n, 1).float())


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, int4 group 64, bf16")
    print("| weight (out x in) | eager ms | compiled, stacked halves ms | compiled, one kernel ms |")
    print("|---|---:|---:|---:|")
    one_kernel = torch.compile(_unpack_int4_halves, dynamic=False)
    stacked = torch.compile(stacked_halves, dynamic=False)
    kernels = (lambda st, out: _dequantize_int4(st, out),
               lambda st, out: stacked(st["qweight"], st["scales"], st["zeros"], out),
               lambda st, out: one_kernel(st["qweight"], st["scales"], st["zeros"], out))
    for rows, cols in [(18944, 3584), (3584, 18944), (3584, 3584), (512, 3584)]:
        stored = METHODS["int4"].quantize(torch.randn(rows, cols) * 0.02, 64, torch.bfloat16)
        out = torch.empty(rows, cols, dtype=torch.bfloat16)
        medians = []
        for kernel in kernels:
            kernel(stored, out)
            kernel(stored, out)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                kernel(stored, out)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times) * 1e3)
        print(f"| {rows} x {cols} | " + " | ".join(f"{m:.1f}" for m in medians) + " |")

if __name__ == "__main__":
    main()
