"""`cpudist bench --profile`: where one training step's time goes.

One extra step runs under torch.profiler after the timed ones. Every operator's own time (its
time minus its children's) is put in one category: the matrix multiplies (GEMM), attention (the
SDPA kernels and everything under them), casts (dtype conversions and copies), the optimizer
(everything under AdamW's step and the gradient clipping), communication (the gradient
allreduce, as cpudist.runtime.comm measures it for the bench's figures) and the rest of the
element-wise work. What no operator accounts for is Python and framework overhead.

The GEMM row is also split by shape (m x k x n, with the rate each shape ran at and its share of
the GEMM peak the bench measured), which says which matmuls run below the machine's peak: on a
fast-GEMM CPU the LoRA matmuls and the vocabulary-wide head are the usual suspects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CATEGORIES = ("GEMM", "attention", "element-wise", "casts", "optimizer", "communication",
              "python / framework")
_GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
         "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm")
GEMM_SHAPES_SHOWN = 12
_CASTS = ("aten::to", "aten::_to_copy", "aten::copy_", "aten::type_as", "aten::clone",
          "aten::contiguous")


def _category(name: str, ancestors: list[str]) -> str:
    if any(a.startswith(("Optimizer.", "cpudist.optimizer")) for a in ancestors + [name]):
        return "optimizer"
    if any(key in a for a in ancestors + [name] for key in ("allreduce", "all_reduce", "gloo:",
                                                            "c10d::", "mpi_allreduce")):
        return "communication"
    if any("scaled_dot_product" in a or "flash_attention" in a for a in ancestors + [name]):
        return "attention"
    if name in _GEMM:
        return "GEMM"
    if name in _CASTS:
        return "casts"
    return "element-wise"


# Where a matmul's two factors sit among its inputs (addmm's and baddbmm's first is the added
# term; an out= tensor may follow them).
_FACTORS = {"aten::mm": 0, "aten::addmm": 1, "aten::bmm": 0, "aten::baddbmm": 1}


def _gemm_shape(name: str, shapes: list[list[int]]) -> tuple[int, int, int, int] | None:
    """(batch, m, k, n) of a matmul from its input shapes; None for int8/int4 packed kernels,
    whose weight shapes are packed."""
    first = _FACTORS.get(name)
    if first is None or len(shapes) < first + 2:
        return None
    left, right = shapes[first], shapes[first + 1]
    if len(left) == 2 and len(right) == 2:
        return 1, left[0], left[1], right[1]
    if len(left) == 3 and len(right) == 3:
        return left[0], left[1], left[2], right[2]
    return None


def gemm_roles(model: Any) -> Callable[[int, int, int, int], str]:
    """What a matmul of a given (batch, m, k, n) is in this peft model's step: the LM head has the
    vocabulary as one side, LoRA's matmuls a rank (or q/k/v's or gate/up's ranks side by side)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    ranks = {layer.out_features for module in model.modules()
             for layer in getattr(module, "lora_A", {}).values() if hasattr(layer, "out_features")}
    lora_sides = {times * rank for rank in ranks for times in (1, 2, 3)}

    def role(batch: int, m: int, k: int, n: int) -> str:
        if batch > 1:
            return "batched"
        if vocab in (m, k, n):
            return "LM head"
        return "LoRA" if min(m, k, n) in lora_sides else "frozen linear"

    return role


def profile_step(run_step: Callable[[], Any], role: Callable[[int, int, int, int], str]
                 ) -> dict[str, Any]:
    """Run one step under the profiler; {category: ms}, the step's wall ms, the top ops and the
    GEMM shapes that took the most time, with what each is (role: gemm_roles)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        started = time.perf_counter()
        run_step()
        wall_ms = (time.perf_counter() - started) * 1e3
    totals = dict.fromkeys(CATEGORIES, 0.0)
    by_op: dict[str, float] = {}
    by_shape: dict[tuple[int, int, int, int], list[float]] = {}  # shape -> [calls, ms]
    events = prof.events()
    for event in events:
        if event.device_type.name != "CPU":
            continue
        ancestors = []
        parent = event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        self_ms = event.self_cpu_time_total / 1e3
        if not event.name.startswith("aten::") and not ancestors and event.name not in _GEMM:
            # Top-level user scopes (record_function, Optimizer.step, ...) count their own time
            # as the framework's; their children are counted below.
            category = _category(event.name, []) if event.name.startswith(
                ("Optimizer.", "cpudist.optimizer")) else "python / framework"
        else:
            category = _category(event.name, ancestors)
        totals[category] += self_ms
        by_op[event.name] = by_op.get(event.name, 0.0) + self_ms
        if category == "GEMM" and (shape := _gemm_shape(event.name, event.input_shapes)):
            calls_ms = by_shape.setdefault(shape, [0, 0.0])
            calls_ms[0] += 1
            calls_ms[1] += self_ms
    counted = sum(totals.values())
    # Threads run ops in parallel inside an op only (intra-op), so operator times add up to at
    # most the wall time; what is left is Python between the ops.
    totals["python / framework"] += max(0.0, wall_ms - counted)
    top = sorted(by_op.items(), key=lambda item: -item[1])[:15]
    shapes = [{"role": role(b, m, k, n), "batch": b, "m": m, "k": k, "n": n,
               "calls": int(calls), "ms": ms,
               "tflops": 2 * b * m * k * n * calls / (ms / 1e3) / 1e12 if ms > 0 else 0.0}
              for (b, m, k, n), (calls, ms) in sorted(by_shape.items(), key=lambda item: -item[1][1])]
    return {"wall_ms": wall_ms, "categories_ms": totals, "top_ops_ms": dict(top),
            "gemm_shapes": shapes[:GEMM_SHAPES_SHOWN]}


def profile_table(profile: dict[str, Any], peak_tflops: float | None = None) -> str:
    wall = profile["wall_ms"]
    lines = ["| where the step's time went | ms | share |", "|---|---:|---:|"]
    for name, ms in profile["categories_ms"].items():
        lines.append(f"| {name} | {ms:.0f} | {100 * ms / wall:.1f} % |")
    lines.append(f"| **step (wall)** | **{wall:.0f}** | 100 % |")
    ranks = profile.get("communication") or []
    if len(ranks) > 1:
        # cpudist.runtime.comm.CommMeter's definitions, as in the bench's figures.
        lines += ["", "| rank | compute ms | wait for slowest ms | exposed allreduce ms | MB sent |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r} | {f['compute_s'] * 1e3:.0f} | {f['wait_s'] * 1e3:.0f} | "
                  f"{f['exposed_s'] * 1e3:.0f} | {f['bytes'] / 1e6:.2f} |"
                  for r, f in enumerate(ranks)]
    lines += ["", "| operator (own time) | ms |", "|---|---:|"]
    lines += [f"| {name} | {ms:.0f} |" for name, ms in profile["top_ops_ms"].items()]
    shapes = profile.get("gemm_shapes") or []
    if shapes:
        peak = f" (GEMM peak {peak_tflops * 1000:.0f} GFLOP/s)" if peak_tflops else ""
        lines += ["", f"| GEMM shape, batch x m x k x n | what | calls | ms | GFLOP/s{peak} |",
                  "|---|---|---:|---:|---:|"]
        for g in shapes:
            share = f" ({100 * g['tflops'] / peak_tflops:.0f} %)" if peak_tflops else ""
            lines.append(f"| {g['batch']} x {g['m']} x {g['k']} x {g['n']} | {g['role']} | "
                         f"{g['calls']} | {g['ms']:.0f} | {g['tflops'] * 1000:.0f}{share} |")
    return "\n".join(lines)
