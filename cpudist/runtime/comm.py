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

from cpudist.errors import PlanRefused, UserError
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
    if not interface and addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"tcp://{addr}:{port}"
    if (placement.launcher == "torchrun" and master_addr is None
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        store, where = torchrun_store(placement, addr, port, timeout_s)
        dist.init_process_group(backend=backend, store=store, rank=placement.rank,
                                world_size=placement.world_size, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, init_method=where, rank=placement.rank,
                                world_size=placement.world_size, timeout=timeout)
    return f"backend={backend_request}->{backend} ({why}); rendezvous {where} via {placement.launcher}"


def torchrun_store(placement: Placement, addr: str, port: int, timeout_s: float) -> tuple[Any, str]:
    """A store of this start of the workers alone, hosted by rank 0, and where it is.

    torchrun's agent keeps one store for every start of the workers (restarts, membership
    changes) and gives it to them without a fresh key prefix, so a restarted rank can read the
    keys its predecessors wrote (gloo's peer addresses: "Connection refused" to a dead rank).
    Rank 0 publishes a new store there; the others take the published one once it answers with
    its token, and read the key again while it does not (left from an earlier start)."""
    import secrets
    import time

    from torch.distributed import TCPStore

    key = "cpudist/store"
    shared = TCPStore(addr, port, placement.world_size, is_master=False,
                      timeout=datetime.timedelta(seconds=timeout_s))
    if placement.rank == 0:
        own = TCPStore(addr, 0, placement.world_size, is_master=True, wait_for_workers=False,
                       timeout=datetime.timedelta(seconds=timeout_s))
        token = secrets.token_hex(8)
        own.set("token", token)
        shared.set(key, f"{addr} {own.port} {token}")
        return own, f"tcp://{addr}:{own.port} (this start's store, from torchrun's {port})"
    deadline = time.monotonic() + timeout_s
    while True:
        host, own_port, token = shared.get(key).decode().split()
        try:
            own = TCPStore(host, int(own_port), placement.world_size, is_master=False,
                           timeout=datetime.timedelta(seconds=3))
            if own.get("token").decode() == token:
                return own, f"tcp://{host}:{own_port} (this start's store, from torchrun's {port})"
        except RuntimeError:
            pass  # an earlier start's store, gone
        if time.monotonic() > deadline:
            raise RuntimeError(f"Timed out: rank 0 published no store of this start in "
                               f"torchrun's store {addr}:{port} within {timeout_s:g} s")
        time.sleep(0.2)


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- MPI gradient allreduce


def gradient_hook(backend: str, compression: str, nonblocking: bool = False) -> tuple[Any, int]:
    """THE DDP communication hook of a run, and the bytes one gradient element takes on the wire.

    DDP takes one hook, so transport (gloo, or MPI for dist.backend=mpi) and compression
    (dist.grad_compression: none, or bf16: half the bytes, each bucket cast to bf16 and
    averaged there, then cast back into the fp32 gradients) combine here."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    bf16 = compression == "bf16"
    if backend == "mpi":
        return mpi_allreduce_hook(nonblocking, bf16), 2 if bf16 else 4
    if bf16:
        return gloo_bf16_hook, 2
    return default_hooks.allreduce_hook, 4


def gloo_bf16_hook(state: Any, bucket):  # type: ignore[no-untyped-def]  # see mpi_allreduce_hook
    """PyTorch's bf16_compress_hook under a name of its own: DDP refuses that hook by name unless
    NCCL is present, though the gloo allreduce it runs works on CPU tensors in bf16."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


def _mpi_bf16_sum() -> Any:
    """An MPI reduction op summing bf16 values carried as 16-bit integers (MPI has no bf16 type):
    each partial sum is rounded to bf16, as gloo's bf16 allreduce does."""
    import numpy as np
    import torch
    from mpi4py import MPI

    def add(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
        a = torch.from_numpy(np.frombuffer(inbuf, dtype=np.int16)).view(torch.bfloat16)
        b = torch.from_numpy(np.frombuffer(inoutbuf, dtype=np.int16)).view(torch.bfloat16)
        b.copy_(a.float().add_(b.float()))

    return MPI.Op.Create(add, commute=True)


def mpi_allreduce_hook(nonblocking: bool = False, bf16: bool = False) -> Any:
    """A DDP communication hook that averages each gradient bucket with MPI (in place, or in a
    bf16 copy with bf16)."""
    import numpy as np
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    op = _mpi_bf16_sum() if bf16 else MPI.SUM

    # No annotations on bucket or the result: DDP's register_comm_hook rejects any but the classes
    # themselves, and under `from __future__ import annotations` every annotation is a string.
    def hook(_state: Any, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        if bf16:
            # Divide before the sum, as DDP's bf16 hook does: the partial sums stay in range.
            wire = buffer.to(torch.bfloat16).div_(world)
            array = wire.view(torch.int16).numpy()
            message = [array, MPI.SHORT]
        else:
            wire = buffer
            array = buffer.numpy()
            message = [array, MPI.FLOAT if array.dtype == np.float32 else MPI.DOUBLE]
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def finish() -> None:
            if bf16:
                buffer.copy_(wire)
            else:
                buffer.div_(world)
            future.set_result(buffer)

        if not nonblocking:
            comm.Allreduce(MPI.IN_PLACE, message, op=op)
            finish()
            return future
        request = comm.Iallreduce(MPI.IN_PLACE, message, op=op)

        def wait() -> None:
            request.Wait()
            finish()

        threading.Thread(target=wait, daemon=True).start()
        return future

    return hook


# --------------------------------------------------------------------------- measured allreduce


class CommMeter:
    """What the gradient allreduce of each optimizer step cost, measured by wrapping DDP's
    communication hook. One definition, used by the bench's figures and its --profile (see
    docs/PERFORMANCE.md, "Communication and waiting"); `step_figures` turns one step's
    measurements on every rank into:

    - bytes: gradient bytes allreduced by this rank (as sent: bf16 compression halves them);
    - last_bucket_bytes: of those, the last bucket's (it holds the input embedding's gradient,
      ready only when backward ends, so none of it can hide: cpudist.bench.scaling_model);
    - compute_s: from the step's start to the hand-over of its last gradient bucket (this rank's
      forward and backward are done);
    - wait_s: this rank's wait for the slowest: the slowest rank's compute_s minus this rank's
      (no allreduce can finish before the last rank hands its bucket over);
    - exposed_s: communication not hidden behind backward and not waiting: from the last bucket's
      hand-over to the last allreduce's completion, minus wait_s;
    - busy_s: allreduce in flight (first hand-over to last completion) minus wait_s.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.last_bucket_bytes = 0
        self.first_launch: float | None = None
        self.last_launch = 0.0
        self.last_done = 0.0
        self._lock = threading.Lock()

    def wrap(self, hook: Callable[[Any, Any], Any], wire_element_bytes: int = 4
             ) -> Callable[[Any, Any], Any]:
        """hook, measured; wire_element_bytes: what one gradient element takes on the wire (2 when
        the hook compresses to bf16)."""
        import functools
        import time

        @functools.wraps(hook)
        def measured(state: Any, bucket):  # type: ignore[no-untyped-def]  # see mpi_allreduce_hook
            now = time.perf_counter()
            with self._lock:
                sent = bucket.buffer().numel() * wire_element_bytes
                self.bytes += sent
                if bucket.is_last():
                    self.last_bucket_bytes = sent
                self.first_launch = now if self.first_launch is None else self.first_launch
                self.last_launch = now
            future = hook(state, bucket)

            def done(result: Any) -> Any:
                with self._lock:
                    self.last_done = max(self.last_done, time.perf_counter())
                return result.value()

            return future.then(done)

        return measured

    def take(self, started: float | None = None) -> dict[str, float]:
        """This rank's raw figures since the previous call (perf_counter times relative to
        `started`, the step's start; the step is taken to have ended now), and start again."""
        import time

        now = time.perf_counter()
        with self._lock:
            figures = {"bytes": float(self.bytes), "last_bucket_bytes": float(self.last_bucket_bytes),
                       "compute_s": 0.0, "after_s": 0.0, "in_flight_s": 0.0}
            if started is not None:
                # No bucket (a single process): the whole step was compute.
                last = self.last_launch if self.first_launch is not None else now
                figures["compute_s"] = max(0.0, last - started)
            if self.first_launch is not None:
                figures["after_s"] = max(0.0, self.last_done - self.last_launch)
                figures["in_flight_s"] = max(0.0, self.last_done - self.first_launch)
            self.bytes, self.last_bucket_bytes = 0, 0
            self.first_launch, self.last_launch, self.last_done = None, 0.0, 0.0
        return figures


def step_figures(raw: list[dict[str, float]]) -> list[dict[str, float]]:
    """Every rank's CommMeter.take() of one step (in rank order) -> each rank's bytes,
    last_bucket_bytes, compute_s, wait_s, exposed_s and busy_s as CommMeter defines them. Pure,
    so the definition is tested."""
    slowest = max(r["compute_s"] for r in raw)
    figures = []
    for r in raw:
        wait = slowest - r["compute_s"]
        figures.append({"bytes": r["bytes"], "last_bucket_bytes": r["last_bucket_bytes"],
                        "compute_s": r["compute_s"], "wait_s": wait,
                        "exposed_s": max(0.0, r["after_s"] - wait),
                        "busy_s": max(0.0, r["in_flight_s"] - wait)})
    return figures


def bus_gbps(bytes_per_rank: float, busy_s: float, world: int) -> float:
    """Achieved bus bandwidth (the NCCL-tests convention): what a ring allreduce of that many bytes
    moves per rank, 2 (n-1)/n x bytes, over the time the allreduce was in flight."""
    if busy_s <= 0 or world < 2:
        return 0.0
    return bytes_per_rank * 2 * (world - 1) / world / busy_s / 1e9


# --------------------------------------------------------------------------- small collectives


# The reductions `allreduce` implements, by name.
REDUCE_OPS = ("sum", "max", "min")


def allreduce(values: list[float], placement: Placement, op: str = "sum") -> list[float]:
    """Reduce a few numbers over ranks with op ("sum", "max" or "min"); identity for a single
    process. Any other op is refused, on one rank as on many."""
    if op not in REDUCE_OPS:
        raise ValueError(f"allreduce op {op!r}: choose one of {', '.join(REDUCE_OPS)}")
    if not placement.distributed:
        return values
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=reduce_op(op))
    return tensor.tolist()


def reduce_op(name: str) -> Any:
    """torch.distributed's ReduceOp for one of REDUCE_OPS."""
    import torch.distributed as dist

    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[name]


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


def agree_on_error(placement: Placement, error: UserError | None) -> None:
    """Raise the same UserError on every rank if any rank hit one (no rank is left waiting); a
    PlanRefused stays one (it has an exit status of its own)."""
    kind = PlanRefused if isinstance(error, PlanRefused) else UserError
    gathered = all_gather(None if error is None else (kind, str(error)), placement)
    first = next((e for e in gathered if e), None)
    if first:
        kind, message = first
        raise kind(message)


def agreed(placement: Placement, action: Callable[[], T]) -> T:
    """action() on every rank; a UserError on any rank stops every rank with the same message."""
    error, result = None, None
    try:
        result = action()
    except UserError as exc:
        error = exc
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
