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
from cpudist.launch.mpi import build_command, caller_settings, detect_mpi, plan_layout, prepare_hostfile
from cpudist.runtime.allocator import choose_allocator, requested


def run_scaling(config_path: str | None, overrides: list[str], args: BenchArgs,
                counts: list[int], total_threads: int, allocator: str | None,
                per_rank_batch: bool = False, hostfile: str | None = None,
                mpi_args: list[str] | None = None) -> list[dict[str, Any]]:
    """The bench under mpirun at each rank count, threads split between the ranks of a node; the
    mpirun command (hostfile, binding, thread variables, allocator preload) is the one `cpudist
    launch` builds. Rank 0 prints its figures on stdout, so it may run on another node."""
    mpi = detect_mpi()
    name, lib = choose_allocator(requested(allocator))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpudist-scaling-") as workdir:
        path, hosts = prepare_hostfile(hostfile, mpi, workdir) if hostfile else (None, None)
        for np in counts:
            # total_threads are one node's: the busiest node's ranks share them.
            threads = plan_layout(np, total_threads, hosts, None).threads
            batch = args.batch_size
            if batch and not per_rank_batch:
                # Same global batch at every rank count: each rank gets its share.
                if batch % np:
                    raise UserError(f"--batch-size {batch} does not split over {np} ranks; choose "
                                    "a multiple of every rank count, or pass --per-rank-batch")
                batch //= np
            flags = BenchArgs(**{**args.__dict__, "threads": threads, "batch_size": batch}).flags()
            program = ["bench"] + ([config_path] if config_path else []) + [*overrides, *flags]
            cmd = build_command(mpi, np, program, python=sys.executable,
                                cores_per_node=total_threads, hostfile=path, hosts=hosts,
                                threads_per_rank=threads, allocator=name, preload=lib,
                                mpi_args=mpi_args or [], **caller_settings(os.environ))
            rows.append(run_json(cmd, env, f"bench with {np} rank(s)", on_stdout=True))
    return rows


def scaling_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The figures of each rank count that go into the scaling table."""
    base = rows[0]
    return [{"world_size": r["world_size"], "tokens_per_s": r["tokens_per_s"],
             "threads_per_rank": r["threads"],
             "batch_per_rank": r["config"]["train"]["batch_size"], "s_per_step": round(r["s_per_step"], 3),
             "mfu": round(r["mfu"], 3), "node_pss_gb": round(r["node_pss_gb"], 2),
             "pss_vs_first": round(r["node_pss_gb"] / base["node_pss_gb"], 2),
             "peak_rss_gb_per_rank": round(max(r["peak_rss_gb"]), 2)} for r in rows]


def write_scaling(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    """scaling.json (every figure), scaling.md and scaling.png (cpudist.report.plots); returns the
    .md file."""
    from cpudist.report.plots import write_scaling_report

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scaling.json").write_text(json.dumps(rows, indent=1))
    md_path, _ = write_scaling_report(scaling_rows(rows), out_dir)
    return md_path
