"""Running a job under mpirun from this terminal: the command `cpudist launch` builds, started
so that Ctrl-C or a scheduler's SIGTERM lets the ranks checkpoint before they stop."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from cpudist.launch.mpi import build_command, caller_settings, detect_mpi, prepare_hostfile
from cpudist.runtime.allocator import choose_allocator
from cpudist.runtime.hardware import physical_cores


def exit_code(returncode: int) -> int:
    # A signal-killed mpirun shows as -SIG; shells report 128+SIG.
    return 128 - returncode if returncode < 0 else returncode


def launch(np: int, program: Sequence[str], *, hostfile: str | None = None,
           threads_per_rank: int | None = None, cores_per_node: int | None = None,
           allocator: str = "auto", mpirun: str | None = None, mpi_args: Sequence[str] = (),
           dry_run: bool = False, environ: Mapping[str, str] | None = None) -> int:
    """Build the mpirun command for `program` on np ranks and run it (or print it: dry_run)."""
    environ = os.environ if environ is None else environ
    mpi = detect_mpi(mpirun)
    name, preload = choose_allocator(allocator)
    cores = cores_per_node or physical_cores()
    with tempfile.TemporaryDirectory(prefix="cpudist-launch-") as workdir:
        path, hosts = (prepare_hostfile(hostfile, mpi, workdir) if hostfile else (None, None))
        cmd = build_command(
            mpi, np, program, python=sys.executable, cores_per_node=cores, hostfile=path,
            hosts=hosts, threads_per_rank=threads_per_rank, allocator=name, preload=preload,
            mpi_args=mpi_args, **caller_settings(environ))
        if dry_run:
            if path and path != hostfile:
                # The converted copy vanishes with workdir: show what it held.
                print(f"# {path} (converted from {hostfile}):", file=sys.stderr)
                print(Path(path).read_text(), end="", file=sys.stderr)
            print(shlex.join(cmd))
            return 0
        print(f"cpudist launch: {mpi.version_line}; allocator {name or 'glibc malloc'}",
              file=sys.stderr)
        print(f"cpudist launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        return exit_code(run_forwarding_stop(cmd))


def run_forwarding_stop(cmd: list[str]) -> int:
    """Run mpirun; turn the first Ctrl-C/SIGTERM into SIGUSR1 (checkpoint and stop), a second into
    SIGTERM (stop now).

    Open MPI's mpirun answers SIGTERM/SIGINT by killing the ranks 0.25 s later, too soon for a
    checkpoint, but forwards SIGUSR1 to every rank untouched; the trainer stops cleanly on it.
    mpirun runs in its own session so a terminal's Ctrl-C reaches only this process.
    """
    proc = subprocess.Popen(cmd, start_new_session=True)
    asked: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stop = signal.SIGUSR1 if not asked else signal.SIGTERM
        asked.append(signum)
        if stop == signal.SIGUSR1:
            print("cpudist launch: stopping at the next step boundary after a checkpoint "
                  "(again to stop at once)", file=sys.stderr, flush=True)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(stop)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
