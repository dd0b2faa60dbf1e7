"""`cpudist eval [--base MODEL] [--adapter DIR] --data FILE | --task FILE`: loss, perplexity and
token accuracy on a data file, or the accuracy on a multiple-choice / QA task (eval.json)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cpudist.commands.common import (
    ModelChoice,
    TrainedModel,
    add_model_arguments,
    add_quantize_arguments,
    check_choice,
    check_positive,
    positive_int,
    trained_model,
)
from cpudist.errors import UserError

if TYPE_CHECKING:
    from cpudist.records import (
        ClassificationReport,
        DataEvalResult,
        PreferenceEvalResult,
        TaskEvalResult,
    )

HELP = ("loss, perplexity and token accuracy on a data file (preference pairs: how often base and "
        "adapter prefer the chosen answer), or accuracy on a task")
DESCRIPTION = ("Evaluate base (+ adapter) on --data FILE with the trainer's own validation code "
               "(the loss equals what training logs for the same validation file; on preference "
               "pairs, data.format=preference, how often the base and the adapter prefer the "
               "chosen answer and the adapter's DPO reward accuracy against the base), or on --task "
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
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N",
                        help="--task QA: tokens generated per answer (default 32)")
    # Unset data/model settings come from the config of the run that wrote --adapter (so the
    # numbers match its validation log), else from the schema defaults.
    parser.add_argument("--format", choices=list(FORMATS), help="data.format")
    parser.add_argument("--max-length", type=_max_length, metavar="N", help="data.max_length")
    parser.add_argument("--batch-size", type=positive_int, metavar="N", help="train.batch_size")
    parser.add_argument("--max-batches", type=positive_int, default=None, metavar="N",
                        help="evaluate only the first N batches (as train.eval_batches)")
    parser.add_argument("--system", help="data.system_prompt")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], help="model.dtype")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _max_length(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value} must be at least 2")
    return value


def run(args: argparse.Namespace) -> int:
    # With --json, stdout carries the one JSON object: the run's log lines go to stderr.
    logs_away = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    if args.task is not None:
        with logs_away:
            result, target = evaluate_task_file(
                ModelChoice.of(args), args.task, out=args.out,
                max_new_tokens=args.max_new_tokens, system=args.system, dtype=args.dtype)
        if args.json:
            print(json.dumps(result.to_json()))
            return 0
        print("\n".join(result.lines()))
        print(f"written to {target}" if target else
              "not written anywhere (no adapter run directory; pass --out FILE to keep it)")
        return 0
    with logs_away:
        scores = evaluate_data(ModelChoice.of(args), args.data, data_format=args.format,
                               max_length=args.max_length, batch_size=args.batch_size,
                               max_batches=args.max_batches, system=args.system,
                               dtype=args.dtype)
    print(json.dumps(scores.to_json()) if args.json else scores.line())
    return 0


def evaluate_data(choice: ModelChoice, data: str | Path, *, data_format: str | None = None,
                  max_length: int | None = None, batch_size: int | None = None,
                  max_batches: int | None = None, system: str | None = None,
                  dtype: str | None = None
                  ) -> DataEvalResult | PreferenceEvalResult | ClassificationReport:
    """`eval --data`: the trainer's validation figures of base (+ adapter) on a data file (a
    classifier's on labelled rows, preference figures on pairs); None = the adapter's run's
    setting, else the default."""
    from cpudist.config import Config, DataConfig, DistConfig, PreferenceConfig, TrainConfig
    from cpudist.data.formats import FORMATS
    from cpudist.infer.evaluate import evaluate_file
    from cpudist.infer.session import open_session
    from cpudist.runtime.process import start_process

    check_choice("format", data_format, list(FORMATS))
    for flag, value in (("max_length", max_length), ("batch_size", batch_size),
                        ("max_batches", max_batches)):
        check_positive(flag, value)
    chosen = trained_model(choice, dtype, {
        "data.format": data_format, "data.max_length": max_length,
        "train.batch_size": batch_size, "data.system_prompt": system, "preference.beta": None})
    settings = chosen.settings
    config = Config(
        model=chosen.model,
        data=DataConfig(path=str(data), format=settings["data.format"],
                        max_length=settings["data.max_length"],
                        system_prompt=settings["data.system_prompt"], val_fraction=0.0),
        train=TrainConfig(batch_size=settings["train.batch_size"], eval_batches=max_batches),
        preference=PreferenceConfig(beta=settings["preference.beta"]))
    classifier = _is_classifier(chosen, settings["data.format"])
    with start_process(DistConfig()) as process:
        session = open_session(config, process, chosen.adapter)
        if classifier:
            from cpudist.infer.classify import evaluate_labelled

            report = evaluate_labelled(session, max_batches)
            report.adapter = _given(choice.adapter)
            return report
        result = evaluate_file(session, max_batches)
    result.adapter = _given(choice.adapter)
    return result


def _given(adapter: str | Path | None) -> str | None:
    return None if adapter is None else str(adapter)


def _is_classifier(chosen: TrainedModel, data_format: str) -> bool:
    """Whether base + adapter (or a base trained in full) is a classifier, scored on
    classification rows; a classification file with a generative model, or the reverse, is a
    one-line error."""
    from cpudist.infer.session import trained_head
    from cpudist.model.adapters import SEQ_CLS

    classifier = trained_head(chosen.model, chosen.adapter).task == SEQ_CLS
    if classifier and data_format != "classification":
        raise UserError(f"{chosen.named} is a classifier; evaluate it on rows of --format "
                        "classification ({'text': ..., 'label': ...})")
    if not classifier and data_format == "classification":
        raise UserError(f"--format classification scores a classifier and {chosen.named} generates "
                        "text: pass --adapter OUTPUT/adapter of a run with "
                        "train.objective=classification (or --base OUTPUT/model of one trained "
                        "with peft.method=full)")
    return classifier


def evaluate_task_file(choice: ModelChoice, task_file: str | Path, *, out: str | Path | None = None,
                       max_new_tokens: int = 32, system: str | None = None,
                       dtype: str | None = None) -> tuple[TaskEvalResult, Path | None]:
    """`eval --task`: the accuracy of the base and of base + adapter on a task, added to `out`
    (default: eval.json in the adapter's run directory); the result and where it was written
    (None: nowhere, no adapter run directory and no out)."""
    from cpudist.config import Config, DistConfig
    from cpudist.data.tasks import load_task
    from cpudist.infer.session import check_generative_model, open_session
    from cpudist.infer.tasks import evaluate_task
    from cpudist.records import TaskEvalResult
    from cpudist.report.metrics import EVAL_FILE, read_eval, write_eval
    from cpudist.runtime.process import start_process
    from cpudist.train.output import run_dir_of

    check_positive("max_new_tokens", max_new_tokens)
    task = load_task(str(task_file))  # a bad file fails before the model loads
    chosen = trained_model(choice, dtype, {"data.system_prompt": system})
    check_generative_model(chosen.model, chosen.adapter, "cpudist eval --task")
    system = chosen.settings["data.system_prompt"]
    run_dir = run_dir_of(chosen.adapter) if chosen.adapter else None
    target = Path(out) if out else (run_dir / EVAL_FILE if run_dir else None)
    if target is not None:
        read_eval(target)  # earlier results that could not be kept stop it before the slow part
    with start_process(DistConfig()) as process:
        session = open_session(Config(model=chosen.model), process, chosen.adapter)
        scores = evaluate_task(session, task, system, max_new_tokens)
        dtype = session.precision.describe()
    result = TaskEvalResult(
        task=task.name, file=str(task.source.resolve()), kind=task.kind, items=len(task.items),
        prompt="lm-evaluation-harness plain text" if task.harness else "chat template",
        base=chosen.model.path, adapter=str(chosen.adapter.resolve()) if chosen.adapter else None,
        dtype=dtype, before=scores["base"], after=scores.get("adapter"))
    if target is not None:
        write_eval(target, result)
    return result, target
