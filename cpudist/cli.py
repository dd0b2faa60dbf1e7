"""`cpudist` command line: thin parsing; each command lives in the module that owns its concern.

Every command module exposes ``register(subparsers)`` which adds its sub-command(s) and sets
``func`` (called with the parsed args, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from cpudist.errors import UserError

# Modules that register sub-commands, in the order they appear in --help.
COMMAND_MODULES = [
    "cpudist.commands.train",
    "cpudist.commands.env",
    "cpudist.launcher",
    "cpudist.hostfile",
    "cpudist.bench",
    "cpudist.tools",
    "cpudist.plots",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpudist",
        description="LoRA fine-tuning of Hugging Face causal LMs on CPUs, one laptop to a cluster.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that command is not part of this build
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("CPUDIST_DEBUG") == "1"
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if debug:
            raise
        from cpudist.cluster import detect_placement, rank_prefix

        print(f"{rank_prefix(detect_placement())}error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
