"""CPU flash attention (sdpa, bf16, causal) with and without cpudist's MKL shim, side by side.

Run: python docs/bench/mkl_shim/attention_mkl.py. Each case runs in its own process (the shim is
a preload), alternated twice; each figure is the best of 5 calls after one warm-up. Shapes: the
Qwen2.5-0.5B bench step (4 x 14 heads x 512 x 64, 2 KV heads) and the Qwen2.5-7B one (1 x 28 heads
x 512 x 128, 4 KV heads), with enable_gqa as transformers calls it without a mask.
"""

from __future__ import annotations

import os
import subprocess
import sys

SHAPES = {"qwen2.5-0.5b step": (4, 14, 2, 512, 64), "qwen2.5-7b step": (1, 28, 4, 512, 128)}


def measure() -> None:
    import time

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    for name, (batch, heads, kv, seq, dim) in SHAPES.items():
        q = torch.randn(batch, heads, seq, dim, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, kv, seq, dim, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        forward, backward = [], []
        for _ in range(6):
            started = time.perf_counter()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            middle = time.perf_counter()
            out.sum().backward()
            forward.append(middle - started)
            backward.append(time.perf_counter() - middle)
        print(f"  {name}: forward {min(forward[1:]) * 1e3:.1f} ms, backward "
              f"{min(backward[1:]) * 1e3:.1f} ms", flush=True)


def main() -> None:
    from cpudist.runtime.hardware import cpu_info
    from cpudist.runtime.mkl_shim import build

    shim, why = build()
    if shim is None:
        sys.exit(f"cannot build the shim: {why}")
    info = cpu_info()
    print(f"{info.model} ({info.vendor}; {' '.join(info.flags)}), {os.cpu_count()} CPUs")
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for round_ in (1, 2):
        for label, env in (("as PyTorch ships", base), ("with the shim", {**base, "LD_PRELOAD": shim})):
            print(f"round {round_}, {label}:", flush=True)
            subprocess.run([sys.executable, __file__, "--measure"], env=env, check=True)


if __name__ == "__main__":
    measure() if "--measure" in sys.argv else main()
