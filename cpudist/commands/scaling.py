"""`cpudist scaling --np 1,2,4 [bench flags]`: the bench under mpirun at several rank counts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cpudist.commands.bench import add_bench_flags, bench_args
from cpudist.commands.common import positive_int
from cpudist.errors import UserError

HELP = "the bench under mpirun at several rank counts (threads split per rank)"
DESCRIPTION = ("Run `cpudist bench` under mpirun with each rank count; writes scaling.md, "
               "scaling.json and scaling.png into --out.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_flags(parser)
    parser.add_argument("--np", default="1,2", help="rank counts, comma separated (default 1,2)")
    parser.add_argument("--total-threads", type=positive_int,
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
    parser.add_argument("--fake-nodes", type=positive_int, metavar="N",
                        help="one rank on each of 1, 2, 4, ... N network namespaces of this "
                             "machine, against the same ranks over loopback (root; --batch-size "
                             "is per rank)")
    parser.add_argument("--link", metavar="RATE[,DELAY[,JITTER[,LOSS]]]",
                        help="with --fake-nodes: every node's link, e.g. 100mbit,5ms or "
                             "10gbit,1ms,0.1ms,0.01%% (delay, jitter and loss need sch_netem)")
    parser.add_argument("--predict", action="store_true",
                        help="with --fake-nodes: add the scaling model's tokens/s to each row; "
                             "alone: print the model's table for a 56-core Xeon")


def run(ns: argparse.Namespace) -> int:
    from cpudist.bench.options import bench_config
    from cpudist.bench.scaling import run_scaling, write_scaling
    from cpudist.config import load_config
    from cpudist.runtime.hardware import physical_cores

    if ns.predict and not ns.fake_nodes:
        from cpudist.bench.scaling_model import predicted_table

        print(predicted_table())
        return 0
    if ns.fake_nodes is not None or ns.link:
        return _fake_nodes(ns)
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
        ns.json.write_text(json.dumps([r.to_json() for r in rows], indent=1))
    return 0


def _fake_nodes(ns: argparse.Namespace) -> int:
    from cpudist.bench.options import bench_config
    from cpudist.bench.scaling import fake_table, run_fake_scaling
    from cpudist.launch.netns import check_can_run, parse_link
    from cpudist.runtime.hardware import physical_cores

    if not ns.fake_nodes or not ns.link:
        raise UserError("--fake-nodes N and --link RATE[,DELAY[,JITTER[,LOSS]]] go together")
    if ns.hostfile:
        raise UserError("--fake-nodes makes its own nodes: drop --hostfile")
    link = parse_link(ns.link)
    check_can_run()  # before the first bench: not root is a one-line error, at once
    config_path, overrides, args = bench_args(ns)
    bench_config(config_path, overrides, args)  # fail early, and write the preset once
    rows, raw = run_fake_scaling(config_path, overrides, args, ns.fake_nodes, link,
                                 ns.total_threads or physical_cores(), ns.allocator, ns.predict)
    ns.out.mkdir(parents=True, exist_ok=True)
    table = fake_table(rows)
    (ns.out / "fake-nodes.md").write_text(f"# {ns.fake_nodes} fake nodes, link {ns.link}\n\n"
                                          f"{table}\n")
    (ns.out / "fake-nodes-raw.json").write_text(json.dumps(raw, indent=1))
    print(table)
    print(f"written: {ns.out / 'fake-nodes.md'}, {ns.out / 'fake-nodes-raw.json'}"
          + (f", {ns.json}" if ns.json else ""))
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=1))
    return 0
