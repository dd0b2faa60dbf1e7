"""`cpudist train CONFIG [section.key=value ...]`."""

from __future__ import annotations

import argparse
from typing import Any

from cpudist.config import load_config


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train", help="fine-tune with LoRA (run under mpirun for several ranks)",
        description="Fine-tune a causal LM with LoRA. Settings come from CONFIG (YAML) and "
                    "section.key=value overrides, e.g. train.lr=1e-4 data.path=my.jsonl.")
    parser.add_argument("config", nargs="?", help="YAML config (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config_path = args.config
    overrides = list(args.overrides)
    if config_path is not None and "=" in config_path:  # only overrides were given
        overrides.insert(0, config_path)
        config_path = None
    config = load_config(config_path, overrides)
    from cpudist.trainer import train  # torch loads in seconds: config errors come first

    train(config, debug=args.debug)
    return 0
