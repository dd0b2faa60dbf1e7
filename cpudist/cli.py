"""`cpudist` command line: dispatch only. Each command's flags and entry live in cpudist/commands/.

Only the module of the command being run is imported, and command modules import torch only
inside their `run`, so `cpudist X --help`, `cpudist launch` or `hostfile check` start in well under
a second.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from cpudist.errors import USER_ERROR_EXIT, UserError

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
    module.add_arguments(parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in given or os.environ.get("CPUDIST_DEBUG") == "1"
    try:
        words = [a for a in given if not a.startswith("-")]
        if not words or words[0] not in COMMANDS:
            top_parser().parse_args(given)  # prints help, or the error for an unknown command
            return 2
        name = words[0]
        if argv is None and name in COMPUTE_COMMANDS:
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
        debug = debug or args.debug
        return int(module.run(args) or 0)
    except UserError as exc:
        if debug:
            raise
        from cpudist.runtime.cluster import detect_placement, rank_prefix

        print(f"{rank_prefix(detect_placement())}error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
