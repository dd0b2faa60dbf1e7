"""A scaling model: from one measured (or assumed) step and a link, the step time, tokens/s and
efficiency of N nodes x R ranks. No torch here; `cpudist scaling --predict` and the predicted
table in docs/PERFORMANCE.md use it.

The step of a rank is its compute (forward, backward, optimizer), plus its wait for the slowest
rank (imbalance), plus the gradient allreduce that backward did not hide:

    allreduce(bytes) = 2 (P-1)/P * bytes / bandwidth + 2 (P-1) * latency        (ring, P ranks)

DDP sends the gradients in buckets of `bucket_bytes`, each as backward produces it, and reduces
them in order, one at a time. The k buckets are taken to become ready evenly through backward
(bucket i at backward * i/k), so all but the last can overlap with it; the last one never can:

    exposed = max over i of (ready_i + the allreduces of buckets i..k) - backward

With equal buckets that is max(allreduce(last bucket), sum of the allreduces - backward (k-1)/k).
The last bucket is no bucket like the others when the input embedding trains (peft.method=full):
its gradient is complete only when backward ends (a tied head's with it), and DDP puts a tensor
bigger than the cap in a bucket of its own, so the embedding's bytes (21 % of SmolLM2-135M's, 28 %
of Qwen2.5-0.5B's) are exposed whatever the link (`last_bucket_bytes`, measured by
cpudist.runtime.comm.CommMeter or taken from the shape).

With the optimizer state sharded (train.zero, ZeroRedundancyOptimizer), each rank updates its
share of the weights after the allreduce and sends it to the others: an all-gather of the fp32
weights that nothing hides,

    allgather(bytes) = (P-1)/P * bytes / bandwidth + (P-1) * latency

Ranks of one node are taken to talk over memory at no cost, and every node's link to carry the
ring's full per-rank traffic (a ring ordered node by node crosses each node's link once in each
direction). Loss, jitter and TCP's slow start are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpudist.bench.presets import PRESETS
from cpudist.records import BenchResult


@dataclass(frozen=True)
class StepProfile:
    """One rank's step, without communication."""

    compute_s: float  # forward + backward + optimizer
    tokens: float  # tokens one rank processes per step
    wire_bytes: float  # gradient bytes one rank allreduces per step, as sent
    bucket_bytes: float  # DDP bucket, as sent (dist.bucket_cap_mb, halved by bf16 compression)
    backward_share: float = 0.5  # of compute_s, the backward (the window buckets can overlap)
    imbalance: float = 0.0  # slowest rank's compute over the mean, minus 1
    param_sync_bytes: float = 0.0  # fp32 weights all-gathered after the step (train.zero)
    # The bucket DDP reduces last, as sent, when it is not a bucket's worth like the others: the
    # input embedding's gradient (0: the rest of wire_bytes after full buckets).
    last_bucket_bytes: float = 0.0


@dataclass(frozen=True)
class Prediction:
    nodes: int
    ranks_per_node: int
    step_s: float
    exposed_comm_s: float
    wait_s: float
    tokens_per_s: float
    efficiency: float  # tokens/s over nodes x one node's predicted tokens/s

    def row(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "step_s": round(self.step_s, 4), "exposed_comm_s": round(self.exposed_comm_s, 4),
                "wait_s": round(self.wait_s, 4), "tokens_per_s": round(self.tokens_per_s, 1),
                "efficiency": round(self.efficiency, 3)}


def ring_allreduce_s(nbytes: float, ranks: int, rate_bps: float, latency_s: float) -> float:
    """Seconds of one ring allreduce of `nbytes` per rank over `ranks` ranks."""
    if ranks < 2 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes * 8 / rate_bps + 2 * (ranks - 1) * latency_s


def bucket_sizes(profile: StepProfile) -> list[float]:
    """The bytes of DDP's buckets in the order it reduces them, as sent: full buckets, the rest,
    then the last bucket when the profile names one (unless one bucket holds them all)."""
    if profile.bucket_bytes >= profile.wire_bytes:
        return [profile.wire_bytes]
    last = min(profile.last_bucket_bytes, profile.wire_bytes)
    rest = profile.wire_bytes - last
    full = int(rest // profile.bucket_bytes)
    sizes = [profile.bucket_bytes] * full
    if rest - full * profile.bucket_bytes > 0:
        sizes.append(rest - full * profile.bucket_bytes)
    return [*sizes, last] if last > 0 else sizes


def exposed_comm_s(profile: StepProfile, ranks: int, rate_bps: float, latency_s: float) -> float:
    """The allreduce time backward does not hide, over DDP's buckets (see the module's text)."""
    if ranks < 2 or profile.wire_bytes <= 0:
        return 0.0
    backward = profile.compute_s * profile.backward_share
    costs = [ring_allreduce_s(size, ranks, rate_bps, latency_s) for size in bucket_sizes(profile)]
    k = len(costs)
    # The link finishes the last bucket at the latest of (bucket i ready + buckets i..k in turn).
    finish = max(backward * (i + 1) / k + sum(costs[i:]) for i in range(k))
    return finish - backward


def allgather_s(nbytes: float, ranks: int, rate_bps: float, latency_s: float) -> float:
    """Seconds of a ring all-gather of `nbytes` in all (each rank holding 1/ranks of them)."""
    if ranks < 2 or nbytes <= 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes * 8 / rate_bps + (ranks - 1) * latency_s


def _step(profile: StepProfile, nodes: int, ranks_per_node: int, rate_bps: float,
          latency_s: float) -> tuple[float, float, float]:
    ranks = nodes * ranks_per_node
    wait = profile.compute_s * profile.imbalance if ranks > 1 else 0.0
    comm = (exposed_comm_s(profile, ranks, rate_bps, latency_s)
            + allgather_s(profile.param_sync_bytes, ranks, rate_bps, latency_s)) if nodes > 1 else 0.0
    return profile.compute_s + wait + comm, comm, wait


def predict(profile: StepProfile, nodes: int, ranks_per_node: int, rate_bps: float,
            latency_s: float) -> Prediction:
    """Step time, tokens/s and efficiency of `nodes` x `ranks_per_node` ranks (weak scaling: every
    rank keeps its batch)."""
    step, comm, wait = _step(profile, nodes, ranks_per_node, rate_bps, latency_s)
    one, _, _ = _step(profile, 1, ranks_per_node, rate_bps, latency_s)
    tokens_per_s = profile.tokens * nodes * ranks_per_node / step
    return Prediction(nodes, ranks_per_node, step, comm, wait, tokens_per_s, one / step)


# --------------------------------------------------------------------------- from a bench result


def profile_from_bench(result: BenchResult) -> StepProfile:
    """The step profile a `cpudist bench` result measured (one rank or several on one host):
    its step without the exposed allreduce and the waits, its tokens, bytes and imbalance."""
    dist = result.config["dist"]
    waits = result.wait_for_slowest_s or [0.0]
    compute = result.s_per_step - result.comm_exposed_s_per_step - sum(waits) / len(waits)
    wire_per_element = 2 if dist.get("grad_compression") == "bf16" else 4
    wire = result.comm_mb_per_step
    if not wire:  # one rank sends nothing: what it would send, from its gradient bytes
        wire = result.gradient_mb * wire_per_element / 4
    ranks = result.compute_s_per_rank or [compute]
    mean = sum(ranks) / len(ranks)
    zero = bool(result.config.get("train", {}).get("zero"))
    return StepProfile(
        compute_s=max(compute, 1e-9),
        tokens=result.tokens_per_s * result.s_per_step / result.world_size,
        wire_bytes=wire * 1e6,
        bucket_bytes=dist["bucket_cap_mb"] * 1e6 * wire_per_element / 4,
        imbalance=max(ranks) / mean - 1 if mean > 0 else 0.0,
        param_sync_bytes=result.gradient_mb * 1e6 if zero else 0.0,
        last_bucket_bytes=result.comm_last_bucket_mb * 1e6)


# --------------------------------------------------------------------------- a stated machine


@dataclass(frozen=True)
class Machine:
    name: str
    cores: int
    peak_tflops: float  # bf16 GEMM peak of the whole node, as assumed
    mfu: dict[str, float]  # model FLOPs / peak, per model shape
    about: str


# The per-core bf16 rate and the MFUs measured on a 2-core AMX Xeon VM, taken to scale linearly
# to 56 cores (docs/PERFORMANCE.md, "The scaling model (predicted, not measured)"). AMX's nominal
# peak is about three times that rate: the table assumes what was measured, not the datasheet.
XEON_SPR_56 = Machine(
    "Xeon Sapphire Rapids, 56 cores (e.g. 8480+), AMX bf16", 56, 56 * 1.29,
    {"qwen2.5-0.5b lora": 0.30, "qwen2.5-7b lora": 0.40,
     "smollm2-135m full": 0.30, "qwen2.5-0.5b full": 0.30},
    "bf16 GEMM peak 72 TFLOP/s (56 x the 1.29 TFLOP/s per core measured on a 2-core AMX VM); "
    "LoRA MFU 30 % (0.5B) and 40 % (7B, checkpointing) as measured there; full fine-tuning "
    "taken at 30 % (assumed, not measured on AMX)")


# Shapes the bench builds as presets, and SmolLM2-135M's (a built-in model, not a preset shape:
# HuggingFaceTB/SmolLM2-135M-Instruct's config.json).
SHAPES: dict[str, dict[str, Any]] = {
    **{name: preset.config for name, preset in PRESETS.items() if preset.model_type != "builtin"},
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True),
}


def _linears(preset: str) -> tuple[int, int, int, list[tuple[int, int]]]:
    """(hidden, intermediate, layers, the (in, out) of one decoder layer's linears)."""
    c = SHAPES[preset]
    hidden, inner = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * hidden // c["num_attention_heads"]
    pairs = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden),
             (hidden, inner), (hidden, inner), (inner, hidden)]
    return hidden, inner, c["num_hidden_layers"], pairs


def lora_gradient_bytes(preset: str, rank: int) -> float:
    """fp32 bytes of LoRA's gradients, all-linear (q, k, v, o, gate, up, down) at rank r."""
    _, _, layers, pairs = _linears(preset)
    return 4.0 * rank * sum(a + b for a, b in pairs) * layers


def embedding_gradient_bytes(preset: str) -> float:
    """fp32 bytes of the input embedding's gradient (peft.method=full): DDP's last bucket."""
    c = SHAPES[preset]
    return 4.0 * c["vocab_size"] * c["hidden_size"]


def full_gradient_bytes(preset: str) -> float:
    """fp32 bytes of every weight's gradient (peft.method=full): linears, the two norms of each
    layer, the final norm, the embedding and an untied head (biases left out: under 0.1 %)."""
    c = SHAPES[preset]
    hidden, _, layers, pairs = _linears(preset)
    embedding = c["vocab_size"] * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return 4.0 * (layers * (sum(a * b for a, b in pairs) + 2 * hidden) + hidden + embedding)


def step_flops(preset: str, rank: int, seq: int, rows: int, checkpointing: bool,
               method: str = "lora") -> float:
    """Model FLOPs of one rank's step (the bench's FLOP formula, every token a label), plus the
    forward recomputed under activation checkpointing (work the node does, not model FLOPs).
    method=full trains every linear and the head (6 FLOPs a weight a token, not LoRA's 4 + 6 r)."""
    c = SHAPES[preset]
    hidden, _, layers, pairs = _linears(preset)
    frozen = layers * sum(a * b for a, b in pairs)
    tokens = seq * rows
    if method == "full":
        linear, head = 6 * frozen * tokens, 6 * c["vocab_size"] * hidden * tokens
    else:
        linear = (4 * frozen + 6 * lora_gradient_bytes(preset, rank) / 4) * tokens
        head = 4 * c["vocab_size"] * hidden * tokens
    attention = 6 * layers * hidden * seq * seq * rows
    recompute = (2 * frozen * tokens + 2 * layers * hidden * seq * seq * rows) if checkpointing else 0
    return float(linear + attention + head + recompute)


@dataclass(frozen=True)
class Workload:
    preset: str
    lora_rank: int  # 0: peft.method=full
    seq: int
    rows: int  # per rank per step
    checkpointing: bool

    @property
    def method(self) -> str:
        return "full" if self.lora_rank == 0 else "lora"

    @property
    def gradient_bytes(self) -> float:
        if self.lora_rank == 0:
            return full_gradient_bytes(self.preset)
        return lora_gradient_bytes(self.preset, self.lora_rank)

    def describe(self) -> str:
        what = "full" if self.lora_rank == 0 else f"r={self.lora_rank}"
        return (f"{self.preset} {what}, {self.rows}x{self.seq}"
                f"{', ckpt' if self.checkpointing else ''}")


WORKLOADS = (Workload("qwen2.5-0.5b", 8, 512, 4, False), Workload("qwen2.5-7b", 16, 512, 1, True),
             Workload("smollm2-135m", 0, 512, 4, False), Workload("qwen2.5-0.5b", 0, 512, 4, False))


def machine_profile(machine: Machine, work: Workload, ranks_per_node: int, bucket_cap_mb: float,
                    compression: str, imbalance: float, zero: bool = False) -> StepProfile:
    """A rank's step on `machine` (its cores split between the node's ranks)."""
    flops = step_flops(work.preset, work.lora_rank, work.seq, work.rows, work.checkpointing,
                       work.method)
    per_rank_peak = machine.peak_tflops * 1e12 / ranks_per_node
    # The recomputed forward is work at the same efficiency: count it in the time, not the MFU.
    compute = flops / (per_rank_peak * machine.mfu[f"{work.preset} {work.method}"])
    wire = 2 if compression == "bf16" else 4
    return StepProfile(compute_s=compute, tokens=work.seq * work.rows,
                       wire_bytes=work.gradient_bytes * wire / 4,
                       bucket_bytes=bucket_cap_mb * 1e6 * wire / 4, imbalance=imbalance,
                       param_sync_bytes=work.gradient_bytes if zero else 0.0,
                       last_bucket_bytes=(embedding_gradient_bytes(work.preset) * wire / 4
                                          if work.method == "full" else 0.0))


# The DDP settings the predicted table compares: (label, bucket MB, compression, train.zero).
_SETTINGS: dict[str, tuple[tuple[str, float, str, bool], ...]] = {
    "lora": (("25 MB buckets, fp32", 25.0, "none", False), ("4 MB buckets, bf16", 4.0, "bf16", False)),
    "full": (("25 MB buckets, fp32", 25.0, "none", False), ("25 MB buckets, bf16", 25.0, "bf16", False),
             ("25 MB buckets, bf16, train.zero", 25.0, "bf16", True)),
}


def predicted_table(machine: Machine = XEON_SPR_56, nodes: tuple[int, ...] = (1, 2, 4, 8, 16),
                    links_gbit: tuple[float, ...] = (10, 25, 100), latency_s: float = 50e-6,
                    ranks_per_node: int = 1, imbalance: float = 0.05) -> str:
    """The markdown table of predicted tokens/s and efficiency for `machine`, every workload,
    each link: default buckets in fp32 against small buckets with bf16 compression and, for full
    fine-tuning, that with the optimizer state sharded (train.zero) too."""
    lines = [f"Predicted (cpudist.bench.scaling_model), not measured. {machine.name}: "
             f"{machine.about}; {ranks_per_node} rank(s) per node; link latency "
             f"{latency_s * 1e6:.0f} us; imbalance {imbalance:.0%}.", ""]
    header = ["model (per rank step)", "link", "DDP setting", *(f"{n} node(s)" for n in nodes)]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for work in WORKLOADS:
        for gbit in links_gbit:
            for setting, cap, compression, zero in _SETTINGS[work.method]:
                profile = machine_profile(machine, work, ranks_per_node, cap, compression,
                                          imbalance, zero)
                cells = []
                for n in nodes:
                    p = predict(profile, n, ranks_per_node, gbit * 1e9, latency_s)
                    cells.append(f"{p.tokens_per_s:,.0f} ({p.efficiency:.0%})")
                what = (f"{work.describe()}, {profile.compute_s:.2f} s, "
                        f"{work.gradient_bytes / 1e6:.0f} MB grads")
                lines.append(f"| {what} | {gbit:g} Gbit/s | {setting} | " + " | ".join(cells)
                             + " |")
    lines += ["", "Cells: tokens/s of the whole cluster (efficiency against nodes x one node)."]
    return "\n".join(lines)

