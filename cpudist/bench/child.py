"""Benchmarks run as processes of their own (vs a peer, under mpirun for scaling), and their figures
read back: the --json file they wrote, or the one line rank 0 printed (it may run on another node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cpudist.errors import UserError
from cpudist.records import BenchResult
from cpudist.runtime.allocator import choose_allocator, preload_env, requested
from cpudist.runtime.mkl_shim import library

RESULT_MARK = "CPUDIST_BENCH_RESULT "


def print_result(result: BenchResult) -> None:
    """The figures as one line on stdout, found by run_json(on_stdout=True)."""
    print(RESULT_MARK + json.dumps(result.to_json()), flush=True)


def child_env(allocator: str | None, mkl_shim: bool = True) -> dict[str, str]:
    """This process's environment set up for a benchmark child process to run on `allocator`
    (None: what cpudist.runtime.allocator.requested says) and, with mkl_shim, with MKL's shim
    where this machine wants it (cpudist.runtime.mkl_shim); without, as PyTorch ships."""
    name, lib = choose_allocator(requested(allocator))
    shim = library() if mkl_shim else None
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            **preload_env(name, lib, os.environ.get("LD_PRELOAD"), shim)}


def run_json(cmd: list[str], env: dict[str, str], what: str, on_stdout: bool = False
             ) -> BenchResult:
    """Run a benchmark process with `--json TARGET` appended and return its result: the file it
    wrote, or (on_stdout: `--json -`) the line it printed after RESULT_MARK."""
    with tempfile.TemporaryDirectory(prefix="cpudist-bench-") as tmp:
        out = Path(tmp) / "result.json"
        target = "-" if on_stdout else str(out)
        print(f"$ {' '.join(cmd)} --json {target}", file=sys.stderr, flush=True)
        proc = subprocess.run([*cmd, "--json", target], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        printed = [line[line.index(RESULT_MARK) + len(RESULT_MARK):]
                   for line in proc.stdout.splitlines() if RESULT_MARK in line]
        if proc.returncode == 0 and on_stdout and printed:
            return BenchResult.from_json(json.loads(printed[-1]))
        if proc.returncode == 0 and not on_stdout and out.exists():
            return BenchResult.from_json(json.loads(out.read_text()))
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise UserError(f"{what} failed (exit {proc.returncode}):\n{tail}")
