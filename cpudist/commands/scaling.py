"""`cpudist scaling --np 1,2,4 [bench flags]`: the bench under mpirun at several rank counts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cpudist.commands.bench import add_bench_flags, bench_args
from cpudist.errors import UserError

HELP = "the bench under mpirun at several rank counts (threads split per rank)"
DESCRIPTION = ("Run `cpudist bench` under mpirun with each rank count; writes scaling.md, "
               "scaling.json and scaling.png into --out.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_flags(parser)
    parser.add_argument("--np", default="1,2", help="rank counts, comma separated (default 1,2)")
    parser.add_argument("--total-threads", type=int,
                        help="threads of one node, shared by its ranks (default: this machine's "
                             "physical cores)")
    parser.add_argument("--hostfile", "-f",
                        help="run the ranks on these hosts, as `cpudist launch --hostfile` (same "
                             "path, venv and .cache/bench on every node)")
    parser.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for mpirun, repeatable (--mpi-arg=--mca ...)")
    parser.add_argument("--per-rank-batch", action="store_true",
                        help="keep --batch-size per rank (default: the global batch is kept and "
                             "split between the ranks)")
    parser.add_argument("--out", type=Path, default=Path("runs/scaling"), help="output directory")


def run(ns: argparse.Namespace) -> int:
    from cpudist.bench.options import bench_config
    from cpudist.bench.scaling import run_scaling, write_scaling
    from cpudist.config import load_config
    from cpudist.runtime.hardware import physical_cores

    config_path, overrides, args = bench_args(ns)
    try:
        counts = [int(n) for n in ns.np.split(",")]
    except ValueError:
        raise UserError(f"--np {ns.np!r}: give rank counts like 1,2,4") from None
    if not counts or min(counts) < 1:
        raise UserError(f"--np {ns.np!r}: rank counts must be positive")
    bench_config(config_path, overrides, args)  # fail early, and write the preset once
    total = ns.total_threads or physical_cores()
    if args.batch_size is None and not ns.per_rank_batch:
        args.batch_size = load_config(config_path, overrides).train.batch_size
        if args.batch_size == "auto":
            raise UserError("scaling splits one global batch between the rank counts: pass "
                            "--batch-size N (train.batch_size=auto is for train and bench)")
    rows = run_scaling(config_path, overrides, args, counts, total, ns.allocator,
                       ns.per_rank_batch, ns.hostfile, ns.mpi_arg)
    md_path = write_scaling(rows, ns.out)
    print(md_path.read_text())
    print(f"written: {md_path}, {ns.out / 'scaling.json'}, {ns.out / 'scaling.png'}")
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=1))
    return 0
