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

# Sub-command -> module that registers it, in --help order. Only the module of the command being
# run is imported, so `cpudist launch` or `hostfile check` start without loading torch.
COMMANDS = {
    "train": "cpudist.commands.train",
    "env": "cpudist.commands.env",
    "launch": "cpudist.launcher",
    "hostfile": "cpudist.hostfile",
    "bench": "cpudist.bench",
    "scaling": "cpudist.bench",
    "merge": "cpudist.tools",
    "generate": "cpudist.tools",
    "eval": "cpudist.tools",
    "report": "cpudist.plots",
}


# Commands that train or run a model: they run on the chosen malloc (cpudist.allocator), set up
# before their module (and torch) is even imported.
COMPUTE_COMMANDS = ("train", "bench", "merge", "generate", "eval")


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpudist",
        description="LoRA fine-tuning of Hugging Face causal LMs on CPUs, one laptop to a cluster.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    wanted = COMMANDS.get(words[0]) if words else None
    modules = [wanted] if wanted else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in given or os.environ.get("CPUDIST_DEBUG") == "1"
    try:
        words = [a for a in given if not a.startswith("-")]
        if argv is None and words and words[0] in COMPUTE_COMMANDS:
            # Only a real command line: a caller passing argv (tests, scripts) keeps its process.
            from cpudist import allocator

            allocator.ensure(_flag_value(given, "--allocator"))
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        debug = debug or args.debug
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
