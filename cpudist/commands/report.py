"""`cpudist report OUTPUT_DIR`: plots and report.html of a training run."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "plots and an HTML report of a training run"
DESCRIPTION = ("Write loss.png, lr.png, throughput.png and a self-contained report.html into "
               "OUTPUT_DIR from its metrics.jsonl, summary.json and config.yaml.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the output.dir of a train run")


def run(args: argparse.Namespace) -> int:
    from cpudist.report.plots import write_report

    print(write_report(Path(args.output_dir)))
    return 0
