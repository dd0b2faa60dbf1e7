"""Classification data: texts (and text pairs) tokenized once and cached, their label names, and
where each row came from; the label vocabulary; padded batches of class targets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cpudist.config import DataConfig
from cpudist.data.formats import classification
from cpudist.data.tokenize import load_columns
from cpudist.errors import UserError


@dataclass
class LabelledSplit:
    """Tokenized texts with their label names (one per row, or several for multi-label rows) and
    each row's origin ("file:line"), for errors and predictions."""

    input_ids: list[list[int]]
    label_names: list[list[str]]
    origins: list[str]
    multi_label: bool

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]

    def subset(self, indices: list[int]) -> LabelledSplit:
        return LabelledSplit([self.input_ids[i] for i in indices],
                             [self.label_names[i] for i in indices],
                             [self.origins[i] for i in indices], self.multi_label)


def where_of(source: str, number: int) -> str:
    """A record's place for messages: file:line for JSON lines, else its record number."""
    return f"{source}:{number}" if source.endswith(".jsonl") else f"{source} (record {number})"


def tokenize_text(tokenizer: Any, text: str, pair: str | None, max_length: int
                  ) -> tuple[list[int], bool]:
    """(token ids with the tokenizer's own special tokens, whether they were cut to max_length);
    a pair is joined as the tokenizer joins pairs ([SEP] for BERT-like ones)."""
    ids = tokenizer(text, pair, add_special_tokens=True)["input_ids"]
    if len(ids) <= max_length:
        return list(ids), False
    # The tokenizer cuts (the longer text first) and keeps its closing special tokens.
    cut = tokenizer(text, pair, add_special_tokens=True, truncation=True, max_length=max_length)
    return list(cut["input_ids"]), True


def _labelled_columns(rows: list[tuple[str, Any]], tokenizer: Any, config: DataConfig
                      ) -> tuple[dict[str, list[Any]], dict[str, int]]:
    input_ids: list[list[int]] = []
    labels: list[list[str]] = []
    origins: list[str] = []
    truncated = multi = 0
    for where, row in rows:
        if not isinstance(row, dict):
            raise UserError(f"{where}: each record must be an object")
        record = classification(row, where)
        ids, cut = tokenize_text(tokenizer, record.text, record.text_pair, config.max_length)
        truncated += cut
        multi += record.multi_label
        input_ids.append(ids)
        labels.append(list(record.labels))
        origins.append(where)
    columns = {"input_ids": input_ids, "labels": labels, "origin": origins}
    return columns, {"samples": len(rows), "truncated": truncated, "multi_label_rows": multi}


def load_labelled(paths: Path | list[Path], tokenizer: Any, config: DataConfig
                  ) -> tuple[LabelledSplit, dict]:
    """Classification files tokenized once per node and cached
    (cpudist.data.tokenize.load_columns). Multi-label when any row gives 'labels' (a list)."""
    table, stats = load_columns(paths, tokenizer, config, "classification", _labelled_columns,
                                lambda counts: "no row")  # every row is kept: never asked
    return LabelledSplit(table["input_ids"].to_pylist(), table["labels"].to_pylist(),
                         table["origin"].to_pylist(), stats["multi_label_rows"] > 0), stats


def label_vocabulary(given: list[str] | None, *splits: LabelledSplit) -> tuple[str, ...]:
    """classification.labels when given (its order is the head's), else every label the splits
    hold, sorted."""
    if given is not None:
        if len(set(given)) != len(given):
            raise UserError(f"classification.labels names a label twice: {given}")
        names = tuple(given)
    else:
        names = tuple(sorted({name for split in splits for row in split.label_names
                              for name in row}))
    if len(names) < 2:
        raise UserError(f"classification needs at least two labels; found {list(names)} (give "
                        "rows of other labels, or list them in classification.labels)")
    return names


def class_ids(split: LabelledSplit, labels: tuple[str, ...]) -> list[list[int]]:
    """Each row's label names as class ids; a name outside `labels` is an error naming its row."""
    index = {name: i for i, name in enumerate(labels)}
    ids: list[list[int]] = []
    for names, where in zip(split.label_names, split.origins, strict=True):
        unknown = [name for name in names if name not in index]
        if unknown:
            raise UserError(f"{where}: label {unknown[0]!r} is not one of the classifier's labels "
                            f"({', '.join(labels)}); fix the row, or add the label to "
                            "classification.labels (and to the training data)")
        ids.append([index[name] for name in names])
    return ids


@dataclass(frozen=True)
class ClassBatch:
    """Padded texts and their targets: class ids (single-label) or 0/1 rows (multi-label)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def label_tokens(self) -> int:  # one scored position per row
        return int(self.input_ids.shape[0])

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "targets": self.targets}


def pad_texts(rows: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of rows padded to the longest, on the right or on the left."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for number, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[number, span] = torch.tensor(row, dtype=torch.long)
        mask[number, span] = 1
    return ids, mask


def class_batch(rows: list[list[int]], targets: list[list[int]], classes: int, multi_label: bool,
                pad_id: int, left: bool) -> ClassBatch:
    ids, mask = pad_texts(rows, pad_id, left)
    if multi_label:
        target = torch.zeros((len(rows), classes), dtype=torch.float32)
        for number, row in enumerate(targets):
            target[number, row] = 1.0
    else:
        target = torch.tensor([row[0] for row in targets], dtype=torch.long)
    return ClassBatch(ids, mask, target)
