"""`cpudist eval --base MODEL [--adapter DIR] --data FILE`: loss, perplexity, token accuracy."""

from __future__ import annotations

import argparse
import json
import math

from cpudist.commands.common import (
    add_model_arguments,
    add_quantize_arguments,
    fill_from_run,
    settle_base,
)
from cpudist.errors import UserError

HELP = "loss, perplexity and token accuracy on a data file"
DESCRIPTION = ("Evaluate base (+ adapter) on FILE with the trainer's own validation code: the loss "
               "equals what training logs for the same validation file.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from cpudist.data.formats import FORMATS

    add_model_arguments(parser)
    add_quantize_arguments(parser)
    parser.add_argument("--data", required=True, metavar="FILE",
                        help=".jsonl/.json/.parquet, a saved datasets directory, or "
                             "chatterbot:english")
    # Unset data/model settings come from the config of the run that wrote --adapter (so the
    # numbers match its validation log), else from the schema defaults.
    parser.add_argument("--format", choices=list(FORMATS), help="data.format")
    parser.add_argument("--max-length", type=int, metavar="N", help="data.max_length")
    parser.add_argument("--batch-size", type=int, metavar="N", help="train.batch_size")
    parser.add_argument("--max-batches", type=int, default=None, metavar="N",
                        help="evaluate only the first N batches (as train.eval_batches)")
    parser.add_argument("--system", help="data.system_prompt")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], help="model.dtype")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from cpudist.config import Config, DataConfig, DistConfig, ModelConfig, TrainConfig
    from cpudist.runtime.process import start_process
    from cpudist.train.evaluate import evaluate_file
    from cpudist.train.session import open_session

    settle_base(args)
    fill_from_run(args, ["format", "max_length", "batch_size", "system", "dtype", "quantize",
                         "quantize_group"])
    for flag, value, least in (("--max-length", args.max_length, 2),
                               ("--batch-size", args.batch_size, 1),
                               ("--max-batches", args.max_batches, 1)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least} (got {value})")
    config = Config(
        model=ModelConfig(path=args.base, dtype=args.dtype, quantize=args.quantize,
                          quantize_group=args.quantize_group),
        data=DataConfig(path=args.data, format=args.format, max_length=args.max_length,
                        system_prompt=args.system, val_fraction=0.0),
        train=TrainConfig(batch_size=args.batch_size, eval_batches=args.max_batches))
    with start_process(DistConfig()) as process:
        session = open_session(config, process, args.adapter)
        result = {**evaluate_file(session, args.max_batches), "adapter": args.adapter}
    if args.json:
        print(json.dumps(result))
        return 0
    ppl = result["perplexity"]
    print(f"loss {result['loss']:.4f}  perplexity {ppl:.2f}{' (capped)' if ppl >= math.exp(50) else ''}"
          f"  token accuracy {100 * result['token_accuracy']:.2f}%  "
          f"({result['label_tokens']} label tokens, {result['samples']} samples; {result['dtype']})")
    return 0
