"""Attention forward + backward on the Qwen2.5-0.5B step's shape (batch 4, 14 heads, 2 KV heads,
512 tokens, head dim 64), bf16, 2 threads: the figures of docs/PERFORMANCE.md, fourth round."""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, KV, S, D = 4, 14, 2, 512, 64


def data():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g).bfloat16().requires_grad_()
    k = torch.randn(B, KV, S, D, generator=g).bfloat16().requires_grad_()
    v = torch.randn(B, KV, S, D, generator=g).bfloat16().requires_grad_()
    return q, k, v


def rep(x):
    return x[:, :, None].expand(B, KV, H // KV, S, D).reshape(B, H, S, D)


def flash(q, k, v):
    return F.scaled_dot_product_attention(q, rep(k), rep(v), is_causal=True)


def flash_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def math_sdpa(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, rep(k), rep(v), is_causal=True)


MASK = torch.full((S, S), float("-inf")).triu(1)


def manual(q, k, v):
    s = torch.matmul(q, rep(k).transpose(-1, -2)) * (D ** -0.5)
    p = torch.softmax(s.float() + MASK, dim=-1).to(q.dtype)
    return torch.matmul(p, rep(v))


manual_c = torch.compile(manual, dynamic=True)
flash_c = torch.compile(flash, dynamic=True)


def timeit(fn, n=5):
    q, k, v = data()
    go = torch.randn(B, H, S, D).bfloat16()
    for _ in range(2):
        fn(q, k, v).backward(go)
    fw, tot = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn(q, k, v)
        t1 = time.perf_counter()
        out.backward(go)
        t2 = time.perf_counter()
        fw.append(t1 - t0)
        tot.append(t2 - t0)
    return min(fw) * 1e3, min(tot) * 1e3


if __name__ == "__main__":
    torch.set_num_threads(2)
    ref = None
    for name, fn in [("flash", flash), ("flash_gqa", flash_gqa), ("math_sdpa", math_sdpa),
                     ("manual", manual), ("manual_compiled", manual_c), ("flash_compiled", flash_c)]:
        f, t = timeit(fn)
        q, k, v = data()
        out = fn(q, k, v).float()
        ref = out if ref is None else ref
        diff = float((out - ref).abs().max())
        print(f"{name:16s} fwd {f:7.1f} ms  fwd+bwd {t:7.1f} ms  max|diff| {diff:.3g}", flush=True)
