"""`cpudist bench`: throughput, memory and MFU of a short training, timed on the engine's own
step (cpudist.train.engine: the same setup and step as `cpudist train`).

After warm-up steps it reports (cpudist.records.BenchResult; the throughput figures come from
cpudist.bench.figures.throughput_figures, the same function the peers' figures come from):
- tokens_per_s: every real (non-padding) token fed, all ranks; label_tokens_per_s: tokens with loss.
- peak_rss_gb per rank (ru_maxrss) and node_pss_gb: the sum over the node's ranks of the largest
  proportional set size seen (shared weight pages count once per node, split between ranks).
- mfu: model FLOPs per second (cpudist.bench.figures) / GEMM peak of the compute dtype measured in
  the same run (before, between and after the timed steps, several times each, maximum kept, all
  ranks at once).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cpudist.bench.figures import (
    FlopModel,
    GemmPeak,
    TimedStep,
    batch_sample_lengths,
    flop_model,
    model_gemm_shapes,
    throughput_figures,
)
from cpudist.bench.options import BenchArgs
from cpudist.bench.samples import bench_samples, bench_step_position
from cpudist.config import Config
from cpudist.objectives import Datasets
from cpudist.records import BenchResult
from cpudist.runtime.allocator import in_use as allocator_in_use
from cpudist.runtime.comm import agreed, all_gather, allreduce, barrier, bus_gbps, step_figures
from cpudist.runtime.memory import PssSampler, peak_rss_gb
from cpudist.runtime.mkl_shim import describe as describe_mkl
from cpudist.runtime.process import Process, start_process
from cpudist.train.engine import Engine, build_engine
from cpudist.train.plan import resolve_batch

log = logging.getLogger("cpudist")


def run_bench(config: Config, args: BenchArgs) -> BenchResult | None:
    """Train warm-up + timed steps as this rank; rank 0 returns the result."""
    with start_process(config.dist) as process:
        return _bench(config, args, process)


def _bench(config: Config, args: BenchArgs, process: Process) -> BenchResult | None:
    placement = process.placement
    config, batch_line = agreed(placement, lambda: resolve_batch(
        config, placement.world_size, placement.local_size))
    if batch_line and placement.is_main:
        log.info("batch: %s", batch_line)
    tc = config.train
    samples = args.steps * tc.batch_size * tc.grad_accum * placement.world_size

    def load_data(tokenizer: Any, model: Any) -> Datasets:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        vocab = base.config.vocab_size
        train, description = bench_samples(config, args.data, samples, tokenizer, vocab)
        return Datasets(train, train.subset([]), description)

    loading = time.perf_counter()
    engine = build_engine(config, process, load_data, total_steps=args.warmup + args.steps)
    load_s, rss_loaded = time.perf_counter() - loading, peak_rss_gb()
    preparing = time.perf_counter()
    prepared = engine.objective.prepare(engine)  # DPO's precomputed reference, as training does it
    prepare_s = time.perf_counter() - preparing if prepared else 0.0
    gemm = GemmPeak(engine.session.precision.compute_dtype,
                    model_gemm_shapes(engine.model, tc.batch_size * config.data.max_length))
    peaks: list[float] = []

    def probe() -> None:
        barrier(placement)
        peaks.extend(allreduce([gemm.probe()], placement))  # all ranks at once: the node's peak

    probe()
    with PssSampler() as pss:
        measured = _timed_steps(engine, args, probe)
    probe()
    profile = _profile(engine, args) if args.profile else None
    per_rank = all_gather((socket.gethostname(), peak_rss_gb(), pss.peak / 1024**3), placement)
    if not placement.is_main:
        return None
    node_pss: dict[str, float] = {}
    for host, _, pss_gb in per_rank:
        node_pss[host] = node_pss.get(host, 0.0) + pss_gb
    return BenchResult(
        **dataclasses.asdict(throughput_figures(measured.steps, peaks)),
        peak_rss_gb=[rss for _, rss, _ in per_rank], node_pss_gb=max(node_pss.values()),
        framework="cpudist", dtype=engine.session.precision.describe(), threads=process.threads,
        world_size=placement.world_size, steps=args.steps, warmup_steps=args.warmup,
        data=engine.data.description, model_dir=str(engine.session.model_dir),
        allocator=allocator_in_use(), mkl=describe_mkl(), flop_model=measured.flops.as_dict(),
        config=config.to_dict(), load_s=load_s, prepare_s=prepare_s, prepared=prepared,
        peak_rss_after_load_gb=rss_loaded,
        losses=measured.losses, compiled=engine.compiled, preset=args.preset, layers=args.layers,
        profile=profile, gradient_mb=sum(p.numel() * p.element_size() for _, p in engine.params) / 1e6,
        **_communication(measured.comm, placement.world_size))


PROBES_BETWEEN = 3


@dataclass
class _Measured:
    flops: FlopModel  # of the model: each step's model FLOPs
    steps: list[TimedStep] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # every step's, warm-up included
    comm: list[list[dict[str, float]]] = field(default_factory=list)  # per timed step, per rank


def _timed_steps(engine: Engine, args: BenchArgs, probe: Callable[[], None]) -> _Measured:
    """Warm-up and timed steps, every rank starting each together (so that compute times compare:
    comm.step_figures), with a GEMM probe between timed steps."""
    placement = engine.placement
    measured = _Measured(flop_model(engine.model))
    # At most PROBES_BETWEEN probes between timed steps: enough to catch a drifting peak, few
    # enough that a long bench is not mostly probing.
    stride = max(1, -(-args.steps // (PROBES_BETWEEN + 1)))
    total = args.warmup + args.steps
    for step in range(total):
        barrier(placement)
        started = time.perf_counter()
        engine.comm.take()
        micro = engine.micro_batches(*bench_step_position(step, args.warmup,
                                                          engine.batches.steps_per_epoch))
        lengths = [n for b in micro for n in batch_sample_lengths(b)]
        flops, samples, cells = allreduce(
            [measured.flops.step_flops(lengths, sum(b.label_tokens for b in micro), len(micro)),
             float(len(lengths)), float(sum(b.input_ids.numel() for b in micro))], placement)
        result = engine.step(micro)
        elapsed = time.perf_counter() - started
        step_comm = step_figures(all_gather(engine.comm.take(started), placement))
        measured.losses.append(result.loss)
        if step >= args.warmup:
            measured.comm.append(step_comm)
            measured.steps.append(TimedStep(elapsed, result.tokens, result.label_tokens,
                                            int(samples), cells, flops))
        log.info("bench step %d/%d%s: %.2f s, loss %.4f", step + 1, total,
                 " (warm-up)" if step < args.warmup else "", elapsed, result.loss)
        if args.warmup <= step < total - 1 and (step - args.warmup + 1) % stride == 0:
            probe()  # probes spread through the run, outside the timed steps
    return measured


def _profile(engine: Engine, args: BenchArgs) -> dict[str, Any]:
    """One more step under torch.profiler (cpudist.bench.profile), with the timed steps' own
    definition of its communication and waiting."""
    from cpudist.bench.profile import gemm_roles, profile_step

    micro = engine.micro_batches(*bench_step_position(args.warmup + args.steps - 1, args.warmup,
                                                      engine.batches.steps_per_epoch))
    barrier(engine.placement)
    started = time.perf_counter()
    engine.comm.take()
    profile = profile_step(lambda: engine.step(micro), gemm_roles(engine.model))
    profile["communication"] = step_figures(all_gather(engine.comm.take(started), engine.placement))
    return profile


def _communication(comm: list[list[dict[str, float]]], world: int) -> dict[str, Any]:
    """The allreduce figures of the timed steps (cpudist.runtime.comm.CommMeter's definitions):
    gradient bytes per rank as sent, communication not hidden behind backward, the achieved bus
    bandwidth, and per rank its compute time and its wait for the slowest rank."""
    steps = max(1, len(comm))

    def rank_mean(key: str) -> list[float]:
        return [sum(step[r][key] for step in comm) / steps for r in range(world)]

    comm_bytes = statistics.mean(rank_mean("bytes"))
    compute = rank_mean("compute_s")
    mean_compute = statistics.mean(compute)
    return {
        "comm_mb_per_step": comm_bytes / 1e6,
        "comm_last_bucket_mb": statistics.mean(rank_mean("last_bucket_bytes")) / 1e6,
        "comm_exposed_s_per_step": statistics.mean(rank_mean("exposed_s")),
        "comm_bus_gbps": bus_gbps(comm_bytes, statistics.mean(rank_mean("busy_s")), world),
        "compute_s_per_rank": compute,
        # (slowest - fastest) / mean compute time: the imbalance between ranks.
        "compute_spread": (max(compute) - min(compute)) / mean_compute if mean_compute > 0 else 0.0,
        "wait_for_slowest_s": rank_mean("wait_s"),
    }
