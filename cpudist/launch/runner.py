"""Running a job under mpirun from this terminal: the command `cpudist launch` builds, started
so that Ctrl-C or a scheduler's SIGTERM lets the ranks checkpoint before they stop, and (with
--restarts) started again when a rank dies, to continue from the newest complete checkpoint."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cpudist.errors import ExitCode, UserError
from cpudist.launch import hostfile as hostfiles
from cpudist.launch.mpi import build_command, caller_settings, detect_mpi, prepare_hostfile
from cpudist.runtime.allocator import choose_allocator
from cpudist.runtime.hardware import physical_cores


def exit_code(returncode: int) -> int:
    # A signal-killed mpirun shows as -SIG; shells report 128+SIG.
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Restarts:
    """`cpudist launch --restarts`: how a job that failed is started again."""

    limit: int  # restarts at most
    min_np: int  # fewest ranks a restart may run on
    delay_s: float  # back-off before each restart
    program: Sequence[str]  # what the ranks run on a restart (the job, resuming)
    record: Callable[[int, str], None]  # (attempt, reason) -> the restart record is written


def restart_reason(code: int, stopped: bool) -> str | None:
    """Why a finished job is worth starting again; None when it is not: it finished, the user
    stopped it (Ctrl-C, SIGTERM), or it ended in a class a restart would repeat (bad input, the
    memory plan, an internal error: cpudist.errors.ExitCode)."""
    if stopped:
        return None
    try:
        known = ExitCode(code)
    except ValueError:
        known = None
    if known is not None:
        return f"exit status {code}: {known.describe()}" if known.retry else None
    if code > 128:
        try:
            return f"exit status {code}: a rank was killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exit status {code}: a rank or mpirun failed"


def launch(np: int, program: Sequence[str], *, hostfile: str | None = None,
           threads_per_rank: int | None = None, cores_per_node: int | None = None,
           allocator: str = "auto", mpirun: str | None = None, mpi_args: Sequence[str] = (),
           dry_run: bool = False, environ: Mapping[str, str] | None = None,
           restarts: Restarts | None = None) -> int:
    """Build the mpirun command for `program` on np ranks and run it (or print it: dry_run);
    with `restarts`, start it again after a failure that is not the user's."""
    environ = os.environ if environ is None else environ
    mpi = detect_mpi(mpirun)
    name, preload = choose_allocator(allocator)
    cores = cores_per_node or physical_cores()
    attempt = 0
    first_slots = hostfile_slots(hostfile) if hostfile else 0
    while True:
        with tempfile.TemporaryDirectory(prefix="cpudist-launch-") as workdir:
            # Read again at each start: hosts taken out of the file meanwhile are not used.
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
            if attempt == 0:
                print(f"cpudist launch: {mpi.version_line}; allocator {name or 'glibc malloc'}",
                      file=sys.stderr)
            print(f"cpudist launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
            returncode, stopped = run_forwarding_stop(cmd)
        code = exit_code(returncode)
        reason = restart_reason(code, stopped) if restarts else None
        if reason is None or restarts is None:
            return code
        if attempt >= restarts.limit:
            _say(f"the job failed ({reason}); no restart left of --restarts {restarts.limit}")
            return code
        if hostfile:
            ranks = _ranks_left(hostfile, np, first_slots, restarts.min_np, reason)
            if ranks is None:
                return code
            np = ranks
        attempt += 1
        _say(f"the job failed ({reason}); restart {attempt} of {restarts.limit} in "
             f"{restarts.delay_s:g} s, from the newest complete checkpoint")
        if _wait_unless_stopped(restarts.delay_s):
            _say("stopped while waiting to restart")
            return code
        restarts.record(attempt, reason)
        program = restarts.program


def _ranks_left(hostfile: str, np: int, first_slots: int, min_np: int, reason: str) -> int | None:
    """The ranks a restart runs on, from the hostfile read again (hosts taken out meanwhile
    shrink the job); None, said why, when it cannot restart."""
    try:
        slots = hostfile_slots(hostfile)
    except UserError as exc:
        _say(f"the job failed ({reason}); not restarted: {exc}")
        return None
    fewer = shrunk_np(np, first_slots, slots)
    if fewer < np:
        if fewer < min_np:
            _say(f"the job failed ({reason}); not restarted: {hostfile} now has {slots} slot(s) "
                 f"of {first_slots}, room for {fewer} rank(s), fewer than --min-np {min_np}")
            return None
        _say(f"{hostfile} now has {slots} slot(s) of {first_slots}: restarting on {fewer} rank(s)")
    return fewer


def _say(line: str) -> None:
    print(f"cpudist launch: {line}", file=sys.stderr, flush=True)


def hostfile_slots(path: str) -> int:
    return hostfiles.parse(path).total_slots


def shrunk_np(np: int, first_slots: int, slots: int) -> int:
    """Ranks for a restart when the hostfile offers `slots` where it offered `first_slots` at
    the first start: only hosts taken out shrink the job, and a job that oversubscribed its
    slots from the start keeps its ranks per slot."""
    if slots >= first_slots or np <= slots:
        return np
    return slots if np <= first_slots else max(1, np * slots // first_slots)


def _wait_unless_stopped(seconds: float) -> bool:
    """Sleep; True when Ctrl-C or SIGTERM came meanwhile (the user wants no restart)."""
    asked: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: asked.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deadline = time.monotonic() + seconds
        while not asked and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return bool(asked)


def run_forwarding_stop(cmd: list[str]) -> tuple[int, bool]:
    """Run mpirun; turn the first Ctrl-C/SIGTERM into SIGUSR1 (checkpoint and stop), a second into
    SIGTERM (stop now). Returns mpirun's return code and whether the user asked it to stop.

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
        returncode = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    left = kill_session(proc.pid)
    if left:
        _say(f"killed {left} process(es) of the job still running after mpirun exited")
    return returncode, bool(asked)


def session_members(session: int) -> list[int]:
    """Processes of this machine in `session` other than its leader (Linux /proc; elsewhere
    none are found). mpirun leads the session it was started in, and its local ranks stay in it."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        # After the command name: state, parent, process group, session. A zombie is dead
        # already (its new parent reaps it).
        if int(fields[3]) == session and int(entry.name) != session and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def kill_session(session: int) -> int:
    """SIGKILL what is left of the job mpirun led (a rank it failed to reap); how many."""
    killed: set[int] = set()
    for _ in range(50):
        members = session_members(session)
        if not members:
            break
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.1)
    return len(killed)
