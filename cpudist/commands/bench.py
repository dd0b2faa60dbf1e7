"""`cpudist bench [CONFIG] [section.key=value ...] [--preset P] [--vs hf] ...`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, get_args

from cpudist.bench.options import DATA_KINDS, BenchArgs
from cpudist.bench.presets import PRESETS
from cpudist.commands.common import add_settings, non_negative_int, positive_int, split_settings
from cpudist.config import Config, PeftSection
from cpudist.records import BenchResult
from cpudist.runtime.allocator import CHOICES as ALLOCATORS

HELP = "throughput / memory / MFU of a short training (optionally vs HF Trainer)"
DESCRIPTION = ("Train a few steps on a preset (random weights, exact architecture) and report "
               "tokens/s, label tokens/s, samples/s, s/step, peak RSS per rank, node PSS and MFU "
               "against the GEMM peak measured in the same run.")


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `bench` and `scaling` share."""
    add_settings(parser)
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="random-weight model of this architecture (smollm2-135m: the real one)")
    parser.add_argument("--layers", type=positive_int, help="keep only the first N decoder layers")
    parser.add_argument("--data", default="synthetic", choices=DATA_KINDS,
                        help="synthetic: full-length rows, all labels; instruct: data.path with "
                             "real lengths and prompt masking (default chatterbot:english)")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps (default 3)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed first steps (default 1)")
    parser.add_argument("--batch-size", type=positive_int, help="train.batch_size")
    parser.add_argument("--seq-len", type=positive_int, help="data.max_length (synthetic row length)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], help="model.dtype")
    parser.add_argument("--threads", type=positive_int, help="dist.threads_per_rank")
    parser.add_argument("--objective", choices=["sft", "dpo", "orpo"],
                        help="train.objective; dpo and orpo time preference pairs (synthetic: a "
                             "prompt of half of --seq-len, then two answers of the other half, so "
                             "each sequence is --seq-len tokens; instruct: chatterbot-pairs:english)")
    parser.add_argument("--method", choices=get_args(PeftSection.model_fields["method"].annotation),
                        help="peft.method: an adapter method, or full (every weight trains; the "
                             "--vs hf peer then trains the whole model too)")
    parser.add_argument("--allocator", choices=ALLOCATORS,
                        help="malloc of cpudist's benchmark processes (default: CPUDIST_ALLOCATOR, "
                             "else auto = mimalloc, which ships with cpudist); --hf-allocator sets HF's")
    parser.add_argument("--json", type=Path,
                        help="write the result here (bench: - prints it as one line on stdout)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more step: where its time goes (GEMM, attention, "
                             "element-wise, casts, optimizer, communication, Python), as a table "
                             "and a picture beside --json")


def bench_args(ns: argparse.Namespace) -> tuple[str | None, list[str], BenchArgs]:
    """(config file, overrides, BenchArgs) of parsed bench flags, checked."""
    config_path, overrides = split_settings(ns.settings)
    return config_path, overrides, BenchArgs(ns.preset, ns.layers, ns.data, ns.steps, ns.warmup,
                                             ns.batch_size, ns.seq_len, ns.dtype, ns.threads,
                                             ns.profile, ns.objective, ns.method)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_flags(parser)
    parser.add_argument("--vs", choices=["hf", "trl"], help="also run a peer on the same model, "
                        "data and settings (separate processes) and print ratios: hf = Hugging "
                        "Face Trainer + PEFT (sft), trl = TRL's DPOTrainer + PEFT (--objective dpo)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="run this many times (each in its own process) and report every "
                             "run's MFU and tokens/s with their spread; with --vs, alternate "
                             "cpudist and HF and keep the best of each")
    parser.add_argument("--hf-allocator", default="none", choices=ALLOCATORS,
                        help="with --vs: malloc of the peer (default none: glibc malloc, as HF "
                             "Trainer runs unless you preload one; auto gives it cpudist's)")


def run(ns: argparse.Namespace) -> int:
    from cpudist.bench.figures import format_table
    from cpudist.bench.options import bench_config

    config_path, overrides, args = bench_args(ns)
    config = bench_config(config_path, overrides, args)
    if ns.vs:
        return _run_vs(ns, config, args)
    if ns.rounds > 1:
        return _run_rounds(ns, config, args)
    from cpudist.bench.child import print_result
    from cpudist.bench.run import run_bench

    result = run_bench(config, args)  # on --allocator: the CLI started this process on it
    if result is None:  # not rank 0
        return 0
    print(format_table({"cpudist": result}))
    if result.profile:
        _show_profile(result.profile, result.peak_tflops, ns.json)
    if ns.json == Path("-"):
        print_result(result)
    elif ns.json:
        ns.json.write_text(json.dumps(result.to_json(), indent=1))
    return 0


def _show_profile(profile: dict, peak_tflops: float | None, json_path: Path | None) -> None:
    from cpudist.bench.profile import profile_table

    print()
    print(profile_table(profile, peak_tflops))
    if json_path and json_path != Path("-"):
        from cpudist.report.plots import write_profile_plot

        png = write_profile_plot(profile, json_path.with_name(json_path.stem + "-profile.png"))
        print(f"written: {png}")


def _run_vs(ns: argparse.Namespace, config: Config, args: BenchArgs) -> int:
    from cpudist.bench.figures import FIGURES, format_table
    from cpudist.bench.peers import PEERS, run_vs
    from cpudist.report.plots import write_vs_plot

    outcome = run_vs(ns.vs, config, args, ns.rounds, ns.allocator, ns.hf_allocator)
    peer_name = PEERS[ns.vs][0]
    sides = list(outcome.best)
    print(format_table(outcome.best, ratios=[("cpudist", side) for side in sides[1:]]))
    if ns.json:
        ns.json.write_text(json.dumps(outcome.to_json(), indent=1))
        series = [("as each ships", outcome.ratios)]
        if outcome.ratios_same_malloc is not None:
            series.append(("same malloc", outcome.ratios_same_malloc))
        ours = outcome.best["cpudist"]
        png = write_vs_plot(series, {key: label for key, label, _ in FIGURES}, peer_name,
                            f"cpudist vs {peer_name}: {ours.data.split(':')[0]}, "
                            f"{ours.dtype.split(':')[0]}", ns.json.with_suffix(".png"))
        print(f"written: {ns.json}, {png}")
    return 0


def _run_rounds(ns: argparse.Namespace, config: Config, args: BenchArgs) -> int:
    """The bench `--rounds` times, each in its own process; every run's figures and their spread."""
    import sys
    import tempfile

    from cpudist.bench.child import child_env, run_json

    runs = []
    with tempfile.TemporaryDirectory(prefix="cpudist-rounds-") as tmp:
        resolved = Path(tmp) / "config.yaml"
        resolved.write_text(config.to_yaml())
        timing = ["--data", args.data, "--steps", str(args.steps), "--warmup", str(args.warmup)]
        for _ in range(ns.rounds):
            runs.append(run_json([sys.executable, "-m", "cpudist.cli", "bench", str(resolved),
                                  *timing], child_env(ns.allocator), "cpudist bench"))
    summary, lines = summarize_rounds(runs)
    print("\n".join(lines))
    if ns.json:
        ns.json.write_text(json.dumps(summary, indent=1))
    return 0


def summarize_rounds(runs: list[BenchResult]) -> tuple[dict[str, Any], list[str]]:
    """The spread of `--rounds` runs: (summary for the JSON, lines to print)."""
    import statistics

    lines = ["| run | tokens/s | s/step | MFU | GEMM peak TFLOP/s |", "|---:|---:|---:|---:|---:|"]
    for number, r in enumerate(runs, start=1):
        mark = "" if r.mfu_valid else " (invalid)"
        lines.append(f"| {number} | {r.tokens_per_s:.1f} | {r.s_per_step:.2f} | "
                     f"{r.mfu:.1%}{mark} | {r.peak_tflops:.3f} |")
    valid = [r.mfu for r in runs if r.mfu_valid]
    # The machine's peak does not change between runs, but a run's probes can all read low, which
    # flatters that run's MFU: against the best peak of all the runs no run is flattered
    # (docs/PERFORMANCE.md, "The GEMM peak and MFU").
    best_peak = max(r.peak_tflops for r in runs)
    against_best = [r.model_tflops / best_peak for r in runs]
    summary = {"runs": [r.to_json() for r in runs],
               "mfu_median": statistics.median(valid) if valid else None,
               "mfu_min": min(valid, default=None), "mfu_max": max(valid, default=None),
               "best_peak_tflops": best_peak,
               "mfu_best_peak_median": statistics.median(against_best),
               "mfu_best_peak_min": min(against_best), "mfu_best_peak_max": max(against_best),
               "tokens_per_s_median": statistics.median(r.tokens_per_s for r in runs)}
    if valid:
        lines.append(f"\nMFU over {len(valid)} valid run(s): median {summary['mfu_median']:.1%} "
                     f"(min {summary['mfu_min']:.1%}, max {summary['mfu_max']:.1%})")
    lines.append(f"MFU against the best GEMM peak of all runs ({best_peak:.3f} TFLOP/s): median "
                 f"{summary['mfu_best_peak_median']:.1%} (min {summary['mfu_best_peak_min']:.1%}, "
                 f"max {summary['mfu_best_peak_max']:.1%})")
    return summary, lines
