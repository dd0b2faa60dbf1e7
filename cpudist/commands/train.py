"""`cpudist train [CONFIG] [section.key=value ...]`."""

from __future__ import annotations

import argparse

from cpudist.commands.common import add_settings, split_settings

HELP = "fine-tune with LoRA (run under mpirun for several ranks)"
DESCRIPTION = ("Fine-tune a causal LM with LoRA. Settings come from CONFIG (YAML) and "
               "section.key=value overrides, e.g. train.lr=1e-4 data.path=my.jsonl.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings(parser)


def run(args: argparse.Namespace) -> int:
    from cpudist.config import load_config

    config = load_config(*split_settings(args.settings))
    from cpudist.train.run import train  # torch loads in seconds: config errors come first

    train(config, debug=args.debug)
    return 0
