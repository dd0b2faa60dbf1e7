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
    parser = build_parser(argv)
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
