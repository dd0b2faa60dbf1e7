"""`cpudist bench`: throughput, memory and MFU of a short LoRA training, timed on the engine's own
step (cpudist.train.engine: the same setup and step as `cpudist train`).

After warm-up steps it reports:
- tokens_per_s: every real (non-padding) token fed, all ranks; label_tokens_per_s: tokens with loss.
- peak_rss_gb per rank (ru_maxrss) and node_pss_gb: the sum over the node's ranks of the largest
  proportional set size seen (shared weight pages count once per node, split between ranks).
- mfu: model FLOPs per second (cpudist.bench.figures) / GEMM peak of the compute dtype measured in
  the same run (before and after the timed steps, several times each, maximum kept, all ranks at
  once).
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from typing import Any

from cpudist.bench.figures import GemmPeak, batch_sample_lengths, flop_model, model_gemm_shapes
from cpudist.bench.options import BenchArgs
from cpudist.bench.samples import bench_samples, bench_step_position
from cpudist.config import Config
from cpudist.data.batches import Batch
from cpudist.data.tokenize import TokenizedSplit
from cpudist.runtime.allocator import in_use as allocator_in_use
from cpudist.runtime.comm import agreed, all_gather, allreduce, barrier, bus_gbps, step_figures
from cpudist.runtime.memory import PssSampler, peak_rss_gb
from cpudist.runtime.process import Process, start_process
from cpudist.train.engine import Datasets, build_engine
from cpudist.train.plan import resolve_batch

log = logging.getLogger("cpudist")


def run_bench(config: Config, args: BenchArgs) -> dict[str, Any] | None:
    """Train warm-up + timed steps as this rank; rank 0 returns the result."""
    with start_process(config.dist) as process:
        return _bench(config, args, process)


def _bench(config: Config, args: BenchArgs, process: Process) -> dict[str, Any] | None:
    placement = process.placement
    config, batch_line = agreed(placement, lambda: resolve_batch(
        config, placement.world_size, placement.local_size))
    if batch_line and placement.is_main:
        log.info("batch: %s", batch_line)
    tc = config.train
    samples = args.steps * tc.batch_size * tc.grad_accum * placement.world_size

    def load_data(tokenizer: Any, model: Any) -> Datasets:
        vocab = model.get_base_model().config.vocab_size
        train, description = bench_samples(config, args.data, samples, tokenizer, vocab)
        return Datasets(train, TokenizedSplit([], []), description)

    total_steps = args.warmup + args.steps
    loading = time.perf_counter()
    engine = build_engine(config, process, load_data, total_steps=total_steps)
    load_s = time.perf_counter() - loading
    rss_loaded = peak_rss_gb()
    precision = engine.session.precision
    flops = flop_model(engine.model)
    tokens = tc.batch_size * config.data.max_length
    gemm = GemmPeak(precision.compute_dtype, model_gemm_shapes(engine.model, tokens))

    def peak() -> float:
        barrier(placement)
        (total,) = allreduce([gemm.probe()], placement)
        return total  # all ranks ran at once: the node's peak

    peaks = [peak()]
    comm: list[list[dict[str, float]]] = []  # per timed step, per rank (comm.step_figures)
    losses: list[float] = []
    step_times: list[float] = []
    step_labels: list[float] = []
    fed = labels = model_flops = 0.0
    sample_count = 0
    timed_batches: list[Batch] = []
    with PssSampler() as pss:
        for step in range(total_steps):
            # Every rank starts the step together, so compute times compare (comm.step_figures).
            barrier(placement)
            started = time.perf_counter()
            engine.comm.take()
            epoch, index = bench_step_position(step, args.warmup, engine.batches.steps_per_epoch)
            micro = engine.micro_batches(epoch, index)
            lengths = [n for b in micro for n in batch_sample_lengths(b)]
            (step_flops,) = allreduce(
                [flops.step_flops(lengths, sum(b.label_tokens for b in micro), len(micro))],
                placement)
            result = engine.step(micro)
            elapsed = time.perf_counter() - started
            step_comm = step_figures(all_gather(engine.comm.take(started), placement))
            losses.append(result.loss)
            if step >= args.warmup:
                comm.append(step_comm)
                step_times.append(elapsed)
                step_labels.append(result.label_tokens)
                fed += result.tokens
                labels += result.label_tokens
                model_flops += step_flops
                sample_count += len(lengths)
                timed_batches += micro
            log.info("bench step %d/%d%s: %.2f s, loss %.4f", step + 1, total_steps,
                     " (warm-up)" if step < args.warmup else "", elapsed, result.loss)
            if step >= args.warmup and step < total_steps - 1:
                peaks.append(peak())  # probes spread through the run, outside the timed steps
    peaks.append(peak())
    profile = None
    if args.profile:
        from cpudist.bench.profile import gemm_roles, profile_step

        epoch, index = bench_step_position(total_steps - 1, args.warmup,
                                           engine.batches.steps_per_epoch)
        micro = engine.micro_batches(epoch, index)
        barrier(placement)
        started = time.perf_counter()
        engine.comm.take()
        profile = profile_step(lambda: engine.step(micro), gemm_roles(engine.model))
        # The same wait and exposed communication as the timed steps' (comm.step_figures).
        profile["communication"] = step_figures(all_gather(engine.comm.take(started), placement))
    pad_cells, pad_real = allreduce([float(sum(b.input_ids.numel() for b in timed_batches)),
                                     float(sum(b.tokens for b in timed_batches))], placement)
    per_rank = all_gather((socket.gethostname(), peak_rss_gb(), pss.peak / 1024**3), placement)
    if not placement.is_main:
        return None
    wall = sum(step_times)
    node_pss: dict[str, float] = {}
    for host, _, pss_gb in per_rank:
        node_pss[host] = node_pss.get(host, 0.0) + pss_gb
    peak_flops = max(peaks)
    achieved = model_flops / wall
    world = placement.world_size
    steps = max(1, len(comm))

    def rank_mean(key: str) -> list[float]:
        return [sum(step[r][key] for step in comm) / steps for r in range(world)]

    comm_bytes = statistics.mean(rank_mean("bytes"))
    compute = rank_mean("compute_s")
    return {
        "tokens_per_s": fed / wall, "label_tokens_per_s": labels / wall,
        "samples_per_s": sample_count / wall, "s_per_step": wall / len(step_times),
        # Robust to other processes stealing the cores for a while (see docs/PERFORMANCE.md).
        "s_per_step_median": statistics.median(step_times),
        "label_tokens_per_s_best_step": max(n / t for n, t in zip(step_labels, step_times,
                                                                   strict=True)),
        "peak_rss_gb": [rss for _, rss, _ in per_rank],
        # Setup of rank 0 (model, data, optimizer, DDP) and its peak RSS by then.
        "load_s": load_s, "peak_rss_after_load_gb": rss_loaded,
        "node_pss_gb": max(node_pss.values()),
        "mfu": achieved / peak_flops,
        # Achieved above the best probe: the probes missed the peak (or the FLOP model is off),
        # so the MFU would be a figure that cannot be; tables mark it.
        "mfu_valid": achieved <= peak_flops,
        "model_tflops": achieved / 1e12, "peak_tflops": peak_flops / 1e12,
        "peak_samples_tflops": [p / 1e12 for p in peaks],
        # Per timed step, as cpudist.runtime.comm.CommMeter defines them: gradient bytes
        # allreduced (per rank, as sent), communication not hidden behind backward (mean over
        # ranks), achieved bus bandwidth, and per rank its compute time and wait for the slowest.
        "comm_mb_per_step": comm_bytes / 1e6,
        "comm_exposed_s_per_step": statistics.mean(rank_mean("exposed_s")),
        "comm_bus_gbps": bus_gbps(comm_bytes, statistics.mean(rank_mean("busy_s")), world),
        "compute_s_per_rank": compute,
        # (slowest - fastest) / mean compute time: the imbalance between ranks.
        "compute_spread": (max(compute) - min(compute)) / statistics.mean(compute)
        if statistics.mean(compute) > 0 else 0.0,
        "wait_for_slowest_s": rank_mean("wait_s"),
        "gradient_mb": sum(p.numel() * p.element_size() for _, p in engine.params) / 1e6,
        "losses": losses,
        "profile": profile,
        "padding_fraction": 0.0 if pad_cells == 0 else 1.0 - pad_real / pad_cells,
        "dtype": precision.describe(), "compiled": engine.compiled, "threads": process.threads,
        "world_size": placement.world_size, "steps": args.steps, "warmup_steps": args.warmup,
        "step_s": step_times, "data": engine.data.description,
        "model_dir": str(engine.session.model_dir), "preset": args.preset, "layers": args.layers,
        "flop_model": flops.as_dict(), "allocator": allocator_in_use(), "framework": "cpudist",
        "config": config.to_dict(),
    }
