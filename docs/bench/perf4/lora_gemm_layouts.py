"""The LoRA up-projection's backward GEMMs in autograd's layout and in LoraUp's (their r-row
transposes), at Qwen2.5-0.5B's step shape (2,048 tokens, r = 8), 2 threads, on the allocator a
training run uses: the figures in cpudist/model/fast_lora.py and docs/PERFORMANCE.md.
Run: .venv/bin/python docs/bench/perf4/lora_gemm_layouts.py"""
import time

import torch

from cpudist.runtime import allocator

TOKENS, RANK = 2048, 8


def best_ms(fn, repeats=7):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def layouts(h, weight, grad):
    return {
        "grad_B  autograd g^T @ h": best_ms(lambda: grad.t() @ h),
        "grad_B  LoraUp (h^T @ g)^T": best_ms(lambda: (h.t() @ grad).t()),
        "grad_h  autograd g @ B": best_ms(lambda: grad @ weight),
        "grad_h  LoraUp (B^T @ g^T)^T": best_ms(lambda: (weight.t() @ grad.t()).t()),
    }


if __name__ == "__main__":
    allocator.ensure()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    print(f"malloc: {allocator.in_use()}")
    for dtype in (torch.float32, torch.bfloat16):
        for out_features in (4864, 896):
            h = torch.randn(TOKENS, RANK, dtype=dtype)
            weight = torch.randn(out_features, RANK, dtype=dtype)
            grad = torch.randn(TOKENS, out_features, dtype=dtype)
            for name, ms in layouts(h, weight, grad).items():
                print(f"{str(dtype)[6:]:8s} out {out_features:5d}  {name:30s} {ms:6.2f} ms")
