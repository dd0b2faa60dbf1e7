"""`cpudist hostfile check|convert FILE`: validate or convert an MPI hostfile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cpudist.commands.common import positive_int

HELP = "check or convert an MPI hostfile"
DESCRIPTION = "Hostfiles in Open MPI ('host slots=N') or hydra ('host:N') syntax."
INTERMIXED = False  # sub-actions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    chk = sub.add_parser("check", help="validate syntax, resolve hosts, count slots")
    chk.add_argument("file")
    chk.add_argument("--np", "-np", type=positive_int, default=None,
                     help="ranks you mean to launch: warn when more than the slots")
    chk.add_argument("--no-resolve", dest="resolve", action="store_false",
                     help="do not look the host names up (e.g. checking a file for another site)")
    conv = sub.add_parser("convert", help="rewrite in the other MPI's syntax")
    conv.add_argument("file")
    conv.add_argument("--to", choices=["openmpi", "hydra"], required=True)
    conv.add_argument("-o", "--output", default=None, help="write here instead of stdout")


def run(args: argparse.Namespace) -> int:
    from cpudist.launch import hostfile as hostfiles

    if args.action == "check":
        hosts, warnings = hostfiles.check(args.file, np=args.np, resolve=args.resolve)
        for line in hostfiles.describe(hosts):
            print(line)
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        return 0
    text = hostfiles.render(hostfiles.parse(args.file), args.to)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
