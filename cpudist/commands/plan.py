"""`cpudist plan [CONFIG] [section.key=value ...]`: the memory a run will need, before it loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cpudist.commands.common import add_settings, positive_int, split_settings

HELP = "memory a run will need per rank and per node, and whether it fits"
DESCRIPTION = ("Predict, before any weight is read, the memory of a training run per rank and per "
               "node (frozen weights by dtype or quantization, adapter and optimizer, activations "
               "with or without checkpointing, loss head, process) and whether it fits the node "
               "(the smallest of MemTotal, the cgroup limit and Slurm's memory per node); when it "
               "does not, the settings that would make it fit. `cpudist train` runs the same "
               "check first.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser)
    parser.add_argument("--ranks-per-node", type=positive_int, default=None, metavar="N",
                        help="ranks sharing a node (default: what the launcher says, else 1)")
    parser.add_argument("--world-size", type=positive_int, default=None, metavar="N",
                        help="ranks in the whole run, for train.global_batch and, with "
                        "peft.method=full, DDP's gradient buckets (default: what the launcher "
                        "says, else the ranks per node)")
    parser.add_argument("--json", metavar="FILE|-", help="also write the figures as JSON "
                        "(- prints them); node_peak_gb compares with the bench's peak_rss_gb "
                        "(1 rank) or node_pss_gb (several)")


def run(args: argparse.Namespace) -> int:
    from cpudist.config import load_config
    from cpudist.runtime.process import quiet_libraries
    from cpudist.train.plan import describe, plan_here

    config = load_config(*split_settings(args.settings))
    quiet_libraries()
    plan, batch_line = plan_here(config, args.ranks_per_node, args.world_size)
    if args.json == "-":
        print(json.dumps(plan.as_dict()))
        return 0
    if batch_line:
        print(f"batch: {batch_line}")
    print(describe(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan.as_dict(), indent=1))
    return 0
