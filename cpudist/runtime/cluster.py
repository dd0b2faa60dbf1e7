"""Who am I, and who are my peers: the one place that reads launcher environments.

Supports Open MPI, MPICH/Intel MPI (hydra), Slurm, torchrun, or a plain single process. Under MPI no
hand-set MASTER_ADDR is needed: rank 0 picks an address and a free port and broadcasts them with
mpi4py. Also sets each rank's threads and core affinity so N ranks never oversubscribe a node.
Joining the process group and talking to the peers is cpudist.runtime.comm's job.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpudist.errors import UserError
from cpudist.runtime.hardware import physical_cores

log = logging.getLogger("cpudist")


@dataclass(frozen=True)
class Placement:
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    launcher: str  # openmpi | hydra | slurm | torchrun | single
    # How often the launcher has started this job's workers again (torchrun --max-restarts:
    # TORCHELASTIC_RESTART_COUNT); a restarted rank resumes from the newest checkpoint.
    restarts: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def uses_mpi(self) -> bool:
        return self.launcher in ("openmpi", "hydra") or (
            self.launcher == "slurm" and mpi_available()
        )


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise UserError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": 4 tasks on each of the first two nodes, 3 on the
    # third; this node's entry is picked by SLURM_NODEID.
    direct = _int(env, "SLURM_NTASKS_PER_NODE")
    if direct is not None:
        return direct
    spec = env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    per_node: list[int] = []
    try:
        for group in spec.split(","):
            count, _, repeat = group.partition("(x")
            per_node += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    except ValueError:
        raise UserError(f"environment variable SLURM_TASKS_PER_NODE={spec!r} is not in Slurm's "
                        "'N(xM),K' form") from None
    node = _int(env, "SLURM_NODEID") or 0
    return per_node[node] if node < len(per_node) else per_node[-1]


def detect_placement(env: Mapping[str, str] | None = None) -> Placement:
    """Rank, world size and node-local rank from whichever launcher started this process."""
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        launcher = "openmpi"
    elif "PMI_RANK" in env:
        # PMI is authoritative even inside a Slurm allocation: hydra's proxies are started by srun
        # and leak SLURM_PROCID (the node index) into the ranks.
        rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_rank = _int(env, "MPI_LOCALRANKID")
        local_size = _int(env, "MPI_LOCALNRANKS")
        launcher = "hydra"
        if local_rank is None and "SLURM_STEP_ID" in env:  # srun --mpi=pmi2 started the ranks
            local_rank, local_size = _int(env, "SLURM_LOCALID"), _slurm_local_size(env)
            launcher = "slurm"
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        # Only inside an srun step: a batch script alone also has SLURM_PROCID=0.
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID")
        local_size = _slurm_local_size(env)
        launcher = "slurm"
    elif "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK")
        local_size = _int(env, "LOCAL_WORLD_SIZE")
        launcher = "torchrun"
    else:
        _check_kubeflow(env)
        return Placement(0, 1, 0, 1, "single")
    if rank is None or world is None:
        raise UserError(f"launched by {launcher} but its rank or world size variable is empty; "
                        "start cpudist through mpirun, srun or torchrun unchanged")
    if local_rank is None or local_size is None:
        # Launcher did not say how many ranks share this node: assume one per node.
        _check_kubeflow(env)
        local_rank, local_size = 0, 1
    restarts = (_int(env, "TORCHELASTIC_RESTART_COUNT") or 0) if launcher == "torchrun" else 0
    return Placement(rank, world, local_rank, local_size, launcher, restarts)


def _check_kubeflow(env: Mapping[str, str]) -> None:
    """Kubeflow's PyTorchJob and TrainJob pass torchrun's settings as PET_* variables (torchrun
    reads PET_NPROC_PER_NODE as --nproc-per-node, ...): asked for several processes per pod but
    started without torchrun, this process would be the only one."""
    nproc = env.get("PET_NPROC_PER_NODE", "")
    if nproc.isdigit() and int(nproc) > 1:
        raise UserError(f"PET_NPROC_PER_NODE={nproc} asks for {nproc} processes per node, but "
                        "cpudist was not started by torchrun: make the container's command "
                        "`torchrun --no-python cpudist train ...` (torchrun reads the PET_* "
                        "variables)")


def thread_override(placement: Placement, threads: int, setting: int | None,
                    env: Mapping[str, str] | None = None) -> str | None:
    """What this rank changes of the thread count its launcher set (torchrun sets
    OMP_NUM_THREADS=1 for every worker), in words for the log; None when nothing."""
    env = os.environ if env is None else env
    given = env.get("OMP_NUM_THREADS", "").strip()
    if not given or given == str(threads):
        return None
    why = (f"dist.threads_per_rank={setting}" if setting is not None else
           f"this rank's share of the node's physical cores ({placement.local_size} rank(s) on "
           "this node; dist.threads_per_rank sets another number)")
    return f"OMP_NUM_THREADS={given} from the environment replaced by {threads}: {why}"


def slurm_node_memory_mb(env: Mapping[str, str] | None = None) -> int | None:
    """The memory Slurm gives this job on a node (SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU x the
    node's CPUs), in MB; None outside Slurm or without a memory request."""
    env = os.environ if env is None else env
    per_node = _int(env, "SLURM_MEM_PER_NODE")
    if per_node:
        return per_node
    per_cpu, cpus = _int(env, "SLURM_MEM_PER_CPU"), _int(env, "SLURM_CPUS_ON_NODE")
    return per_cpu * cpus if per_cpu and cpus else None


def mpi_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def mpi_comm() -> Any:
    """COMM_WORLD from mpi4py; imported only under an MPI launcher (import initialises MPI)."""
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise UserError(
            "launched by MPI but mpi4py is not installed: pip install 'cpudist[mpi]', or set "
            "MASTER_ADDR and MASTER_PORT yourself"
        ) from exc
    return MPI.COMM_WORLD


# --------------------------------------------------------------------------- threads and cores


def _core_groups(cpus: list[int]) -> list[list[int]]:
    """Group logical CPUs by physical core (SMT siblings together), ordered by first CPU."""
    groups: dict[str, list[int]] = {}
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        key = siblings.read_text().strip() if siblings.exists() else str(cpu)
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values(), key=lambda g: g[0])


def threads_for_rank(placement: Placement, override: int | None = None) -> int:
    if override is not None:
        return override
    return max(1, physical_cores() // max(1, placement.local_size))


def pin_threads(placement: Placement, threads: int) -> list[int] | None:
    """Give this rank `threads` threads and, when the launcher did not bind it, its own cores.

    Returns the CPUs this rank is bound to (None when affinity is not supported).
    """
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    all_cpus = os.cpu_count() or len(allowed)
    cores = _core_groups(allowed)
    if len(allowed) < all_cpus or placement.local_size == 1:
        # Already bound by mpirun --bind-to/srun --cpu-bind, or alone on the node: keep it.
        return allowed
    per_rank = max(1, len(cores) // placement.local_size)
    start = (placement.local_rank * per_rank) % max(1, len(cores))
    mine = [cpu for group in cores[start : start + per_rank] for cpu in group]
    if mine:
        os.sched_setaffinity(0, mine)
        return mine
    return allowed


# --------------------------------------------------------------------------- rendezvous


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr if addr != "127.0.0.1" else "", 0))
        return int(sock.getsockname()[1])


def interface_address(name: str) -> str:
    import psutil

    addrs = psutil.net_if_addrs().get(name)
    if not addrs:
        raise UserError(
            f"dist.interface={name!r}: no such network interface on {socket.gethostname()}; "
            f"present: {', '.join(sorted(psutil.net_if_addrs()))}"
        )
    for addr in addrs:
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise UserError(f"dist.interface={name!r} has no IPv4 address on {socket.gethostname()}")


def _routable_address() -> str:
    """First non-loopback IPv4 address of this host (the one peers on other nodes can reach)."""
    import psutil

    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if name == "lo":
            continue
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return str(addr.address)
    return "127.0.0.1"


def _env_port() -> int | None:
    """MASTER_PORT from the environment (None when unset or empty)."""
    text = os.environ.get("MASTER_PORT", "").strip()
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise UserError(f"environment variable MASTER_PORT={text!r} is not a TCP port: set it to "
                        "a free port between 1 and 65535, or unset it (MPI launches pick one)")
    return int(text)


def rendezvous(placement: Placement, master_addr: str | None, master_port: int | None,
               interface: str | None) -> tuple[str, int]:
    """Address and port of rank 0's TCP store, agreed by all ranks."""
    addr = master_addr or os.environ.get("MASTER_ADDR")
    port = master_port or _env_port()
    if addr and port:
        return addr, port
    if not placement.uses_mpi:
        raise UserError(
            f"launched by {placement.launcher} without MASTER_ADDR/MASTER_PORT and without mpi4py: "
            "set dist.master_addr and dist.master_port (or the environment variables)"
        )
    comm = mpi_comm()
    chosen: tuple[str, int] | None = None
    if placement.rank == 0:
        if addr is None:
            if interface:
                addr = interface_address(interface)
            elif placement.local_size == placement.world_size:
                addr = "127.0.0.1"
            else:
                addr = _routable_address()
        chosen = (addr, port or _free_port(addr))
    chosen = comm.bcast(chosen, root=0)
    assert chosen is not None
    return chosen



def rank_prefix(placement: Placement) -> str:
    return f"[rank {placement.rank}] " if placement.distributed else ""
