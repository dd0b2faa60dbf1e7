"""`cpudist env`: what this machine offers and what cpudist will do with it."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform

from cpudist.commands.common import positive_int
from cpudist.errors import UserError

HELP = "show CPU features, chosen dtype, threads, malloc, versions"
DESCRIPTION = ("What this machine offers (CPU, ISA features, cores, MPI, libraries) and what "
               "cpudist will do with it (dtype and why, threads per rank, malloc).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from cpudist.runtime.allocator import CHOICES

    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="dtype policy to explain (model.dtype)")
    parser.add_argument("--shell", action="store_true",
                        help="print instead the environment of a rank bound to its own cores, as "
                             "`export` lines (what cpudist launch gives each rank; for batch "
                             "files that start ranks themselves, e.g. with srun)")
    parser.add_argument("--threads-per-rank", type=positive_int, metavar="N",
                        help="with --shell: the rank's threads (default: this machine's physical "
                             "cores)")
    parser.add_argument("--allocator", choices=CHOICES, help="with --shell: the malloc to preload "
                        "(default: CPUDIST_ALLOCATOR, else auto)")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def mpi_library() -> str:
    """The MPI the launcher would use (the venv's own mpirun first, then PATH)."""
    from cpudist.launch.mpi import detect_mpi

    try:
        mpi = detect_mpi()
    except UserError as exc:
        return f"none usable ({exc})"
    return f"{mpi.version_line} ({mpi.mpirun})"


def _malloc() -> str:
    from cpudist.runtime.allocator import ENV, choose_allocator, requested

    request = requested()
    try:
        name, lib = choose_allocator(request)
    except UserError as exc:
        return str(exc)
    if name is None:
        hint = ("" if request == "none"
                else " (no allocator library loads: reinstall cpudist, which brings cmeel-mimalloc)")
        return f"glibc malloc, {ENV}={request}{hint}"
    return f"{name} {lib}, {ENV}={request}"


def _compile_readiness() -> str:
    from cpudist.train.engine import COMPILE_MIN_HIDDEN, COMPILE_MIN_STEPS, compiler_problem

    problem = compiler_problem()
    if problem:
        return f"unavailable: {problem}; train.compile=auto stays eager"
    return (f"can build; train.compile=auto compiles models with hidden size >= "
            f"{COMPILE_MIN_HIDDEN} on runs of >= {COMPILE_MIN_STEPS} steps")


def report() -> list[tuple[str, str]]:
    import torch

    from cpudist.runtime import mkl_shim
    from cpudist.runtime.cluster import detect_placement, threads_for_rank
    from cpudist.runtime.comm import ccl_available
    from cpudist.runtime.hardware import cpu_info, physical_cores
    from cpudist.runtime.precision import choose_precision

    info = cpu_info()
    placement = detect_placement()
    mkldnn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ipex = importlib.util.find_spec("intel_extension_for_pytorch") is not None
    return [
        ("cpu", info.model),
        ("isa", " ".join(info.flags) or "none of avx2/avx512/amx"),
        ("dtype (auto)", choose_precision("auto", info).describe()),
        ("oneDNN bf16 kernels", "yes" if mkldnn_bf16 else "no"),
        ("physical cores", str(physical_cores())),
        ("placement", f"rank {placement.rank}/{placement.world_size} via {placement.launcher}, "
                      f"{placement.local_size} on this node"),
        ("threads per rank", str(threads_for_rank(placement))),
        ("malloc (train, bench, ...)", _malloc()),
        ("MKL (train, bench, ...)", mkl_shim.for_compute_commands()),
        ("torch.compile (auto)", _compile_readiness()),
        ("python", platform.python_version()),
        ("torch", f"{torch.__version__} (gloo: {torch.distributed.is_gloo_available()})"),
        ("transformers", _version("transformers")),
        ("peft", _version("peft")),
        ("datasets", _version("datasets")),
        ("mpi4py", _version("mpi4py")),
        ("mpi library", mpi_library()),
        ("oneccl bindings", "found" if ccl_available() else "not installed (gloo is used)"),
        ("ipex", _version("intel-extension-for-pytorch") if ipex else
                 "not installed (optional, retired upstream, needs torch 2.8)"),
    ]


def shell_env(threads: int, allocator: str | None) -> str:
    """`export NAME=value` lines of one bound rank's environment (cpudist.launch.mpi.rank_env)."""
    import os
    import shlex

    from cpudist.launch.mpi import Layout, rank_env
    from cpudist.runtime.allocator import choose_allocator, requested

    name, lib = choose_allocator(requested(allocator))
    layout = Layout(ranks_per_node=1, threads=threads, bind=True, oversubscribe=False)
    env = rank_env(layout, name, lib, os.environ.get("LD_PRELOAD"))
    return "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items())


def run(args: argparse.Namespace) -> int:
    from cpudist.runtime.hardware import physical_cores
    from cpudist.runtime.precision import choose_precision

    if args.shell:
        threads = args.threads_per_rank or physical_cores()
        if threads < 1:
            raise UserError(f"--threads-per-rank {threads}: must be at least 1")
        print(shell_env(threads, args.allocator), end="")
        return 0
    rows = report()
    if args.dtype != "auto":
        rows.append((f"dtype ({args.dtype})", choose_precision(args.dtype).describe()))
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
