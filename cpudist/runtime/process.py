"""Starting and ending a rank: the first thing every command that runs a model does.

`start_process` quiets third-party libraries, finds this rank's placement, sets up logging, gives
the rank its threads and cores, joins the process group, and on the way out makes every rank end
together (or, when a peer was lost, says which one and exits without waiting for it).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cpudist.config import DistConfig
from cpudist.errors import ExitCode
from cpudist.runtime.cluster import (
    Placement,
    detect_placement,
    pin_threads,
    rank_prefix,
    thread_override,
    threads_for_rank,
)
from cpudist.runtime.comm import (
    all_gather,
    barrier,
    first_line,
    init_process_group,
    lost_peer,
    peer_fate,
    shutdown,
)

log = logging.getLogger("cpudist")
T = TypeVar("T")


@dataclass(frozen=True)
class Process:
    """This rank: where it sits, what it computes with, how it talks to the others."""

    placement: Placement
    threads: int
    cpus: list[int] | None  # the CPUs this rank is bound to (None: affinity not supported)
    communication: str  # one line for the log: backend, rendezvous, hook, timeout
    peers: list[tuple[str, int]] = field(default_factory=list)  # (host, pid) of every rank
    # The CPUs of every rank on this node (this one's alone when it is the only one).
    node_cpus: list[list[int] | None] = field(default_factory=list)

    def describe(self) -> str:
        p = self.placement
        each = self.node_cpus if len(self.node_cpus) > 1 else [self.cpus]
        cores = "; ".join(("not bound" if cpus is None else ",".join(map(str, cpus)))
                          for cpus in each)
        return (f"ranks: {p.world_size} ({p.launcher}), this node: {p.local_size}, threads per "
                f"rank: {self.threads}, cores{' of each rank here' if len(each) > 1 else ''}: "
                f"{cores}")


def quiet_libraries() -> None:
    """Silence third-party progress bars and chatter that drown cpudist's own log."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub at run time
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


def configure_logging(placement: Placement, debug: bool = False) -> None:
    """Rank 0 logs info; other ranks only warnings and errors, prefixed with their rank."""
    level = logging.DEBUG if debug else logging.INFO
    if not placement.is_main:
        level = logging.WARNING
    handler = logging.StreamHandler(sys.stderr if not placement.is_main else sys.stdout)
    handler.setFormatter(logging.Formatter(f"{rank_prefix(placement)}%(message)s"))
    root = logging.getLogger("cpudist")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # Python warnings from libraries go through the same handler, so they carry the rank prefix.
    logging.captureWarnings(True)
    py_warnings = logging.getLogger("py.warnings")
    py_warnings.handlers[:] = [handler]
    py_warnings.propagate = False
    # A library's own logger (kernels, which bitsandbytes brings in, warns at import) reaches the
    # root logger, which has no handler, so Python's last resort prints it bare: give that one the
    # prefix too. The root logger itself is left alone (pytest, notebooks and callers hang theirs
    # on it).
    last_resort = logging.StreamHandler(sys.stderr)
    last_resort.setFormatter(logging.Formatter(f"{rank_prefix(placement)}%(message)s"))
    last_resort.setLevel(logging.WARNING)
    logging.lastResort = last_resort


@contextlib.contextmanager
def start_process(dist: DistConfig, debug: bool = False, resume_hint: str = "",
                  stacks_dir: Path | None = None) -> Iterator[Process]:
    """This rank, set up; see the module docstring. Keep what holds DDP or tensors of collectives
    inside a function called in the with-block, so it is freed before the ranks' final barrier.

    resume_hint: advice appended when a peer is lost (e.g. how to continue from a checkpoint).
    stacks_dir: where rank 0 writes its Python stacks when a peer is lost (every other rank
    prints them to stderr), so that a hang shows where each live rank was waiting.
    """
    quiet_libraries()
    placement = detect_placement()
    configure_logging(placement, debug)
    threads = threads_for_rank(placement, dist.threads_per_rank)
    override = thread_override(placement, threads, dist.threads_per_rank)
    if override:
        log.info("threads: %s", override)
    cpus = pin_threads(placement, threads)
    communication = "single process"
    peers: list[tuple[str, int]] = [(socket.gethostname(), os.getpid())]
    node_cpus: list[list[int] | None] = [cpus]
    try:
        if placement.distributed:
            communication = init_process_group(placement, dist.backend, dist.master_addr,
                                               dist.master_port, dist.interface, dist.timeout_s)
            if dist.backend == "mpi":
                communication += ("; DDP comm hook: non-blocking MPI Iallreduce"
                                  if dist.mpi_nonblocking else "; DDP comm hook: MPI Allreduce")
            communication += f"; collective timeout {dist.timeout_s:g} s"
            # Who runs where: if a peer vanishes, this rank can say which one (on its own node).
            everyone = all_gather((*peers[0], cpus), placement)
            peers = [(host, pid) for host, pid, _ in everyone]
            node_cpus = [c for host, _, c in everyone if host == peers[placement.rank][0]]
        yield Process(placement, threads, cpus, communication, peers, node_cpus)
        # Every rank ends here together (done, or stopped by a signal). gloo's worker threads
        # drop the tensors of the last collective (Python-owned, from *_object collectives)
        # after wait() returns; if that lands during interpreter shutdown the process aborts.
        # A barrier, then freeing DDP and the group, keeps that inside the live interpreter.
        barrier(placement)
        gc.collect()
    except RuntimeError as exc:
        if not placement.distributed or debug or not lost_peer(exc):
            raise
        code = ExitCode.LOST_PEER
        log.error("error: lost contact with the other ranks (%s). %s; see the other ranks' output "
                  "(mpirun names a rank that died).%s [exit %d: %s]", first_line(exc),
                  peer_fate(peers, placement.rank), f" {resume_hint}" if resume_hint else "",
                  code, code.describe())
        _dump_stacks(exc, placement.rank, stacks_dir)
        sys.stdout.flush()
        sys.stderr.flush()
        # No clean shutdown: destroying the group or MPI_Finalize would wait for the lost peer.
        os._exit(code)
    finally:
        shutdown()


def _dump_stacks(exc: BaseException, rank: int, stacks_dir: Path | None) -> None:
    """Where this rank was when contact was lost (the collective it waited in, and the step that
    called it) and every thread's stack (faulthandler): to stacks_dir/lost-contact-rank0.txt on
    rank 0 when that directory exists, to stderr elsewhere."""
    import faulthandler
    import traceback

    frames = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)))
    header = f"[rank {rank}] stack when contact was lost (most recent call last):\n"
    target = stacks_dir / f"lost-contact-rank{rank}.txt" if stacks_dir is not None else None
    if rank == 0 and target is not None and target.parent.is_dir():
        with open(target, "w") as handle:
            handle.write(header + frames + "\nall threads (faulthandler):\n")
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
        log.warning("this rank's stacks when contact was lost: %s", target)
        return
    sys.stderr.write(header + frames)
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def run_apart(function: Callable[..., T], *args: Any) -> T:
    """function(*args) in a fresh child process (spawned: no MPI, no threads inherited); its
    result or its exception comes back. For one-time conversions whose memory should return to
    the system when they end instead of staying in this process's allocator. The child logs as
    this process does (its progress lines on rank 0 only)."""
    import multiprocessing

    logger = logging.getLogger("cpudist")
    handler = next(iter(logger.handlers), None)
    form = getattr(handler.formatter, "_fmt", None) if handler and handler.formatter else None
    to_stdout = getattr(handler, "stream", None) is sys.stdout
    levels = (logger.getEffectiveLevel(), logging.getLogger("cpudist.progress").level)
    with multiprocessing.get_context("spawn").Pool(
            1, initializer=_log_as, initargs=(*levels, form, to_stdout)) as pool:
        return pool.apply(function, args)


def _log_as(level: int, progress_level: int, form: str | None, to_stdout: bool) -> None:
    """A spawned child's "cpudist" logger, as its parent's (levels, line format, stream)."""
    handler = logging.StreamHandler(sys.stdout if to_stdout else sys.stderr)
    handler.setFormatter(logging.Formatter(form or "%(message)s"))
    root = logging.getLogger("cpudist")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    logging.getLogger("cpudist.progress").setLevel(progress_level)  # --quiet
