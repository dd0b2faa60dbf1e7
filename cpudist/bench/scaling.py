"""`cpudist scaling`: the bench under mpirun at several rank counts, on one machine or a hostfile's.

The mpirun command (hostfile, binding, thread variables, allocator preload) is the one `cpudist
launch` builds; rank 0 prints its figures on stdout, so it may run on another node.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from cpudist.bench.child import run_json
from cpudist.bench.options import BenchArgs
from cpudist.errors import UserError
from cpudist.launch import hostfile as hostfiles
from cpudist.launch.hostfile import Hostfile
from cpudist.launch.mpi import (
    MpiInfo,
    build_command,
    caller_settings,
    detect_mpi,
    plan_layout,
    prepare_hostfile,
)
from cpudist.launch.netns import Link
from cpudist.records import BenchResult
from cpudist.runtime.allocator import choose_allocator, requested


def run_scaling(config_path: str | None, overrides: list[str], args: BenchArgs,
                counts: list[int], total_threads: int, allocator: str | None,
                per_rank_batch: bool = False, hostfile: str | None = None,
                mpi_args: list[str] | None = None) -> list[BenchResult]:
    """The bench under mpirun at each rank count, threads split between the ranks of a node; the
    mpirun command (hostfile, binding, thread variables, allocator preload) is the one `cpudist
    launch` builds. Rank 0 prints its figures on stdout, so it may run on another node."""
    mpi = detect_mpi()
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpudist-scaling-") as workdir:
        path, hosts = prepare_hostfile(hostfile, mpi, workdir) if hostfile else (None, None)
        for np in counts:
            batch = args.batch_size
            if batch and not per_rank_batch:
                # Same global batch at every rank count: each rank gets its share.
                if batch % np:
                    raise UserError(f"--batch-size {batch} does not split over {np} ranks; choose "
                                    "a multiple of every rank count, or pass --per-rank-batch")
                batch //= np
            cmd = bench_command(mpi, np, config_path, overrides, args, batch, total_threads,
                                allocator, path, hosts, mpi_args or [])
            rows.append(run_json(cmd, _env(), f"bench with {np} rank(s)", on_stdout=True))
    return rows


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def bench_command(mpi: MpiInfo, np: int, config_path: str | None, overrides: list[str],
                  args: BenchArgs, batch: int | None, total_threads: int, allocator: str | None,
                  hostfile: str | None = None, hosts: Hostfile | None = None,
                  mpi_args: list[str] | tuple[str, ...] = (), bind: bool | None = None
                  ) -> list[str]:
    """The mpirun command of one bench at `np` ranks: `batch` rows per rank, the node's
    `total_threads` shared by its ranks (the busiest node's)."""
    name, lib = choose_allocator(requested(allocator))
    threads = plan_layout(np, total_threads, hosts, None).threads
    flags = BenchArgs(**{**args.__dict__, "threads": threads, "batch_size": batch}).flags()
    program = ["bench"] + ([config_path] if config_path else []) + [*overrides, *flags]
    return build_command(mpi, np, program, python=sys.executable, cores_per_node=total_threads,
                         hostfile=hostfile, hosts=hosts, threads_per_rank=threads, allocator=name,
                         preload=lib, mpi_args=mpi_args, bind=bind, **caller_settings(os.environ))


# --------------------------------------------------------------------------- fake nodes


def node_counts(nodes: int) -> list[int]:
    """1, 2, 4, ... up to `nodes`, and `nodes` itself."""
    counts = [1]
    while counts[-1] * 2 <= nodes:
        counts.append(counts[-1] * 2)
    return counts if counts[-1] == nodes else [*counts, nodes]


def run_fake_scaling(config_path: str | None, overrides: list[str], args: BenchArgs, nodes: int,
                     link: Link, total_threads: int, allocator: str | None,
                     predict: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """For each node count n of node_counts(nodes): the bench with n ranks on this host over
    loopback, then with one rank on each of n fake nodes whose links are shaped to `link`. Both
    runs give each rank `args.batch_size` rows and total_threads / n threads, unbound (the fake
    nodes share this machine's cores, and so do the loopback ranks): the efficiency is what the
    link costs. Returns (one row per node count, the raw bench results)."""
    from cpudist.bench.scaling_model import predict as model_predict
    from cpudist.bench.scaling_model import profile_from_bench
    from cpudist.launch import netns

    netns.check_can_run()
    mpi = detect_mpi()
    if mpi.flavour != "openmpi":
        raise UserError(f"--fake-nodes starts ranks through Open MPI's launch agent; found "
                        f"{mpi.flavour} ({mpi.mpirun}): pip install 'cpudist[mpi]'")
    rows, raw = [], []
    for n in node_counts(nodes):
        threads = max(1, total_threads // n)
        loopback = run_json(bench_command(mpi, n, config_path, overrides, args, args.batch_size,
                                          threads * n, allocator, bind=False),
                            _env(), f"bench with {n} rank(s) over loopback", on_stdout=True)
        fake = loopback
        if n > 1:
            with netns.fake_cluster(n, prefix=netns.own_prefix("cpds"), link=link) as cluster, \
                    tempfile.TemporaryDirectory(prefix="cpudist-fake-") as workdir:
                hostfile = str(cluster.write_hostfile(Path(workdir) / "hosts", slots=1))
                cmd = bench_command(mpi, n, config_path,
                                    [*overrides, f"dist.interface={cluster.ifname}"], args,
                                    args.batch_size, threads, allocator, hostfile,
                                    hostfiles.parse(hostfile), cluster.mpi_args(), bind=False)
                before = sum(cluster.counter(node) for node in cluster.nodes)
                fake = run_json(cluster.exec_argv(cluster.nodes[0], cmd), _env(),
                                f"bench on {n} fake nodes ({link.describe()})", on_stdout=True)
                fake.link_tx_bytes = sum(cluster.counter(node) for node in cluster.nodes) - before
        row = fake_row(n, link, fake, loopback)
        if predict:
            predicted = model_predict(profile_from_bench(loopback), n, 1, link.rate_bps,
                                      link.delay_s)
            # The loopback run already holds the shared cores' slowdown; the model adds the link.
            row["predicted_tokens_per_s"] = round(predicted.tokens_per_s, 2)
            row["predicted_vs_measured"] = round(predicted.tokens_per_s / fake.tokens_per_s, 3)
        rows.append(row)
        raw.append({"nodes": n, "fake": fake.to_json(), "loopback": loopback.to_json()})
        print(fake_table([row]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows, raw


def fake_row(n: int, link: Link, fake: BenchResult, loopback: BenchResult) -> dict[str, Any]:
    """The row of one node count: throughput against loopback, and where the step went."""
    return {
        "nodes": n, "link": link.describe() if n > 1 else "none (one node)",
        "tokens_per_s": round(fake.tokens_per_s, 2),
        "loopback_tokens_per_s": round(loopback.tokens_per_s, 2),
        "efficiency": round(fake.tokens_per_s / loopback.tokens_per_s, 3),
        "s_per_step": round(fake.s_per_step, 3), "threads_per_rank": fake.threads,
        "batch_per_rank": fake.config["train"]["batch_size"],
        "comm_mb_per_step": round(fake.comm_mb_per_step, 3),
        "comm_exposed_s_per_step": round(fake.comm_exposed_s_per_step, 3),
        "comm_bus_gbps": round(fake.comm_bus_gbps, 4),
        "compute_s_per_rank": [round(c, 3) for c in fake.compute_s_per_rank],
        "compute_spread": round(fake.compute_spread, 3),
        "wait_for_slowest_s": [round(w, 3) for w in fake.wait_for_slowest_s],
        # What each node sent on its interface per step (veth counters; setup included).
        "link_mb_per_node_step": round((fake.link_tx_bytes or 0) / 1e6 / n
                                       / max(1, fake.steps + fake.warmup_steps), 3),
        "grad_compression": fake.config["dist"]["grad_compression"],
        "bucket_cap_mb": fake.config["dist"]["bucket_cap_mb"],
    }


def fake_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per node count."""
    predicted = any("predicted_tokens_per_s" in r for r in rows)
    head = ["nodes", "link", "tokens/s", "loopback tokens/s", "efficiency", "s/step",
            "exposed allreduce s", "allreduce MB/step", "compute s per rank (spread)",
            "wait for slowest s (max)", *(["predicted tokens/s"] if predicted else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        compute = ", ".join(f"{c:.2f}" for c in r["compute_s_per_rank"])
        cells = [str(r["nodes"]), r["link"], f"{r['tokens_per_s']:.1f}",
                 f"{r['loopback_tokens_per_s']:.1f}", f"{r['efficiency']:.0%}",
                 f"{r['s_per_step']:.2f}", f"{r['comm_exposed_s_per_step']:.3f}",
                 f"{r['comm_mb_per_step']:.1f}", f"{compute} ({r['compute_spread']:.0%})",
                 f"{max(r['wait_for_slowest_s'], default=0.0):.3f}"]
        if predicted:
            cells.append(f"{r.get('predicted_tokens_per_s', float('nan')):.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scaling_rows(rows: list[BenchResult]) -> list[dict[str, Any]]:
    """The figures of each rank count that go into the scaling table."""
    base = rows[0]
    return [{"world_size": r.world_size, "tokens_per_s": r.tokens_per_s,
             "threads_per_rank": r.threads,
             "batch_per_rank": r.config["train"]["batch_size"], "s_per_step": round(r.s_per_step, 3),
             "mfu": round(r.mfu, 3), "node_pss_gb": round(r.node_pss_gb, 2),
             "pss_vs_first": round(r.node_pss_gb / base.node_pss_gb, 2),
             "peak_rss_gb_per_rank": round(max(r.peak_rss_gb), 2),
             # Per-rank compute (forward + backward, comm.CommMeter): the slowest and the spread.
             "compute_s_max": round(max(r.compute_s_per_rank or [0.0]), 3),
             "compute_spread": round(r.compute_spread, 3)} for r in rows]


def write_scaling(rows: list[BenchResult], out_dir: Path) -> Path:
    """scaling.json (every figure), scaling.md and scaling.png (cpudist.report.plots); returns the
    .md file."""
    from cpudist.report.plots import write_scaling_report

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scaling.json").write_text(json.dumps([r.to_json() for r in rows], indent=1))
    md_path, _ = write_scaling_report(scaling_rows(rows), out_dir)
    return md_path
