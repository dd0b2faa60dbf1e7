"""`cpudist eval [--base MODEL] [--adapter DIR] --data FILE | --task FILE`: loss, perplexity and
token accuracy on a data file, or the accuracy on a multiple-choice / QA task (eval.json)."""

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

HELP = "loss, perplexity and token accuracy on a data file, or accuracy on a task"
DESCRIPTION = ("Evaluate base (+ adapter) on --data FILE with the trainer's own validation code "
               "(the loss equals what training logs for the same validation file), or on --task "
               "FILE, a multiple-choice or QA task (JSONL, or an lm-evaluation-harness task YAML): "
               "accuracy of the base and of base + adapter, written to eval.json in the adapter's "
               "run directory.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from cpudist.data.formats import FORMATS

    add_model_arguments(parser)
    add_quantize_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", metavar="FILE",
                        help=".jsonl/.json/.parquet, a saved datasets directory, or "
                             "chatterbot:english")
    source.add_argument("--task", metavar="FILE",
                        help="a task: .jsonl of {question, choices, answer} (multiple choice) or "
                             "{question, answer} (QA), or an lm-evaluation-harness task .yaml "
                             "(e.g. configs/tasks/chatterbot-trivia-mc.jsonl)")
    parser.add_argument("--out", metavar="FILE",
                        help="--task: where to add the result (default: eval.json in the "
                             "adapter's run directory)")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                        help="--task QA: tokens generated per answer (default 32)")
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

    if args.task is not None:
        return _run_task(args)
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


def _run_task(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cpudist.config import Config, DistConfig, ModelConfig
    from cpudist.data.tasks import load_task
    from cpudist.model.adapters import resolve_adapter
    from cpudist.report.metrics import EVAL_FILE, write_eval
    from cpudist.runtime.process import start_process
    from cpudist.train.output import run_dir_of
    from cpudist.train.session import open_session
    from cpudist.train.tasks import evaluate_task

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    task = load_task(args.task)  # a bad file fails before the model loads
    settle_base(args)
    fill_from_run(args, ["system", "dtype", "quantize", "quantize_group"])
    adapter_dir = resolve_adapter(args.adapter) if args.adapter else None
    run_dir = run_dir_of(adapter_dir) if adapter_dir else None
    target = Path(args.out) if args.out else (run_dir / EVAL_FILE if run_dir else None)
    config = Config(model=ModelConfig(path=args.base, dtype=args.dtype, quantize=args.quantize,
                                      quantize_group=args.quantize_group))
    with start_process(DistConfig()) as process:
        session = open_session(config, process, args.adapter)
        scores = evaluate_task(session, task, args.system, args.max_new_tokens)
        dtype = session.precision.describe()
    result = {"task": task.name, "file": str(task.source.resolve()), "kind": task.kind,
              "items": len(task.items),
              "prompt": "lm-evaluation-harness plain text" if task.harness else "chat template",
              "base": args.base, "adapter": str(adapter_dir.resolve()) if adapter_dir else None,
              "dtype": dtype, "before": scores["base"], "after": scores.get("adapter")}
    if target is not None:
        write_eval(target, task.name, result)
    if args.json:
        print(json.dumps(result))
        return 0
    for metric, before in scores["base"].items():
        after = scores.get("adapter", {}).get(metric)
        line = f"{task.name} {metric}: base {100 * before:.1f}%"
        if after is not None:
            line += f" -> adapter {100 * after:.1f}%"
        print(f"{line}  ({len(task.items)} items)")
    print(f"written to {target}" if target else
          "not written anywhere (no adapter run directory; pass --out FILE to keep it)")
    return 0
