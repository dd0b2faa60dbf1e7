"""`cpudist` command line: dispatch only. Each command's flags and entry live in cpudist/commands/.

Only the module of the command being run is imported, and command modules import torch only
inside their `run`, so `cpudist X --help`, `cpudist launch` or `hostfile check` start in well under
a second.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from cpudist import __version__
from cpudist.errors import ExitCode, Preempted, UserError

# Command -> (module defining HELP, DESCRIPTION, add_arguments(parser) and run(args)), in --help order.
COMMANDS = {
    "train": "cpudist.commands.train",
    "plan": "cpudist.commands.plan",
    "env": "cpudist.commands.env",
    "launch": "cpudist.commands.launch",
    "hostfile": "cpudist.commands.hostfile",
    "fake-cluster": "cpudist.commands.fake_cluster",
    "bench": "cpudist.commands.bench",
    "scaling": "cpudist.commands.scaling",
    "merge": "cpudist.commands.merge",
    "export": "cpudist.commands.export",
    "generate": "cpudist.commands.generate",
    "eval": "cpudist.commands.eval",
    "predict": "cpudist.commands.predict",
    "report": "cpudist.commands.report",
}

# Commands that train or run a model: they run on the chosen malloc (cpudist.runtime.allocator),
# set up before their module (and torch) is even imported.
COMPUTE_COMMANDS = ("train", "bench", "merge", "export", "generate", "eval", "predict")


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def top_parser() -> argparse.ArgumentParser:
    """`cpudist [--debug] COMMAND ...`: the list of commands, from their modules' HELP lines."""
    parser = argparse.ArgumentParser(
        prog="cpudist", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="LoRA fine-tuning of Hugging Face causal LMs on CPUs, one laptop to a cluster.",
        epilog="commands:\n" + "\n".join(
            f"  {name:<10} {importlib.import_module(module).HELP}"
            for name, module in COMMANDS.items()) + "\n\n`cpudist COMMAND --help` for its flags.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action="version", version=f"cpudist {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND")
    return parser


class CommandParser(argparse.ArgumentParser):
    """A command's flags; a bad flag is a UserError like any other bad input (one line on
    stderr, exit code 2), not argparse's usage block."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog}: {message} (`{self.prog} --help` lists the flags)")


def command_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    module = importlib.import_module(COMMANDS[name])
    parser = CommandParser(prog=f"cpudist {name}", description=module.DESCRIPTION,
                           epilog=getattr(module, "EPILOG", None))
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress lines (training steps, rows read and tokenized, model "
                             "conversions); the rest of the log as usual")
    module.add_arguments(parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status says how it ended (cpudist.errors.ExitCode), and every
    way but finishing prints one line on stderr saying which."""
    given = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in given or os.environ.get("CPUDIST_DEBUG") == "1"
    try:
        return _dispatch(given, argv is None)
    except UserError as exc:
        if debug:
            raise
        _say(f"error: {exc}", exc.exit_code)
        return exc.exit_code
    except Preempted as exc:
        _say(str(exc), exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt:
        _say("interrupted", ExitCode.INTERRUPTED)
        return ExitCode.INTERRUPTED
    except Exception:
        # A bug: the traceback is what a report needs, the last line what a scheduler's log shows.
        import traceback

        traceback.print_exc()
        _say("error: the traceback above is a bug in cpudist or a library",
             ExitCode.INTERNAL_ERROR)
        return ExitCode.INTERNAL_ERROR


def _dispatch(given: list[str], real_command_line: bool) -> int:
    words = [a for a in given if not a.startswith("-")]
    if not words or words[0] not in COMMANDS:
        top_parser().parse_args(given)  # prints help or the version, or the error for a bad command
        return ExitCode.BAD_INPUT
    name = words[0]
    if real_command_line and name in COMPUTE_COMMANDS:
        # Only a real command line: a caller passing argv (tests, scripts) keeps its process.
        from cpudist.runtime import allocator

        allocator.ensure(_flag_value(given, "--allocator"))
    rest = list(given)
    rest.remove(name)
    if "--debug" in rest[: given.index(name)]:
        rest.remove("--debug")  # `cpudist --debug COMMAND`: the command parser takes it too
    parser, module = command_parser(name)
    # Intermixed: `section.key=value` overrides may stand before, between or after flags.
    intermixed = getattr(module, "INTERMIXED", True)
    args = parser.parse_intermixed_args(rest) if intermixed else parser.parse_args(rest)
    progress = logging.getLogger("cpudist.progress")  # cpudist.report.console's progress lines
    level = progress.level
    if args.quiet:
        progress.setLevel(logging.WARNING)
    try:
        return int(module.run(args) or 0)
    finally:
        progress.setLevel(level)  # a caller running several commands in one process


def _say(message: str, code: ExitCode) -> None:
    """The one line a command that did not finish ends with: what happened, and its exit class
    (rank-prefixed, so that the lines of several ranks can be told apart)."""
    from cpudist.runtime.cluster import detect_placement, rank_prefix

    try:
        prefix = rank_prefix(detect_placement())
    except UserError:
        prefix = ""
    print(f"{prefix}{message} [exit {int(code)}: {code.describe()}]", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
