"""`cpudist fake-cluster up N | down | list`: network namespaces as nodes, to rehearse a cluster."""

from __future__ import annotations

import argparse

from cpudist.commands.common import positive_int

HELP = "make or remove a fake cluster of N nodes on this machine (root)"
DESCRIPTION = ("Network namespaces joined by a private link, each one a 'node' with its own "
               "address and host name, for rehearsing multi-node launches on one machine "
               "(docs/OPERATIONS.md). Needs root and iproute2.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "list"])
    parser.add_argument("count", nargs="?", type=positive_int, help="number of nodes (up)")
    parser.add_argument("--prefix", default="node", help="node names PREFIX0, PREFIX1, ... "
                                                         "(default node)")
    parser.add_argument("--link", metavar="RATE[,DELAY[,JITTER[,LOSS]]]",
                        help="up: shape every node's link, e.g. 100mbit,5ms")


def run(args: argparse.Namespace) -> int:
    from cpudist.launch.netns import run_action

    return run_action(args.action, args.count, args.prefix, args.link)
