"""`cpudist launch -np N [options] -- COMMAND ...`: a cpudist command on N ranks with mpirun."""

from __future__ import annotations

import argparse

from cpudist.commands.common import positive_int
from cpudist.runtime.allocator import CHOICES as ALLOCATORS

HELP = "start a cpudist command on N ranks with mpirun"
DESCRIPTION = ("Build and run the mpirun command for the MPI found (Open MPI, MPICH or Intel MPI). "
               "Everything after '--' is the cpudist command each rank runs.")
EPILOG = "example: cpudist launch -np 2 -- train configs/quickstart.yaml train.max_steps=5"
INTERMIXED = False  # everything after '--' belongs to the ranks' command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-np", "-n", "--np", dest="np", type=positive_int, required=True,
                        help="number of ranks")
    parser.add_argument("--hostfile", "-f", default=None,
                        help="hosts and slots, either MPI's syntax (converted as needed)")
    parser.add_argument("--threads-per-rank", type=positive_int, default=None,
                        help="default: physical cores per node / ranks per node")
    parser.add_argument("--cores-per-node", type=positive_int, default=None,
                        help="physical cores on each node (default: this machine's)")
    parser.add_argument("--allocator", choices=ALLOCATORS,
                        default="auto", help="LD_PRELOAD a faster malloc when found (auto)")
    parser.add_argument("--mpirun", default=None, help="mpirun/mpiexec to use")
    parser.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for mpirun, repeatable (--mpi-arg=--mca ...)")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    parser.add_argument("program", nargs=argparse.REMAINDER,
                        help="-- then the cpudist command, e.g. -- train CONFIG key=value")


def run(args: argparse.Namespace) -> int:
    from cpudist.launch.runner import launch

    program = list(args.program)
    if program and program[0] == "--":
        program = program[1:]
    return launch(args.np, program, hostfile=args.hostfile,
                  threads_per_rank=args.threads_per_rank, cores_per_node=args.cores_per_node,
                  allocator=args.allocator, mpirun=args.mpirun, mpi_args=args.mpi_arg,
                  dry_run=args.dry_run)
