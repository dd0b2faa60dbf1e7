"""The Qwen2.5-7B head's two GEMMs for 512 label rows (logits, then the hidden states' gradient)
on the whole bf16 weight, against int8 codes cast a block of vocabulary rows at a time into one
scratch buffer with the row scales applied to the products, as
cpudist.model.quantize.QuantizedHead runs them. Mean of 3 calls after a warm-up, torch's threads.
python docs/bench/issue33/head_int8/head_blocks.py > docs/bench/issue33/head_int8/head_blocks.txt"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

VOCAB, HIDDEN, ROWS = 152064, 3584, 512
torch.manual_seed(0)
weight = (torch.randn(VOCAB, HIDDEN) * 0.02).bfloat16()
codes = torch.randint(-127, 128, (VOCAB, HIDDEN), dtype=torch.int8)
scales = torch.rand(VOCAB).bfloat16() * 1e-3
rows = torch.randn(ROWS, HIDDEN).bfloat16()
logits = torch.empty(ROWS, VOCAB, dtype=torch.bfloat16)
grad = torch.empty(ROWS, HIDDEN, dtype=torch.bfloat16)


def whole() -> None:
    torch.mm(rows, weight.t(), out=logits)
    torch.mm(logits, weight, out=grad)


def blocks(size: int) -> Callable[[], None]:
    scratch = torch.empty(size * HIDDEN, dtype=torch.bfloat16)

    def run() -> None:
        for start in range(0, VOCAB, size):
            block = codes[start : start + size]
            operand = scratch[: block.numel()].view(block.shape).copy_(block)
            part = logits[:, start : start + size]
            torch.mm(rows, operand.t(), out=part)
            part.mul_(scales[start : start + size])
        total, product = torch.zeros(ROWS, HIDDEN), torch.empty(ROWS, HIDDEN, dtype=torch.bfloat16)
        for start in range(0, VOCAB, size):
            block = codes[start : start + size]
            operand = scratch[: block.numel()].view(block.shape).copy_(block)
            part = logits[:, start : start + size].mul_(scales[start : start + size])
            total.add_(torch.mm(part, operand, out=product))
        grad.copy_(total)

    return run


print(f"{torch.get_num_threads()} threads; {ROWS} x {HIDDEN} x {VOCAB}, bf16")
for name, run in [("whole bf16 weight", whole), ("int8, blocks of 8192", blocks(8192)),
                  ("int8, blocks of 16384", blocks(16384)), ("int8, blocks of 4096", blocks(4096)),
                  ("whole bf16 weight", whole)]:
    run()
    start = time.perf_counter()
    for _ in range(3):
        run()
    print(f"{name}: {(time.perf_counter() - start) / 3:.3f} s")
