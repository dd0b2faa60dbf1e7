"""Talking to the other ranks: the process group, the gradient allreduce path, small collectives,
and what to say when a peer is lost.

Backends: gloo (stock PyTorch), ccl (when oneccl_bindings_for_pytorch imports) or mpi (a gloo group
for setup plus a DDP communication hook that allreduces gradient buckets over mpi4py). Every helper
here is the identity in a single process, so callers never branch on the world size.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from cpudist.errors import UserError
from cpudist.runtime.cluster import Placement, mpi_available, rendezvous

log = logging.getLogger("cpudist")
T = TypeVar("T")

def ccl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None


def choose_backend(requested: str) -> tuple[str, str]:
    """(process group backend, why) for dist.backend."""
    if requested == "auto":
        if ccl_available():
            return "ccl", "oneccl_bindings_for_pytorch imports"
        return "gloo", "oneccl_bindings_for_pytorch not installed (stock PyTorch path)"
    if requested == "ccl":
        if not ccl_available():
            raise UserError(
                "dist.backend=ccl but oneccl_bindings_for_pytorch is not installed (it is retired "
                "upstream and needs torch 2.8); use dist.backend=gloo or auto"
            )
        return "ccl", "requested"
    if requested == "mpi":
        if not mpi_available():
            raise UserError("dist.backend=mpi needs mpi4py: pip install 'cpudist[mpi]'")
        return "gloo", "requested mpi: gloo for setup, gradient allreduce through mpi4py"
    return "gloo", "requested"


def init_process_group(placement: Placement, backend_request: str, master_addr: str | None,
                       master_port: int | None, interface: str | None, timeout_s: float) -> str:
    """Join the process group; returns a one-line description of the path taken."""
    import torch.distributed as dist

    backend, why = choose_backend(backend_request)
    if backend == "ccl":
        import oneccl_bindings_for_pytorch  # noqa: F401  (registers the ccl backend)
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    addr, port = rendezvous(placement, master_addr, master_port, interface)
    if not interface and addr == "127.0.0.1":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{addr}:{port}",
        rank=placement.rank,
        world_size=placement.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return (f"backend={backend_request}->{backend} ({why}); rendezvous tcp://{addr}:{port} "
            f"via {placement.launcher}")


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- MPI gradient allreduce


def mpi_allreduce_hook(nonblocking: bool = False) -> Any:
    """A DDP communication hook that averages each gradient bucket with MPI in place."""
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    world = comm.Get_size()

    # No annotations on bucket or the result: DDP's register_comm_hook rejects any but the classes
    # themselves, and under `from __future__ import annotations` every annotation is a string.
    def hook(_state: Any, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        array = buffer.numpy()
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if not nonblocking:
            comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
            buffer.div_(world)
            future.set_result(buffer)
            return future
        request = comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM)

        def wait() -> None:
            request.Wait()
            buffer.div_(world)
            future.set_result(buffer)

        threading.Thread(target=wait, daemon=True).start()
        return future

    return hook


# --------------------------------------------------------------------------- measured allreduce


class CommMeter:
    """What the gradient allreduce of each optimizer step cost, measured by wrapping DDP's
    communication hook (one definition, used by the bench's figures and its --profile):

    - bytes: gradient bytes allreduced by this rank;
    - exposed_s: communication not hidden behind backward, from the moment the last bucket was
      handed over (backward's compute is done) to the moment the last allreduce completed;
    - busy_s: from the first bucket's hand-over to the last completion (allreduce in flight).
    `take()` returns the figures gathered since the previous call and starts again."""

    def __init__(self) -> None:
        self.bytes = 0
        self.first_launch: float | None = None
        self.last_launch = 0.0
        self.last_done = 0.0
        self._lock = threading.Lock()

    def wrap(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        import functools
        import time

        @functools.wraps(hook)
        def measured(state: Any, bucket):  # type: ignore[no-untyped-def]  # see mpi_allreduce_hook
            now = time.perf_counter()
            with self._lock:
                self.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
                self.first_launch = now if self.first_launch is None else self.first_launch
                self.last_launch = now
            future = hook(state, bucket)

            def done(result: Any) -> Any:
                with self._lock:
                    self.last_done = max(self.last_done, time.perf_counter())
                return result.value()

            return future.then(done)

        return measured

    def take(self) -> dict[str, float]:
        with self._lock:
            figures = {"bytes": float(self.bytes), "exposed_s": 0.0, "busy_s": 0.0}
            if self.first_launch is not None:
                figures["exposed_s"] = max(0.0, self.last_done - self.last_launch)
                figures["busy_s"] = max(0.0, self.last_done - self.first_launch)
            self.bytes, self.first_launch, self.last_launch, self.last_done = 0, None, 0.0, 0.0
        return figures


def default_allreduce_hook() -> Any:
    """DDP's own gradient averaging, as a hook (so that CommMeter can wrap it)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook


# --------------------------------------------------------------------------- small collectives


def allreduce(values: list[float], placement: Placement, op: str = "sum") -> list[float]:
    """Sum (or max) a few numbers over ranks; identity for a single process."""
    if not placement.distributed:
        return values
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def all_gather(value: T, placement: Placement) -> list[T]:
    """Every rank's value, in rank order (pickled: only between this job's own processes)."""
    if not placement.distributed:
        return [value]
    import torch.distributed as dist

    gathered: list[Any] = [None] * placement.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast(value: T, placement: Placement) -> T:
    """Rank 0's value on every rank."""
    if not placement.distributed:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(placement: Placement) -> None:
    if placement.distributed:
        import torch.distributed as dist

        dist.barrier()


def agree_on_error(placement: Placement, error: str | None) -> None:
    """Raise the same UserError on every rank if any rank hit one (no rank is left waiting)."""
    first = next((e for e in all_gather(error, placement) if e), None)
    if first:
        raise UserError(first)


def agreed(placement: Placement, action: Callable[[], T]) -> T:
    """action() on every rank; a UserError on any rank stops every rank with the same message."""
    error, result = None, None
    try:
        result = action()
    except UserError as exc:
        error = str(exc)
    agree_on_error(placement, error)
    return result  # type: ignore[return-value]


def rank0_only(placement: Placement, action: Callable[[], T]) -> T | None:
    """action() on rank 0 (None elsewhere); a UserError there stops every rank with its message."""
    return agreed(placement, action if placement.is_main else lambda: None)


# --------------------------------------------------------------------------- a lost peer


def lost_peer(exc: BaseException) -> bool:
    """A collective failed because a peer vanished or did not answer within dist.timeout_s."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        marker in text for marker in ("gloo", "Connection reset", "Connection closed", "Timed out"))


def peer_fate(peers: list[tuple[str, int]], rank: int) -> str:
    """What became of the peers this rank can see (those on its own node)."""
    import psutil

    host = socket.gethostname()
    fates = []
    for peer, (peer_host, pid) in enumerate(peers):
        if peer == rank or peer_host != host:
            continue
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            status = psutil.STATUS_DEAD
        if status in (psutil.STATUS_DEAD, psutil.STATUS_ZOMBIE):
            fates.append(f"rank {peer} (pid {pid}) has exited")
        elif status == psutil.STATUS_STOPPED:
            fates.append(f"rank {peer} (pid {pid}) is stopped")
    if fates:
        return "On this node " + ", ".join(fates)
    return "A rank died, hung or was stopped, or the network failed"


def first_line(exc: BaseException) -> str:
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    # Drop gloo's "[/path/to/pair.cc:537] " source location and its chatty advice.
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". This is typically", 1)[0][:200]
