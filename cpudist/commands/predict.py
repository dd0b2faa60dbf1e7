"""`cpudist predict --adapter DIR --data FILE --out preds.jsonl`: a classifier's labels and scores
for each row of a file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cpudist.commands.common import (
    ModelChoice,
    add_model_arguments,
    check_positive,
    positive_int,
    trained_model,
)

HELP = "a trained classifier's labels and scores for the rows of a file"
NOT_A_CLASSIFIER = ("cpudist predict needs a classifier: --adapter OUTPUT/adapter of a run with "
                    "train.objective=classification, or --base OUTPUT/model of one trained with "
                    "peft.method=full")
DESCRIPTION = ("Each row of --data (a 'text' field, optionally 'text_pair'; other fields are kept, "
               "a given 'label'/'labels' as given_label/given_labels) is written to --out with the "
               "predicted 'label' (or, multi-label, 'labels': those at or above their threshold "
               "in the classifier's classification.json) and every label's probability in "
               "'scores'. The classifier: --adapter DIR, or --base OUTPUT/model of a classifier "
               "trained with peft.method=full (any transformers *ForSequenceClassification "
               "directory works too).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--data", required=True, metavar="FILE",
                        help=".jsonl/.json/.parquet or a saved datasets directory of rows with "
                             "'text'")
    parser.add_argument("--out", required=True, metavar="FILE", help="predictions (.jsonl)")
    parser.add_argument("--batch-size", type=positive_int, metavar="N",
                        help="rows per forward (default: train.batch_size of the adapter's run)")
    parser.add_argument("--max-length", type=positive_int, metavar="N",
                        help="data.max_length (default: the adapter's run)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"],
                        help="model.dtype (default: the adapter's run, else auto)")


def run(args: argparse.Namespace) -> int:
    rows = predict_file(ModelChoice.of(args), args.data, args.out, batch_size=args.batch_size,
                        max_length=args.max_length, dtype=args.dtype)
    print(f"{len(rows)} predictions written to {args.out}")
    return 0


def predict_file(choice: ModelChoice, data: str | Path, out: str | Path | None = None, *,
                 batch_size: int | None = None, max_length: int | None = None,
                 dtype: str | None = None) -> list[dict[str, Any]]:
    """A classifier's prediction for each row of `data` (its fields, the predicted 'label' or
    'labels', every label's probability in 'scores'), written to `out` (.jsonl) when given."""
    from cpudist.config import Config, DataConfig, DistConfig
    from cpudist.errors import UserError
    from cpudist.infer.classify import predict_rows, write_predictions
    from cpudist.infer.session import open_session, trained_head
    from cpudist.model.adapters import SEQ_CLS
    from cpudist.runtime.process import start_process

    if choice.adapter is None and choice.base is None:
        raise UserError(NOT_A_CLASSIFIER)
    check_positive("batch_size", batch_size)
    check_positive("max_length", max_length)
    chosen = trained_model(choice, dtype, {"train.batch_size": batch_size,
                                           "data.max_length": max_length})
    if trained_head(chosen.model, chosen.adapter).task != SEQ_CLS:
        raise UserError(f"{chosen.named} is not a classifier (it generates text; use `cpudist "
                        f"generate`). {NOT_A_CLASSIFIER}")
    settings = chosen.settings
    config = Config(model=chosen.model, data=DataConfig(
        path=str(data), format="classification", max_length=settings["data.max_length"]))
    with start_process(DistConfig()) as process:
        session = open_session(config, process, chosen.adapter)
        rows = predict_rows(session, chosen.adapter or session.model_dir,
                            settings["train.batch_size"])
    if out is not None:
        write_predictions(rows, Path(out))
    return rows
