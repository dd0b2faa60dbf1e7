"""mpirun command lines that place CPU ranks well, for the MPI you have.

The MPI flavour comes from `mpirun --version`: Open MPI gets `--map-by slot:PE=N --bind-to core`
and `-x` exports; MPICH / Intel MPI (hydra) get `-ppn`, `-genv` and `I_MPI_PIN_DOMAIN`. Each rank
gets (cores per node / ranks per node) cores and as many threads. To support another MPI, write
the function that turns a Job into its mpirun arguments and register it in FLAVOURS.

`build_command` is a pure function (no environment, no subprocess) so tests can check the exact
command line without MPI installed. This module never reads launcher variables (OMPI_*, PMI_*,
SLURM_*): cpudist.runtime.cluster alone does, inside the ranks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpudist.errors import UserError
from cpudist.launch import hostfile as hostfiles
from cpudist.runtime.allocator import preload_env

# Only used when the ranks are bound to their own cores: Intel OpenMP pins threads "compact"
# from core 0 of the rank's mask; unbound ranks would all pin onto the same first cores.
KMP_AFFINITY = "granularity=fine,compact,1,0"
# Variables forwarded to remote ranks when they are set here (Open MPI warns about unset ones).
FORWARD_ENV = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "HF_HOME", "HF_HUB_OFFLINE",
               "TRANSFORMERS_OFFLINE", "CPUDIST_DEBUG", "OMP_WAIT_POLICY")


@dataclass(frozen=True)
class Layout:
    """How ranks sit on nodes, and how many cores/threads each gets."""

    ranks_per_node: int  # on the busiest node
    threads: int  # per rank (OMP_NUM_THREADS)
    bind: bool  # each rank gets its own `threads` cores
    oversubscribe: bool  # more ranks than slots


def plan_layout(np: int, cores_per_node: int, hosts: hostfiles.Hostfile | None,
                threads_per_rank: int | None, bind: bool | None = None) -> Layout:
    """Ranks per node from the hostfile (all on this node without one); cores assumed the same on
    every node as here (cpudist supports homogeneous clusters). bind=False: never bind (the
    "nodes" of a fake cluster share this machine's cores, and each would bind from core 0)."""
    if np < 1:
        raise UserError(f"-np {np}: need at least one rank")
    if hosts is None:
        ranks_per_node, slots = np, cores_per_node
    else:
        ranks_per_node, slots = max(hosts.ranks_per_host(np).values()), hosts.total_slots
    threads = threads_per_rank or max(1, cores_per_node // ranks_per_node)
    bind = threads * ranks_per_node <= cores_per_node and bind is not False
    return Layout(ranks_per_node, threads, bind, oversubscribe=np > slots or not bind)


def rank_env(layout: Layout, allocator: str | None, preload: str | None,
             ld_preload: str | None, forward: Sequence[str] = ()) -> dict[str, str]:
    """The variables every rank of a job gets: threads, OpenMP behaviour, allocator preload."""
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


@dataclass(frozen=True)
class Job:
    """What a flavour's arguments are made of (everything but the program)."""

    np: int
    layout: Layout
    env: dict[str, str]  # variables to set in every rank
    hostfile: str | None  # already in the flavour's syntax
    forward: Sequence[str]  # variables set here, passed on as they are
    as_root: bool


def _openmpi(job: Job) -> list[str]:
    args = ["-np", str(job.np)]
    if job.as_root:
        args.append("--allow-run-as-root")
    if job.hostfile:
        args += ["--hostfile", job.hostfile]
    if job.layout.bind:
        args += ["--map-by", f"slot:PE={job.layout.threads}", "--bind-to", "core"]
    else:
        # Fewer cores than ranks x threads: binding would fail to map, so let the OS place.
        args += ["--bind-to", "none"]
    if job.layout.oversubscribe:
        args.append("--oversubscribe")
    for name, value in job.env.items():
        args += ["-x", f"{name}={value}"]
    for name in job.forward:
        if name not in job.env:
            args += ["-x", name]
    return args


def _hydra(job: Job, bind: list[str]) -> list[str]:
    """MPICH and Intel MPI: hydra's options; `bind` is the flavour's own binding option."""
    env = dict(job.env)
    args = ["-n", str(job.np), "-ppn", str(job.layout.ranks_per_node)]
    if job.hostfile:
        args += ["-f", job.hostfile]
    if job.layout.bind:
        # Intel MPI: a pin domain of `threads` cores per rank. MPICH ignores I_MPI_* and binds
        # with -bind-to core:N. Hydra oversubscribes without asking.
        env["I_MPI_PIN_DOMAIN"] = str(job.layout.threads)
        args += bind
    else:
        env["I_MPI_PIN"] = "0"
    # -genvlist forwards variables as they are here (one comma list); -genv sets values.
    passthrough = [n for n in job.forward if n not in env]
    if passthrough:
        args += ["-genvlist", ",".join(passthrough)]
    for name, value in env.items():
        args += ["-genv", name, value]
    return args


def _mpich(job: Job) -> list[str]:
    return _hydra(job, ["-bind-to", f"core:{job.layout.threads}"])


def _intel(job: Job) -> list[str]:
    return _hydra(job, [])


@dataclass(frozen=True)
class Flavour:
    markers: tuple[str, ...]  # any of these in `mpirun --version` output (lower case)
    hostfile_syntax: hostfiles.Syntax
    arguments: Callable[[Job], list[str]]


# Checked in this order: MPICH's hydra also prints "hydra" inside Intel MPI's version text.
FLAVOURS: dict[str, Flavour] = {
    "openmpi": Flavour(("open mpi", "openrte", "open-mpi"), "openmpi", _openmpi),
    "intel": Flavour(("intel(r) mpi", "intel mpi"), "hydra", _intel),
    "mpich": Flavour(("hydra", "mpich"), "hydra", _mpich),
}


@dataclass(frozen=True)
class MpiInfo:
    flavour: str  # a key of FLAVOURS
    mpirun: str
    version_line: str

    @property
    def hydra(self) -> bool:
        return FLAVOURS[self.flavour].hostfile_syntax == "hydra"


def parse_version(text: str) -> str | None:
    """MPI flavour (a key of FLAVOURS) from `mpirun --version` output."""
    lowered = text.lower()
    for name, flavour in FLAVOURS.items():
        if any(marker in lowered for marker in flavour.markers):
            return name
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
    bind: bool | None = None,
) -> list[str]:
    """The full mpirun command line. Pure: everything it depends on is an argument.

    hostfile: path already in `mpi`'s syntax; hosts: its parsed content (for ranks per node).
    forward: names of variables set in the caller's environment to pass on to remote ranks.
    bind: None to bind ranks to cores when they fit, False never (see plan_layout).
    ld_preload: the caller's current LD_PRELOAD, kept after the allocator.
    """
    if not program:
        raise UserError("nothing to run: put the cpudist command after '--', e.g. "
                        "cpudist launch -np 2 -- train configs/quickstart.yaml")
    layout = plan_layout(np, cores_per_node, hosts, threads_per_rank, bind)
    env = rank_env(layout, allocator, preload, ld_preload, forward)
    job = Job(np, layout, env, hostfile, forward, as_root)
    return [mpi.mpirun, *FLAVOURS[mpi.flavour].arguments(job), *mpi_args,
            *rank_program(python, program, threads_per_rank)]


def caller_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """What build_command takes from the caller's process: its LD_PRELOAD (kept after the
    allocator), the variables to forward to remote ranks, and whether it runs as root."""
    return {"ld_preload": environ.get("LD_PRELOAD"),
            "forward": [n for n in FORWARD_ENV if environ.get(n)],
            "as_root": hasattr(os, "geteuid") and os.geteuid() == 0}


def prepare_hostfile(path: str, mpi: MpiInfo, workdir: str) -> tuple[str, hostfiles.Hostfile]:
    """Parse `path`; when it is in the other MPI's syntax, write a converted copy into workdir."""
    hosts = hostfiles.parse(path)
    want = FLAVOURS[mpi.flavour].hostfile_syntax
    if hosts.syntax in (None, want):
        return path, hosts
    converted = Path(workdir) / f"hostfile.{want}"
    converted.write_text(hostfiles.render(hosts, want))
    return str(converted), hosts
