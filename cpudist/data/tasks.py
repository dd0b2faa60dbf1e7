"""Evaluation tasks from local files, for `cpudist eval --task FILE` (scored in cpudist.train.tasks).

Three forms, each read into a `Task` of `TaskItem`s:
  multiple choice, JSONL   {"question" (or "query"): str, "choices": [str, ...],
                            "answer": index of the right choice, or its text}
  question answering, JSONL {"question" (or "query"): str, "answer": str or [accepted, ...]}
  lm-evaluation-harness    a local task YAML, the subset this module names in HARNESS_KEYS:
                            dataset_path: json, dataset_kwargs.data_files, doc_to_text /
                            doc_to_choice / doc_to_target (a field name, a Jinja template or a
                            literal), output_type multiple_choice or generate_until
Every error names the file and line (of the JSONL item, or of the YAML key) and what to do.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cpudist.errors import UserError
from cpudist.jsonl import iter_jsonl

Kind = Literal["multiple_choice", "qa"]
# The lm-evaluation-harness task keys read here; any other key is refused by name.
HARNESS_KEYS = ("task", "dataset_path", "dataset_kwargs", "output_type", "test_split",
                "validation_split", "doc_to_text", "doc_to_choice", "doc_to_target",
                "target_delimiter", "metric_list")
HARNESS_OUTPUT_TYPES = {"multiple_choice": "multiple_choice", "generate_until": "qa"}
HARNESS_METRICS = ("acc", "acc_norm", "exact_match")


@dataclass(frozen=True)
class TaskItem:
    where: str  # FILE:LINE of the item
    question: str  # the prompt text (a harness task's rendered doc_to_text)
    choices: list[str] = field(default_factory=list)  # multiple choice: the options
    gold: int = -1  # multiple choice: index of the right option
    answers: list[str] = field(default_factory=list)  # QA: the accepted answers


@dataclass(frozen=True)
class Task:
    name: str
    kind: Kind
    items: list[TaskItem]
    source: Path
    # lm-evaluation-harness's layout: the prompt is plain text (no chat template) and a choice
    # follows it after target_delimiter. JSONL tasks are rendered as a user turn instead.
    harness: bool = False
    delimiter: str = " "


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _item(row: Any, where: str) -> TaskItem:
    """One JSONL record as a task item, or a UserError naming FILE:LINE and the field."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object with question, choices and answer")
    question = row.get("question", row.get("query"))
    if not _text(question):
        raise UserError(f"{where}: no \"question\" (or \"query\") text in this item")
    answer = row.get("answer")
    if "choices" not in row:
        answers = answer if isinstance(answer, list) else [answer]
        if not answers or not all(_text(a) for a in answers):
            raise UserError(f"{where}: \"answer\" must be a non-empty string or a list of them "
                            "(or give \"choices\" for a multiple-choice item)")
        return TaskItem(where, question, answers=[str(a) for a in answers])
    return TaskItem(where, question, *_choices(row["choices"], answer, where, "choices", "answer"))


def _choices(choices: Any, answer: Any, where: str, choices_key: str,
             answer_key: str) -> tuple[list[str], int]:
    if not isinstance(choices, list) or len(choices) < 2 or not all(_text(c) for c in choices):
        raise UserError(f"{where}: {choices_key!r} must be a list of at least two non-empty "
                        "strings")
    if isinstance(answer, str) and answer.strip().isdigit() and answer not in choices:
        answer = int(answer)
    if isinstance(answer, bool) or not isinstance(answer, (int, str)):
        raise UserError(f"{where}: {answer_key!r} must be the index of the right choice or its "
                        f"text (got {answer!r})")
    if isinstance(answer, int):
        if not 0 <= answer < len(choices):
            raise UserError(f"{where}: {answer_key!r} {answer} is not an index of the "
                            f"{len(choices)} choices (they count from 0)")
        return list(choices), answer
    if answer not in choices:
        raise UserError(f"{where}: {answer_key!r} {answer!r} is not one of the choices")
    return list(choices), choices.index(answer)


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    advice = "fix or remove that line (a task item is one JSON object per line)"
    return [(f"{path}:{line.number}", line.value) for line in iter_jsonl(path, advice)]


def _jsonl_task(path: Path) -> Task:
    items = [_item(row, where) for where, row in _read_jsonl(path)]
    if not items:
        raise UserError(f"{path}: no task items in it; write one JSON object per line")
    kinds = {bool(item.choices) for item in items}
    if len(kinds) > 1:
        first = items[0]
        odd = next(i for i in items if bool(i.choices) != bool(first.choices))
        raise UserError(f"{odd.where}: {'a multiple-choice' if odd.choices else 'a question-answer'}"
                        f" item in a file whose first item ({first.where}) is not; keep one kind "
                        "of item per file")
    kind: Kind = "multiple_choice" if items[0].choices else "qa"
    return Task(path.stem, kind, items, path)


# --------------------------------------------------------------------------- harness YAML


def _key_lines(text: str) -> dict[str, int]:
    """Top-level keys of a YAML mapping -> their 1-based line."""
    import yaml

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    if not isinstance(root, yaml.MappingNode):
        return {}
    return {key.value: key.start_mark.line + 1 for key, _ in root.value}


class _Harness:
    """A harness task YAML: its settings, and doc_to_* applied to one record."""

    def __init__(self, path: Path) -> None:
        from cpudist.config import parse_yaml

        self.path = path
        text = path.read_text(encoding="utf-8")
        config = parse_yaml(text, str(path))
        if not isinstance(config, dict):
            raise UserError(f"{path}: expected an lm-evaluation-harness task (a mapping of keys "
                            "such as task, dataset_path, doc_to_text)")
        self.lines = _key_lines(text)
        self.config = config
        for key in config:
            if key not in HARNESS_KEYS:
                raise UserError(f"{self.at(key)}: key {key!r} is not supported by cpudist eval "
                                f"--task (it reads {', '.join(HARNESS_KEYS)}); remove it, or run "
                                "lm-evaluation-harness itself for this task")
        for key in ("dataset_path", "dataset_kwargs", "doc_to_text", "doc_to_target"):
            if key not in config:
                raise UserError(f"{path}: no {key!r}; a local task needs dataset_path: json, "
                                "dataset_kwargs: {data_files: FILE}, doc_to_text and "
                                "doc_to_target")
        if config["dataset_path"] != "json":
            self.fail("dataset_path", f"{config['dataset_path']!r} is not a local file format "
                      "read here; use dataset_path: json with dataset_kwargs: {data_files: FILE}")
        output_type = config.get("output_type", "multiple_choice")
        if output_type not in HARNESS_OUTPUT_TYPES:
            self.fail("output_type", f"{output_type!r} is not supported (use "
                      f"{' or '.join(HARNESS_OUTPUT_TYPES)})")
        self.kind: Kind = HARNESS_OUTPUT_TYPES[output_type]  # type: ignore[assignment]
        if self.kind == "multiple_choice" and "doc_to_choice" not in config:
            self.fail("output_type", "multiple_choice needs doc_to_choice")
        for metric in config.get("metric_list") or []:
            name = metric.get("metric") if isinstance(metric, dict) else metric
            if name not in HARNESS_METRICS:
                self.fail("metric_list", f"metric {name!r} is not computed here (only "
                          f"{', '.join(HARNESS_METRICS)}); remove it")
        self.delimiter = str(config.get("target_delimiter", " "))
        # Sandboxed: a task file may come from elsewhere. StrictUndefined: a misspelled field is
        # an error, not an empty prompt.
        from jinja2 import StrictUndefined
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.jinja = ImmutableSandboxedEnvironment(undefined=StrictUndefined)

    def at(self, key: str) -> str:
        return f"{self.path}:{self.lines[key]}" if key in self.lines else str(self.path)

    def fail(self, key: str, message: str) -> None:
        raise UserError(f"{self.at(key)}: {key}: {message}")

    def data_file(self) -> Path:
        """The one file of the split evaluated (test_split, else validation_split, else the only
        one), relative to the YAML's directory (else to the working directory)."""
        kwargs = self.config["dataset_kwargs"]
        if not isinstance(kwargs, dict) or set(kwargs) != {"data_files"}:
            self.fail("dataset_kwargs", "only {data_files: FILE} (or {data_files: {SPLIT: FILE}}) "
                      "is read here")
        files = kwargs["data_files"]
        if isinstance(files, dict):
            split = self.config.get("test_split") or self.config.get("validation_split")
            if split is None and len(files) == 1:
                split = next(iter(files))
            if split not in files:
                self.fail("dataset_kwargs", f"data_files has no split {split!r} (it has "
                          f"{', '.join(map(str, files))}); set test_split to one of them")
            files = files[split]
        if isinstance(files, list) and len(files) == 1:
            files = files[0]
        if not isinstance(files, str):
            self.fail("dataset_kwargs", "data_files must name one .jsonl file per split")
        for candidate in (self.path.parent / files, Path(files)):
            if candidate.is_file():
                return candidate
        self.fail("dataset_kwargs", f"data file {files} not found (looked in {self.path.parent} "
                  "and the working directory)")
        raise AssertionError  # fail() raised

    def apply(self, key: str, doc: dict[str, Any], where: str) -> Any:
        """doc_to_X of one record, as the harness reads it: a field name, a Jinja template, or a
        literal (a list of choices, an index)."""
        spec = self.config[key]
        if not isinstance(spec, str):
            return spec
        if spec in doc:
            return doc[spec]
        try:
            return self.jinja.from_string(spec).render(**doc)
        except Exception as exc:  # jinja2's errors (undefined field, syntax) have no common base
            raise UserError(f"{self.at(key)}: {key} fails on {where} ({exc})") from None

    def item(self, doc: Any, where: str) -> TaskItem:
        if not isinstance(doc, dict):
            raise UserError(f"{where}: expected a JSON object (a record of the task's dataset)")
        question = str(self.apply("doc_to_text", doc, where))
        target = self.apply("doc_to_target", doc, where)
        if self.kind == "qa":
            answers = target if isinstance(target, list) else [target]
            return TaskItem(where, question, answers=[str(a) for a in answers])
        choices = self.apply("doc_to_choice", doc, where)
        if isinstance(choices, str):  # a template rendering a list, as the harness allows
            try:
                choices = ast.literal_eval(choices)
            except (ValueError, SyntaxError):
                raise UserError(f"{self.at('doc_to_choice')}: doc_to_choice gives {choices!r} "
                                f"on {where}, not a list") from None
        choices = [str(c) for c in choices] if isinstance(choices, list) else choices
        return TaskItem(where, question,
                        *_choices(choices, target, where, "doc_to_choice", "doc_to_target"))


def _harness_task(path: Path) -> Task:
    harness = _Harness(path)
    data = harness.data_file()
    items = [harness.item(doc, where) for where, doc in _read_jsonl(data)]
    if not items:
        raise UserError(f"{data}: no records in it (named by {path})")
    name = str(harness.config.get("task") or path.stem)
    return Task(name, harness.kind, items, path, harness=True, delimiter=harness.delimiter)


def load_task(path: str | Path) -> Task:
    """The task in a .jsonl file (multiple choice or QA) or an lm-evaluation-harness .yaml."""
    source = Path(path).expanduser()
    if not source.is_file():
        raise UserError(f"--task {path}: file not found; pass a .jsonl task file or an "
                        "lm-evaluation-harness task .yaml")
    if source.suffix in (".yaml", ".yml"):
        return _harness_task(source)
    if source.suffix != ".jsonl":
        raise UserError(f"--task {path}: expected a .jsonl task file or a task .yaml")
    return _jsonl_task(source)
