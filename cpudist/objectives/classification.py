"""Text classification: a head on the backbone's pooled hidden state (a causal LM's last real token,
an encoder's first token) trained with the PEFT method beside it. Single-label rows train with
cross-entropy, multi-label rows with binary cross-entropy per label.

Validation sums are counts, added over micro-batches and ranks before anything is divided:
a confusion matrix (single-label), or per label and decision threshold the true positives,
false positives and false negatives (multi-label), from which accuracy, F1 and each label's best
threshold follow.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cpudist.config import Config
from cpudist.data.labelled import ClassBatch, LabelledSplit, class_batch, class_ids, label_vocabulary
from cpudist.data.tokenize import build_datasets
from cpudist.errors import UserError
from cpudist.model.adapters import SEQ_CLS
from cpudist.model.load import Head
from cpudist.model.loss import LossOutput
from cpudist.objectives.base import Datasets, Objective
from cpudist.records import CLASSIFICATION_FILE, ClassificationReport

# Decision thresholds on a label's probability that multi-label validation counts at; each
# label's best (highest F1) is reported and saved for `cpudist predict`.
THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
DEFAULT_THRESHOLD = 0.5
# Prompt tuning and P-tuning prepend virtual tokens as embeddings, so a decoder's classifier
# cannot find its last real token from the ids: it scores the last position, which left padding
# makes the last real token of every row.
_EMBEDDING_PROMPTS = ("prompt_tuning", "p_tuning")


def is_encoder(model_config: Any) -> bool:
    """Whether a backbone pools its first token (BERT-like encoders), not its last real one."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return getattr(model_config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def pads_left(model: nn.Module) -> bool:
    """Whether the classifier's rows are padded on the left: a decoder whose PEFT method puts
    virtual tokens in front of the embeddings (see _EMBEDDING_PROMPTS)."""
    peft_type = getattr(getattr(model, "active_peft_config", None), "peft_type", "")
    method = str(getattr(peft_type, "value", peft_type)).lower()
    return method in _EMBEDDING_PROMPTS and not is_encoder(model.config)


@dataclass
class LabelledData:
    """A split with its rows' class ids, as batches read them."""

    split: LabelledSplit
    targets: list[list[int]]

    def __len__(self) -> int:
        return len(self.split)

    def lengths(self) -> list[int]:
        return self.split.lengths()


class ClassificationLoss(nn.Module):
    """Wraps a PEFT sequence classifier: forward returns the loss summed over rows and the
    validation counts (cpudist.model.loss.LossOutput)."""

    def __init__(self, model: nn.Module, classes: int, multi_label: bool,
                 class_weights: torch.Tensor | None) -> None:
        super().__init__()
        self.model = model
        self.classes = classes
        self.multi_label = multi_label
        self.class_weights = class_weights

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                targets: torch.Tensor) -> LossOutput:
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        rows = torch.tensor(float(logits.shape[0]))
        if self.multi_label:
            # The mean over labels per row, summed over rows: a step's loss is the mean per row.
            per_label = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
            total = per_label.mean(dim=-1).sum()
            return LossOutput(total, rows, multi_label_counts(logits.detach().sigmoid(), targets))
        total = F.cross_entropy(logits, targets, weight=self.class_weights, reduction="sum")
        return LossOutput(total, rows, confusion_counts(logits.detach(), targets, self.classes))


def confusion_counts(logits: torch.Tensor, targets: torch.Tensor, classes: int
                     ) -> dict[str, torch.Tensor]:
    """"confusion/i/j": rows of true class i predicted as j."""
    cells = torch.bincount(targets * classes + logits.argmax(dim=-1), minlength=classes * classes)
    return {f"confusion/{i}/{j}": cells[i * classes + j]
            for i in range(classes) for j in range(classes)}


def multi_label_counts(probabilities: torch.Tensor, targets: torch.Tensor
                       ) -> dict[str, torch.Tensor]:
    """Per label k and threshold t: "tp/k/t", "fp/k/t", "fn/k/t"; and "exact": rows whose every
    label is right at the default threshold."""
    counts: dict[str, torch.Tensor] = {}
    truth = targets > 0.5
    for t in THRESHOLDS:
        predicted = probabilities >= t
        for name, cells in (("tp", predicted & truth), ("fp", predicted & ~truth),
                            ("fn", ~predicted & truth)):
            for k, value in enumerate(cells.sum(dim=0)):
                counts[f"{name}/{k}/{t}"] = value
    exact = ((probabilities >= DEFAULT_THRESHOLD) == truth).all(dim=-1).sum()
    return {"exact": exact, **counts}


def count_names(classes: int, multi_label: bool) -> tuple[str, ...]:
    """The names of the counts ClassificationLoss reports, in its order."""
    if not multi_label:
        return tuple(f"confusion/{i}/{j}" for i in range(classes) for j in range(classes))
    return ("exact", *(f"{name}/{k}/{t}" for t in THRESHOLDS for name in ("tp", "fp", "fn")
                       for k in range(classes)))


def _f1(tp: float, fp: float, fn: float) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def report_of(sums: dict[str, float], labels: tuple[str, ...], multi_label: bool
              ) -> ClassificationReport:
    """Validation figures from summed counts: loss; accuracy and macro-F1 (single-label);
    micro- and macro-F1 and exact match at the default threshold, and each label's best
    threshold with the macro-F1 they give (multi-label)."""
    rows = sums["units"]
    figures = {"val_loss": sums["loss"] / rows}
    k = len(labels)
    if not multi_label:
        matrix = [[int(sums[f"confusion/{i}/{j}"]) for j in range(k)] for i in range(k)]
        per_label = {}
        for i, name in enumerate(labels):
            tp = matrix[i][i]
            fp = sum(matrix[j][i] for j in range(k)) - tp
            fn = sum(matrix[i]) - tp
            per_label[name] = {"f1": _f1(tp, fp, fn), "support": sum(matrix[i])}
        figures["val_accuracy"] = sum(matrix[i][i] for i in range(k)) / rows
        figures["val_macro_f1"] = sum(p["f1"] for p in per_label.values()) / k
        # The accuracy of always answering the largest label: what accuracy is measured against.
        figures["val_majority_rate"] = max(sum(row) for row in matrix) / rows
        return ClassificationReport(list(labels), False, figures, confusion=matrix,
                                    per_label=per_label, rows=int(rows))

    def f1_at(label: int, t: float) -> float:
        return _f1(sums[f"tp/{label}/{t}"], sums[f"fp/{label}/{t}"], sums[f"fn/{label}/{t}"])

    tp, fp, fn = (sum(sums[f"{n}/{i}/{DEFAULT_THRESHOLD}"] for i in range(k))
                  for n in ("tp", "fp", "fn"))
    figures["val_micro_f1"] = _f1(tp, fp, fn)
    figures["val_macro_f1"] = sum(f1_at(i, DEFAULT_THRESHOLD) for i in range(k)) / k
    figures["val_exact_match"] = sums["exact"] / rows
    # max keeps the first of equal F1s: the lowest threshold, unless a higher one does better.
    best = [max(THRESHOLDS, key=lambda t, i=i: f1_at(i, t)) for i in range(k)]
    figures["val_macro_f1_tuned"] = sum(f1_at(i, t) for i, t in enumerate(best)) / k
    per_label = {name: {"f1": f1_at(i, DEFAULT_THRESHOLD), "threshold": best[i],
                        "f1_at_threshold": f1_at(i, best[i]),
                        "support": sums[f"tp/{i}/{DEFAULT_THRESHOLD}"]
                        + sums[f"fn/{i}/{DEFAULT_THRESHOLD}"]}
                 for i, name in enumerate(labels)}
    return ClassificationReport(list(labels), True, figures, thresholds=best, per_label=per_label,
                                rows=int(rows))


class Classification(Objective):
    name: ClassVar[str] = "classification"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.labels: tuple[str, ...] = ()
        self.multi_label = False
        self.metric_names: tuple[str, ...] = ()  # type: ignore[misc]  # sized by the labels
        self.class_weights: torch.Tensor | None = None
        self.left_padding = False
        self.report: ClassificationReport | None = None

    def load_data(self, tokenizer: Any) -> Datasets:
        from cpudist.data.labelled import load_labelled

        config = self.config
        train, val, stats = build_datasets(config.data, tokenizer, config.train.seed, load_labelled)
        # A separate validation file must hold only labels the training file has; a split of one
        # file may hold a rare label in its held-out part alone.
        seen = (train,) if config.data.val_path else (train, val)
        self.set_labels(label_vocabulary(config.classification.labels, *seen),
                        train.multi_label or val.multi_label)
        train_data = LabelledData(train, class_ids(train, self.labels))
        val_data = LabelledData(val, class_ids(val, self.labels))
        self.class_weights = self._class_weights(train_data)
        counts = Counter(i for row in train_data.targets for i in row)
        kind = "multi-label" if self.multi_label else "single-label"
        largest = max(counts.values()) / len(train)
        return Datasets(train_data, val_data, (
            f"{stats['source']} -> {stats['train']} train / {stats['val']} validation rows, "
            f"{kind}, {len(self.labels)} labels (the largest holds {largest:.1%} of training "
            f"rows); {stats['truncated']} of {stats['samples']} truncated to "
            f"{config.data.max_length} tokens"), counts=stats)

    def set_labels(self, labels: tuple[str, ...], multi_label: bool) -> None:
        self.labels, self.multi_label = labels, multi_label
        self.metric_names = count_names(len(labels), multi_label)

    def _class_weights(self, train: LabelledData) -> torch.Tensor | None:
        """scikit-learn's "balanced": rows / (classes * rows of the class); a class with no
        training row gets weight 0 (none of its rows would be scored anyway)."""
        if self.config.classification.class_weights == "none":
            return None
        if self.multi_label:
            raise UserError("classification.class_weights=balanced applies to single-label data; "
                            "this data is multi-label (rows with 'labels'): use none")
        counts = Counter(row[0] for row in train.targets)
        k = len(self.labels)
        return torch.tensor([len(train) / (k * counts[i]) if counts[i] else 0.0 for i in range(k)])

    def model_head(self, tokenizer: Any) -> Head:
        return Head(SEQ_CLS, self.labels, self.multi_label, tokenizer.pad_token_id)

    def loss_module(self, model: nn.Module) -> nn.Module:
        self.left_padding = pads_left(model)
        return ClassificationLoss(model, len(self.labels), self.multi_label, self.class_weights)

    def make_batch(self, data: LabelledData, indices: list[int], pad_id: int) -> ClassBatch:
        return class_batch([data.split.input_ids[i] for i in indices],
                           [data.targets[i] for i in indices], len(self.labels),
                           self.multi_label, pad_id, self.left_padding)

    def weight(self, batch: ClassBatch) -> float:  # type: ignore[override]
        return float(batch.input_ids.shape[0])

    def step_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        if self.multi_label:
            return {"exact_match": sums["exact"] / max(units, 1.0)}
        k = len(self.labels)
        correct = sum(sums[f"confusion/{i}/{i}"] for i in range(k))
        return {"accuracy": correct / max(units, 1.0)}

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        if sums["units"] == 0:
            return {}
        self.report = report_of(sums, self.labels, self.multi_label)
        return self.report.figures

    def describe_eval(self, before: dict[str, float], after: dict[str, float]) -> str:
        names = (("val_accuracy", "accuracy"), ("val_macro_f1", "macro-F1")) if not \
            self.multi_label else (("val_micro_f1", "micro-F1"), ("val_macro_f1", "macro-F1"),
                                   ("val_exact_match", "exact match"))
        shown = [f"loss {before['val_loss']:.4f} -> {after['val_loss']:.4f}"] + [
            f"{label} {before[key]:.4f} -> {after[key]:.4f}" for key, label in names]
        return "validation: " + ", ".join(shown)

    def save_extras(self, directory: Path) -> None:
        """classification.json: the labels, each label's threshold (multi-label) and the last
        validation's figures and confusion matrix, which `cpudist predict` and the report read."""
        report = self.report or ClassificationReport(list(self.labels), self.multi_label, {})
        if self.multi_label and not report.thresholds:
            report.thresholds = [DEFAULT_THRESHOLD] * len(self.labels)
        (directory / CLASSIFICATION_FILE).write_text(json.dumps(report.to_json(), indent=1) + "\n")
