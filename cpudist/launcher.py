"""`cpudist launch`: one mpirun command line that places CPU ranks well, for the MPI you have.

    cpudist launch -np 4 [--hostfile FILE] [--threads-per-rank N] [--allocator auto] \\
        [--dry-run] -- train CONFIG key=value ...

Everything after ``--`` is the cpudist sub-command each rank runs (as ``python -m cpudist.cli``).
The MPI flavour comes from ``mpirun --version``: Open MPI gets ``--map-by slot:PE=N --bind-to
core`` and ``-x`` exports; MPICH / Intel MPI (hydra) get ``-ppn``, ``-genv`` and
``I_MPI_PIN_DOMAIN``. Each rank gets (cores per node / ranks per node) cores and as many threads.

`build_command` is a pure function (no environment, no subprocess) so tests can check the exact
command line without MPI installed. This module never reads launcher variables (OMPI_*, PMI_*,
SLURM_*): cluster.py alone does, inside the ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cpudist import hostfile as hostfiles
from cpudist.allocator import CHOICES as ALLOCATORS
from cpudist.allocator import choose_allocator, preload_env
from cpudist.errors import UserError

Flavour = Literal["openmpi", "mpich", "intel"]

# Only used when the ranks are bound to their own cores: Intel OpenMP pins threads "compact"
# from core 0 of the rank's mask; unbound ranks would all pin onto the same first cores.
KMP_AFFINITY = "granularity=fine,compact,1,0"
# Variables forwarded to remote ranks when they are set here (Open MPI warns about unset ones).
FORWARD_ENV = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "HF_HOME", "HF_HUB_OFFLINE",
               "TRANSFORMERS_OFFLINE", "CPUDIST_DEBUG", "OMP_WAIT_POLICY")


@dataclass(frozen=True)
class MpiInfo:
    flavour: Flavour
    mpirun: str
    version_line: str

    @property
    def hydra(self) -> bool:
        return self.flavour in ("mpich", "intel")


def parse_version(text: str) -> Flavour | None:
    """MPI flavour from `mpirun --version` output."""
    lowered = text.lower()
    if "open mpi" in lowered or "openrte" in lowered or "open-mpi" in lowered:
        return "openmpi"
    if "intel(r) mpi" in lowered or "intel mpi" in lowered:
        return "intel"
    if "hydra" in lowered or "mpich" in lowered:
        return "mpich"
    return None


def find_mpirun(explicit: str | None = None, path: str | None = None) -> str:
    """The mpirun to use: --mpirun, else the one next to this Python, else PATH.

    The venv's own mpirun comes first: it belongs to the MPI wheel mpi4py was installed with, and
    a mismatched mpirun starts N singletons that each believe they are rank 0.
    """
    if explicit:
        found = shutil.which(explicit)
        if not found:
            raise UserError(f"--mpirun {explicit}: not found or not executable")
        return found
    for name in ("mpirun", "mpiexec"):
        beside = Path(sys.executable).parent / name
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
    for name in ("mpirun", "mpiexec"):
        found = shutil.which(name, path=path)
        if found:
            return found
    raise UserError(
        "no mpirun found (looked next to this Python and on PATH): pip install 'cpudist[mpi]' "
        "(Open MPI) or 'cpudist[mpich]', or load your site's MPI module, or pass --mpirun PATH")


def detect_mpi(explicit: str | None = None) -> MpiInfo:
    mpirun = find_mpirun(explicit)
    try:
        done = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"{mpirun} --version failed ({exc}); pass --mpirun PATH") from None
    text = done.stdout + done.stderr
    flavour = parse_version(text)
    if flavour is None:
        raise UserError(
            f"{mpirun} --version does not look like Open MPI, MPICH or Intel MPI "
            f"({text.strip().splitlines()[:1]}); pass --mpirun PATH to the one you want")
    first = next((line for line in text.splitlines() if line.strip()), "")
    return MpiInfo(flavour, mpirun, first.strip())


# --------------------------------------------------------------------------- command


@dataclass(frozen=True)
class Layout:
    """How ranks sit on nodes, and how many cores/threads each gets."""

    ranks_per_node: int  # on the busiest node
    threads: int  # per rank (OMP_NUM_THREADS)
    bind: bool  # each rank gets its own `threads` cores
    oversubscribe: bool  # more ranks than slots


def plan_layout(np: int, cores_per_node: int, hosts: hostfiles.Hostfile | None,
                threads_per_rank: int | None) -> Layout:
    """Ranks per node from the hostfile (all on this node without one); cores assumed the same on
    every node as here (cpudist supports homogeneous clusters)."""
    if np < 1:
        raise UserError(f"-np {np}: need at least one rank")
    if hosts is None:
        ranks_per_node, slots = np, cores_per_node
    else:
        ranks_per_node, slots = max(hosts.ranks_per_host(np).values()), hosts.total_slots
    threads = threads_per_rank or max(1, cores_per_node // ranks_per_node)
    bind = threads * ranks_per_node <= cores_per_node
    return Layout(ranks_per_node, threads, bind, oversubscribe=np > slots or not bind)


def _rank_env(layout: Layout, allocator: str | None, preload: str | None,
              ld_preload: str | None, forward: Sequence[str] = ()) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": str(layout.threads), "MKL_NUM_THREADS": str(layout.threads),
           "KMP_BLOCKTIME": "1"}  # idle Intel OpenMP threads sleep at once: ranks share nodes with MPI
    if layout.bind:
        env["KMP_AFFINITY"] = KMP_AFFINITY
    elif "OMP_WAIT_POLICY" not in forward:
        # Ranks share cores: OpenMP threads spinning at barriers (the default of libgomp, which
        # PyTorch wheels use; KMP_BLOCKTIME does not reach it) steal them from the other ranks.
        # Measured: 2 ranks x 2 threads on 2 cores, 33 s/step spinning vs 3.3 s/step passive.
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    # The ranks' cpudist commands see ENV and keep this choice (allocator.ensure).
    env.update(preload_env(allocator, preload, ld_preload))
    if not preload:
        del env["LD_PRELOAD"]  # nothing to preload: the ranks keep the environment's own
    return env


def rank_program(python: str, program: Sequence[str], threads_per_rank: int | None) -> list[str]:
    """`python -m cpudist.cli PROGRAM`; an explicit --threads-per-rank also reaches train's config
    (the ranks size their own thread pools from dist.threads_per_rank)."""
    args = list(program)
    if (threads_per_rank and args and args[0] == "train"
            and not any(a.startswith("dist.threads_per_rank=") for a in args)):
        args.append(f"dist.threads_per_rank={threads_per_rank}")
    return [python, "-m", "cpudist.cli", *args]


def build_command(
    mpi: MpiInfo,
    np: int,
    program: Sequence[str],
    *,
    python: str,
    cores_per_node: int,
    hostfile: str | None = None,
    hosts: hostfiles.Hostfile | None = None,
    threads_per_rank: int | None = None,
    allocator: str | None = None,
    preload: str | None = None,
    ld_preload: str | None = None,
    forward: Sequence[str] = (),
    as_root: bool = False,
    mpi_args: Sequence[str] = (),
) -> list[str]:
    """The full mpirun command line. Pure: everything it depends on is an argument.

    hostfile: path already in `mpi`'s syntax; hosts: its parsed content (for ranks per node).
    forward: names of variables set in the caller's environment to pass on to remote ranks.
    ld_preload: the caller's current LD_PRELOAD, kept after the allocator.
    """
    if not program:
        raise UserError("nothing to run: put the cpudist command after '--', e.g. "
                        "cpudist launch -np 2 -- train configs/quickstart.yaml")
    layout = plan_layout(np, cores_per_node, hosts, threads_per_rank)
    env = _rank_env(layout, allocator, preload, ld_preload, forward)
    cmd = [mpi.mpirun]
    if mpi.hydra:
        cmd += ["-n", str(np), "-ppn", str(layout.ranks_per_node)]
        if hostfile:
            cmd += ["-f", hostfile]
        if layout.bind:
            # Intel MPI: a pin domain of `threads` cores per rank. MPICH ignores I_MPI_* and binds
            # with -bind-to core:N. Hydra oversubscribes without asking.
            env["I_MPI_PIN_DOMAIN"] = str(layout.threads)
            if mpi.flavour == "mpich":
                cmd += ["-bind-to", f"core:{layout.threads}"]
        else:
            env["I_MPI_PIN"] = "0"
        # -genvlist forwards variables as they are here (one comma list); -genv sets values.
        passthrough = [n for n in forward if n not in env]
        if passthrough:
            cmd += ["-genvlist", ",".join(passthrough)]
        for name, value in env.items():
            cmd += ["-genv", name, value]
    else:
        cmd += ["-np", str(np)]
        if as_root:
            cmd.append("--allow-run-as-root")
        if hostfile:
            cmd += ["--hostfile", hostfile]
        if layout.bind:
            cmd += ["--map-by", f"slot:PE={layout.threads}", "--bind-to", "core"]
        else:
            # Fewer cores than ranks x threads: binding would fail to map, so let the OS place.
            cmd += ["--bind-to", "none"]
        if layout.oversubscribe:
            cmd.append("--oversubscribe")
        for name, value in env.items():
            cmd += ["-x", f"{name}={value}"]
        for name in forward:
            if name not in env:
                cmd += ["-x", name]
    cmd += list(mpi_args)
    cmd += rank_program(python, program, threads_per_rank)
    return cmd


def caller_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """What build_command takes from the caller's process: its LD_PRELOAD (kept after the
    allocator), the variables to forward to remote ranks, and whether it runs as root."""
    return {"ld_preload": environ.get("LD_PRELOAD"),
            "forward": [n for n in FORWARD_ENV if environ.get(n)],
            "as_root": hasattr(os, "geteuid") and os.geteuid() == 0}


def prepare_hostfile(path: str, mpi: MpiInfo, workdir: str) -> tuple[str, hostfiles.Hostfile]:
    """Parse `path`; when it is in the other MPI's syntax, write a converted copy into workdir."""
    hosts = hostfiles.parse(path)
    want: hostfiles.Syntax = "hydra" if mpi.hydra else "openmpi"
    if hosts.syntax in (None, want):
        return path, hosts
    converted = Path(workdir) / f"hostfile.{want}"
    converted.write_text(hostfiles.render(hosts, want))
    return str(converted), hosts


def _physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:  # pragma: no cover - psutil is a dependency
        return os.cpu_count() or 1


def _exit_code(returncode: int) -> int:
    # A signal-killed mpirun shows as -SIG; shells report 128+SIG.
    return 128 - returncode if returncode < 0 else returncode


def launch(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    program = list(args.program)
    if program and program[0] == "--":
        program = program[1:]
    mpi = detect_mpi(args.mpirun)
    allocator, preload = choose_allocator(args.allocator)
    cores = args.cores_per_node or _physical_cores()
    with tempfile.TemporaryDirectory(prefix="cpudist-launch-") as workdir:
        hostfile, hosts = (prepare_hostfile(args.hostfile, mpi, workdir) if args.hostfile
                           else (None, None))
        cmd = build_command(
            mpi, args.np, program, python=sys.executable, cores_per_node=cores,
            hostfile=hostfile, hosts=hosts, threads_per_rank=args.threads_per_rank,
            allocator=allocator, preload=preload, mpi_args=args.mpi_arg,
            **caller_settings(environ))
        if args.dry_run:
            if hostfile and hostfile != args.hostfile:
                # The converted copy vanishes with workdir: show what it held.
                print(f"# {hostfile} (converted from {args.hostfile}):", file=sys.stderr)
                print(Path(hostfile).read_text(), end="", file=sys.stderr)
            print(shlex.join(cmd))
            return 0
        print(f"cpudist launch: {mpi.version_line}; allocator {allocator or 'glibc malloc'}",
              file=sys.stderr)
        print(f"cpudist launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        return _exit_code(run_forwarding_stop(cmd))


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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "launch", help="start a cpudist command on N ranks with mpirun",
        description="Build and run the mpirun command for the MPI found (Open MPI, MPICH or Intel "
                    "MPI). Everything after '--' is the cpudist command each rank runs.",
        epilog="example: cpudist launch -np 2 -- train configs/quickstart.yaml train.max_steps=5")
    parser.add_argument("-np", "-n", "--np", dest="np", type=_positive_int, required=True,
                        help="number of ranks")
    parser.add_argument("--hostfile", "-f", default=None,
                        help="hosts and slots, either MPI's syntax (converted as needed)")
    parser.add_argument("--threads-per-rank", type=_positive_int, default=None,
                        help="default: physical cores per node / ranks per node")
    parser.add_argument("--cores-per-node", type=_positive_int, default=None,
                        help="physical cores on each node (default: this machine's)")
    parser.add_argument("--allocator", choices=ALLOCATORS,
                        default="auto", help="LD_PRELOAD a faster malloc when found (auto)")
    parser.add_argument("--mpirun", default=None, help="mpirun/mpiexec to use")
    parser.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for mpirun, repeatable (--mpi-arg=--mca ...)")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    parser.add_argument("program", nargs=argparse.REMAINDER,
                        help="-- then the cpudist command, e.g. -- train CONFIG key=value")
    parser.set_defaults(func=launch)
