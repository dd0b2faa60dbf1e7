"""A trained classifier on a file: `cpudist eval --data` (the validation figures a run logs, with
the same objective and scoring code) and `cpudist predict` (labels and scores of unlabelled
rows)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from cpudist.data.formats import LabelledText
from cpudist.data.labelled import class_ids, load_labelled, pad_texts, tokenize_text, where_of
from cpudist.errors import UserError
from cpudist.infer.session import Session
from cpudist.objectives.classification import (
    DEFAULT_THRESHOLD,
    Classification,
    LabelledData,
    pads_left,
)
from cpudist.objectives.evaluation import evaluate
from cpudist.records import CLASSIFICATION_FILE, ClassificationReport


def _data_path(session: Session) -> Path:
    from cpudist.data.read import resolve_data_paths

    data_config = session.config.data
    try:
        return resolve_data_paths(data_config.path, data_config.cache_dir)[0]
    except UserError as exc:
        raise UserError(str(exc).replace("(data.path)", "(--data)")) from exc


def evaluate_labelled(session: Session, limit: int | None = None) -> ClassificationReport:
    """The classifier's validation figures (loss, accuracy and macro-F1, or micro/macro-F1 and
    exact match), confusion matrix or per-label thresholds, on the labelled rows of data.path."""
    head = session.head
    path = _data_path(session)
    split, _ = load_labelled(path, session.tokenizer, session.config.data)
    if split.multi_label and not head.multi_label:
        raise UserError(f"--data {path}: rows with 'labels' (multi-label) for a single-label "
                        "classifier; give each row one 'label'")
    objective = Classification(session.config)
    objective.set_labels(head.labels, head.multi_label)
    data = LabelledData(split, class_ids(split, head.labels))
    loss = objective.loss_module(session.model)
    figures = evaluate(objective, loss, data, session.config.train.batch_size, session.pad_id,
                       session.precision, session.process.placement, limit)
    assert figures and objective.report is not None
    report = objective.report
    report.data = str(path)
    return report


def _unlabelled(path: Path, tokenizer: Any, max_length: int
                ) -> Iterator[tuple[dict[str, Any], list[int]]]:
    """Each row of a file (its own fields kept) with its token ids; a row without 'text' is an
    error naming its line."""
    from cpudist.data.read import read_records

    for number, row in enumerate(read_records(path), start=1):
        if not isinstance(row, dict) or "text" not in row:
            raise UserError(f"{where_of(str(path), number)}: cpudist predict needs a 'text' field "
                            f"(and optionally 'text_pair') in each row")
        record = LabelledText(str(row["text"]), None if row.get("text_pair") is None
                              else str(row["text_pair"]), (), False)
        yield row, tokenize_text(tokenizer, record.text, record.text_pair, max_length)[0]


def predict_rows(session: Session, classifier_dir: Path, batch_size: int
                 ) -> list[dict[str, Any]]:
    """Each row of data.path with the predicted label ("label"; "labels" for a multi-label
    classifier, those at or above their label's threshold in classifier_dir's
    classification.json) and every label's probability ("scores")."""
    head = session.head
    thresholds = [DEFAULT_THRESHOLD] * len(head.labels)
    saved = classifier_dir / CLASSIFICATION_FILE
    if head.multi_label and saved.is_file():
        thresholds = ClassificationReport.read(saved).thresholds or thresholds
    rows = list(_unlabelled(_data_path(session), session.tokenizer, session.config.data.max_length))
    left = pads_left(session.model)
    if left:
        # Virtual tokens in front of left padding sit further from the text the more padding a
        # row gets: rows of one length per batch need none, so each scores as it would alone.
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][1]))
        batches = [[order[i] for i in group] for group in _same_length_runs(
            [len(rows[i][1]) for i in order], batch_size)]
    else:
        batches = [list(range(s, min(s + batch_size, len(rows))))
                   for s in range(0, len(rows), batch_size)]
    found: dict[int, dict[str, Any]] = {}
    for indices in batches:
        chunk = [rows[i] for i in indices]
        ids, mask = pad_texts([ids for _, ids in chunk], session.pad_id, left)
        with torch.no_grad(), session.precision.autocast():
            logits = session.model(input_ids=ids, attention_mask=mask).logits.float()
        scores = logits.sigmoid() if head.multi_label else logits.softmax(dim=-1)
        for index, (row, _), row_scores in zip(indices, chunk, scores.tolist(), strict=True):
            named = dict(zip(head.labels, row_scores, strict=True))
            if head.multi_label:
                chosen = [n for n, s, t in zip(head.labels, row_scores, thresholds, strict=True)
                          if s >= t]
                found[index] = {**_given(row), "labels": chosen, "scores": named}
            else:
                found[index] = {**_given(row), "label": max(named, key=named.__getitem__),
                                "scores": named}
    return [found[i] for i in range(len(rows))]


def _same_length_runs(lengths: list[int], size: int) -> list[list[int]]:
    """Positions of sorted lengths cut into batches of at most `size` equal lengths."""
    runs: list[list[int]] = []
    for position, length in enumerate(lengths):
        if runs and len(runs[-1]) < size and lengths[runs[-1][0]] == length:
            runs[-1].append(position)
        else:
            runs.append([position])
    return runs


def _given(row: dict[str, Any]) -> dict[str, Any]:
    """A row's own fields, its labels (if it had any) renamed so that the prediction's stand
    beside them."""
    return {f"given_{key}" if key in ("label", "labels") else key: value
            for key, value in row.items()}


def write_predictions(rows: list[dict[str, Any]], target: Path) -> None:
    from cpudist.files import write_text

    write_text(target, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
