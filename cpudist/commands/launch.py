"""`cpudist launch -np N [options] -- COMMAND ...`: a cpudist command on N ranks with mpirun."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from cpudist.commands.common import non_negative_int, positive_int, split_settings
from cpudist.errors import UserError
from cpudist.runtime.allocator import CHOICES as ALLOCATORS

HELP = "start a cpudist command on N ranks with mpirun"
DESCRIPTION = ("Build and run the mpirun command for the MPI found (Open MPI, MPICH or Intel MPI). "
               "Everything after '--' is the cpudist command each rank runs.")
EPILOG = ("example: cpudist launch -np 2 -- train configs/quickstart.yaml train.max_steps=5; "
          "spot instances: cpudist launch -np 8 --hostfile hosts --restarts 5 --min-np 4 -- "
          "train my.yaml train.save_every=50")
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
    parser.add_argument("--restarts", type=non_negative_int, default=0, metavar="K",
                        help="when a rank dies (not on bad input, not when stopped by Ctrl-C or "
                             "SIGTERM), start the train job again with train.resume=auto, at "
                             "most K times; each restart is a record in OUTPUT/metrics.jsonl")
    parser.add_argument("--min-np", type=positive_int, default=None, metavar="N",
                        help="with --restarts and --hostfile: the hostfile is read again before "
                             "each restart and the job runs on its slots when fewer than -np, "
                             "but not on fewer than N ranks (default: -np, the same world size)")
    parser.add_argument("--restart-delay", type=float, default=10.0, metavar="SECONDS",
                        help="wait before each restart (default 10)")
    parser.add_argument("--note-restart", type=positive_int, default=None, metavar="ATTEMPT",
                        help="only append the restart record ATTEMPT (with --reason) to the run's "
                             "metrics.jsonl and exit: for batch files that restart the job "
                             "themselves (launch/slurm.sbatch)")
    parser.add_argument("--reason", default="the job failed", help="with --note-restart")
    parser.add_argument("program", nargs=argparse.REMAINDER,
                        help="-- then the cpudist command, e.g. -- train CONFIG key=value")


def run(args: argparse.Namespace) -> int:
    from cpudist.launch.runner import Restarts, launch

    program = list(args.program)
    if program and program[0] == "--":
        program = program[1:]
    if args.quiet and program and "--quiet" not in program:
        # Every command takes --quiet, launch too: given to launch it can only mean the ranks'
        # progress lines (launch has none of its own).
        program = [program[0], "--quiet", *program[1:]]
    if args.note_restart is not None:
        restart_recorder(program)(args.note_restart, args.reason)
        return 0
    restarts = None
    if args.restarts:
        if args.min_np is not None and args.min_np > args.np:
            raise UserError(f"--min-np {args.min_np} is more than -np {args.np}; give a number "
                            "of ranks between 1 and -np")
        if args.restart_delay < 0:
            raise UserError(f"--restart-delay {args.restart_delay:g}: give 0 or more seconds")
        restarts = Restarts(args.restarts, args.min_np or args.np, args.restart_delay,
                            [*program, "train.resume=auto"], restart_recorder(program))
    elif args.min_np is not None:
        raise UserError("--min-np applies to restarts: add --restarts K")
    return launch(args.np, program, hostfile=args.hostfile,
                  threads_per_rank=args.threads_per_rank, cores_per_node=args.cores_per_node,
                  allocator=args.allocator, mpirun=args.mpirun, mpi_args=args.mpi_arg,
                  dry_run=args.dry_run, restarts=restarts)


def restart_recorder(program: list[str]) -> Callable[[int, str], None]:
    """What writes a restart record of the train job `program` into its OUTPUT/metrics.jsonl
    (the launcher writes it between two jobs, when no rank does)."""
    import datetime

    from cpudist.config import load_config
    from cpudist.records import RestartEvent
    from cpudist.report.metrics import append_event
    from cpudist.train.checkpoint_files import newest_usable, step_of

    if not program or program[0] != "train":
        raise UserError(f"--restarts and --note-restart restart `train` jobs only, not "
                        f"{' '.join(program[:1]) or 'nothing'}; run: cpudist launch -np N "
                        "--restarts K -- train CONFIG ...")
    # The job's own settings (flags such as --debug aside) say where its output goes.
    config = load_config(*split_settings([w for w in program[1:] if not w.startswith("-")]))
    out = Path(config.output.dir)

    def record(attempt: int, reason: str) -> None:
        found, _ = newest_usable(out / "checkpoints")  # the one the resumed job will take
        try:
            append_event(out / "metrics.jsonl", RestartEvent(
                attempt=attempt, reason=reason, resumed_from_step=step_of(found) if found else 0,
                time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")))
        except OSError as exc:  # a missing record must not stop the restart itself
            print(f"cpudist launch: could not write the restart record to {out / 'metrics.jsonl'}"
                  f": {exc.strerror or exc}", file=sys.stderr)

    return record
