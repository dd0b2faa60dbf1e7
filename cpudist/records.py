"""Records that cross modules, typed and defined once; JSON is their form on disk.

- StepRecord, EvalRecord, RestartEvent: the lines of OUTPUT/metrics.jsonl (a training step, the
  final evaluation, a restart written by `cpudist launch --restarts`).
- RunSummary: OUTPUT/summary.json, what `cpudist train` returns and report.html shows.
- DataEvalResult, PreferenceEvalResult, TaskEvalResult: `cpudist eval --data` (a preference
  file: PreferenceEvalResult) and `--task` (OUTPUT/eval.json).
- ClassificationReport: a classifier's labels, thresholds and validation figures
  (ADAPTER/classification.json, `cpudist eval --data` on classification rows).
- BaselineEvaluation: the untrained model's validation figures, cached beside the tokenized data.
- ExportedGGUF: the file `cpudist export` wrote.
- BenchResult: the figures of one `cpudist bench` run (or of its HF peer), computed for both by
  cpudist.bench.figures.throughput_figures.

Evaluation figures are named by the objective ("val_loss", "val_ppl", ...) and kept in a dict; on
disk they are flat keys of the record, as they always were. No torch here: the launcher and the
report read these without it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cpudist.errors import UserError


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The keys of data that are fields of dataclass cls."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


# --------------------------------------------------------------------------- metrics.jsonl


@dataclass
class StepRecord:
    """One optimizer step: its loss, schedule and throughput; `evaluation` holds the validation
    figures when the step was followed by one (train.eval_every), `metrics` the objective's own
    per-step figures."""

    step: int
    epoch: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    label_tokens_per_s: float
    step_s: float
    elapsed: float
    metrics: dict[str, float] = field(default_factory=dict)
    evaluation: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        fields = asdict(self)
        return {**{k: v for k, v in fields.items() if k not in ("metrics", "evaluation")},
                **self.metrics, **self.evaluation}

    def value(self, key: str) -> float | None:
        found = self.to_json().get(key)
        return float(found) if isinstance(found, (int, float)) else None


@dataclass
class EvalRecord:
    """The evaluation after the last step (its figures, named by the objective)."""

    step: int
    evaluation: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, **self.evaluation}

    def value(self, key: str) -> float | None:
        return self.evaluation.get(key)


@dataclass
class RestartEvent:
    """`cpudist launch --restarts` ran the job again (written between two jobs)."""

    attempt: int
    reason: str
    resumed_from_step: int | None
    time: str

    def to_json(self) -> dict[str, Any]:
        return {"event": "restart", **asdict(self)}

    def value(self, key: str) -> float | None:
        return None


MetricsLine = StepRecord | EvalRecord | RestartEvent


def metrics_line(data: dict[str, Any]) -> MetricsLine | None:
    """A line of metrics.jsonl as its record; None for a line of no kind cpudist writes."""
    if data.get("event") == "restart":
        return RestartEvent(**{"resumed_from_step": None, "time": "", **_known(RestartEvent, data)})
    if "step" not in data:
        return None
    step_fields = {f.name for f in dataclasses.fields(StepRecord)} - {"metrics", "evaluation"}
    if "loss" in data and step_fields <= set(data):
        rest = {k: v for k, v in data.items() if k not in step_fields}
        evaluation = {k: float(v) for k, v in rest.items() if k.startswith("val_")}
        metrics = {k: float(v) for k, v in rest.items()
                   if k not in evaluation and isinstance(v, (int, float))}
        return StepRecord(**{k: data[k] for k in step_fields}, metrics=metrics,
                          evaluation=evaluation)
    evaluation = {k: float(v) for k, v in data.items()
                  if k != "step" and isinstance(v, (int, float))}
    return EvalRecord(int(data["step"]), evaluation) if evaluation else None


# --------------------------------------------------------------------------- summary.json


@dataclass
class TimeSplit:
    """Where a run's wall time went, from `train` starting in this process to its summary:
    setting up (processes, model, OUTPUT/), the data (reading and tokenizing, or the cache),
    validation (every evaluation), training steps, and the rest (checkpoints, held-out answers,
    the adapter). Goodput is the share of the wall time spent in training steps."""

    setup_s: float = 0.0
    data_s: float = 0.0
    data_cached: bool = False  # the tokenized data came from the cache
    eval_s: float = 0.0
    train_s: float = 0.0
    other_s: float = 0.0
    wall_s: float = 0.0

    @property
    def goodput(self) -> float:
        return self.train_s / self.wall_s if self.wall_s > 0 else 0.0

    def describe(self) -> str:
        return (f"setup {self.setup_s:.0f} s, data {self.data_s:.0f} s "
                f"({'cached' if self.data_cached else 'read and tokenized'}), validation "
                f"{self.eval_s:.0f} s, training {self.train_s:.0f} s, other {self.other_s:.0f} s "
                f"of {self.wall_s:.0f} s: goodput {self.goodput:.0%}")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "goodput": self.goodput}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TimeSplit:
        return cls(**_known(cls, data))


@dataclass
class HeldOutAnswer:
    """A held-out prompt answered before and after training."""

    prompt: str
    reference: str
    before: str
    after: str


@dataclass
class RunSummary:
    """What a finished `cpudist train` run did (OUTPUT/summary.json)."""

    world_size: int
    threads_per_rank: int
    dtype: str
    communication: str
    global_batch: int
    cpu: str
    launcher: str
    steps: int = 0
    train_loss: float | None = None
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    tokens_seen: int = 0
    bad_steps: int = 0
    peak_rss_gb: float = 0.0
    # Validation figures named by the objective (val_loss, val_ppl, ...); on disk as
    # val_loss_before, val_loss_after, ...
    eval_before: dict[str, float] = field(default_factory=dict)
    eval_after: dict[str, float] = field(default_factory=dict)
    samples: list[HeldOutAnswer] = field(default_factory=list)
    time: TimeSplit | None = None  # absent in summaries of older runs
    # Rows each data source gave (data.sources, or each file of data.path)
    sources: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        fields = asdict(self)
        before, after = fields.pop("eval_before"), fields.pop("eval_after")
        fields["time"] = None if self.time is None else self.time.to_json()
        return {**fields, **{f"{k}_before": v for k, v in before.items()},
                **{f"{k}_after": v for k, v in after.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        before = {k.removesuffix("_before"): float(v) for k, v in data.items()
                  if k.endswith("_before") and isinstance(v, (int, float))}
        after = {k.removesuffix("_after"): float(v) for k, v in data.items()
                 if k.endswith("_after") and isinstance(v, (int, float))}
        samples = [HeldOutAnswer(**_known(HeldOutAnswer, s)) for s in data.get("samples") or []]
        time = data.get("time")
        return cls(**{"world_size": 1, "threads_per_rank": 0, "dtype": "", "communication": "",
                      "global_batch": 0, "cpu": "", "launcher": "",
                      **_known(cls, data), "eval_before": before, "eval_after": after,
                      "samples": samples,
                      "time": TimeSplit.from_json(time) if isinstance(time, dict) else None})

    def write(self, path: Path) -> None:
        from cpudist.files import write_text

        write_text(path, json.dumps(self.to_json(), indent=1, ensure_ascii=False))


def read_summary(path: Path) -> RunSummary | None:
    """OUTPUT/summary.json; None when the run has not finished (there is none)."""
    if not path.exists():
        return None
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg}); the run may have been "
                        "cut off while writing it") from None
    if not isinstance(loaded, dict):
        raise UserError(f"{path}: not a summary (a JSON object is expected); remove it and run "
                        "`cpudist report` again")
    return RunSummary.from_json(loaded)


@dataclass
class BaselineEvaluation:
    """The untrained model's validation figures, cached under data.cache_dir/baseline/
    (cpudist.train.baseline): the key they were made for, the figures, the samples evaluated and
    the seconds the evaluation took."""

    key: str
    figures: dict[str, float]
    samples: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, path: Path) -> BaselineEvaluation | None:
        """The record at path; None when there is none, or it is cut short or not one (the
        figures are then computed again)."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            record = cls(**_known(cls, data))
        except (OSError, ValueError, TypeError):
            return None
        if record.key != path.stem or not isinstance(record.figures, dict):
            return None
        return record


# --------------------------------------------------------------------------- cpudist export


@dataclass
class ExportedGGUF:
    """`cpudist export`: the GGUF file written and the base model it was made from."""

    path: str
    file_type: str  # of the 2-D weights: f16, q8_0, ...
    lora: bool  # the adapter alone (llama.cpp applies it on the base's GGUF), else a whole model
    base: str  # the base model directory (a quantized run's: the model it was quantized from)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        if self.lora:
            return (f"LoRA GGUF written to {self.path} (apply it on the GGUF of its base: "
                    f"cpudist export --base {self.base} --out BASE.gguf)")
        return f"GGUF model ({self.file_type}) written to {self.path}"


# --------------------------------------------------------------------------- cpudist eval


@dataclass
class DataEvalResult:
    """`cpudist eval --data FILE`: the trainer's validation figures on a file, and token accuracy."""

    loss: float
    perplexity: float
    token_accuracy: float
    label_tokens: int
    samples: int
    truncated: int
    dropped: int
    dtype: str
    data: str
    adapter: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        capped = " (capped)" if self.perplexity >= math.exp(50) else ""
        return (f"loss {self.loss:.4f}  perplexity {self.perplexity:.2f}{capped}  token accuracy "
                f"{100 * self.token_accuracy:.2f}%  ({self.label_tokens} label tokens, "
                f"{self.samples} samples; {self.dtype})")


@dataclass
class PreferenceEvalResult:
    """`cpudist eval --data PAIRS` (data.format=preference): how often the base and the adapter
    give the chosen answer the higher log-probability, and the adapter's DPO figures against the
    base as reference (None without an adapter)."""

    base_accuracy: float
    adapter_accuracy: float | None
    reward_accuracy: float | None
    reward_margin: float | None
    loss: float | None
    beta: float
    pairs: int
    truncated: int
    dropped: int
    dtype: str
    data: str
    adapter: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        text = f"prefers the chosen answer: base {100 * self.base_accuracy:.1f}%"
        if self.adapter_accuracy is not None:
            text += f" -> adapter {100 * self.adapter_accuracy:.1f}%"
        if self.reward_accuracy is not None and self.reward_margin is not None:
            text += (f"; DPO reward accuracy {100 * self.reward_accuracy:.1f}% (reference: the "
                     f"base), reward margin {self.reward_margin:.4f}, loss {self.loss:.4f} at "
                     f"beta {self.beta:g}")
        return text + f"  ({self.pairs} pairs; {self.dtype})"


@dataclass
class TaskEvalResult:
    """`cpudist eval --task FILE`: a task's metrics for the base alone (before) and with the
    adapter (after); one entry of OUTPUT/eval.json."""

    task: str
    file: str
    kind: str
    items: int
    prompt: str
    base: str
    adapter: str | None
    dtype: str
    before: dict[str, float]
    after: dict[str, float] | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskEvalResult:
        defaults = {"task": "", "file": "", "kind": "", "items": 0, "prompt": "", "base": "",
                    "adapter": None, "dtype": "", "before": {}, "after": None}
        return cls(**{**defaults, **_known(cls, data)})

    def lines(self) -> list[str]:
        lines = []
        for metric, before in self.before.items():
            after = (self.after or {}).get(metric)
            line = f"{self.task} {metric}: base {100 * before:.1f}%"
            if after is not None:
                line += f" -> adapter {100 * after:.1f}%"
            lines.append(f"{line}  ({self.items} items)")
        return lines


# --------------------------------------------------------------------------- classification

CLASSIFICATION_FILE = "classification.json"  # beside a classifier's adapter


@dataclass
class ClassificationReport:
    """A classifier's labels and what a validation (or `cpudist eval --data`) found: the figures,
    the confusion matrix (single-label), each label's F1 and, multi-label, its chosen decision
    threshold. ADAPTER/classification.json, which `cpudist predict` and report.html read."""

    labels: list[str]
    multi_label: bool
    figures: dict[str, float]
    confusion: list[list[int]] | None = None  # [true label][predicted label]
    thresholds: list[float] = field(default_factory=list)
    per_label: dict[str, dict[str, float]] = field(default_factory=dict)
    rows: int = 0
    data: str | None = None  # `cpudist eval --data`: the file
    adapter: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClassificationReport:
        return cls(**{"labels": [], "multi_label": False, "figures": {}, **_known(cls, data)})

    @classmethod
    def read(cls, path: Path) -> ClassificationReport:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"{path}: not a readable classification record ({exc}); it is "
                            "written beside the adapter by cpudist train") from exc

    def line(self) -> str:
        shown = ", ".join(f"{name.removeprefix('val_').replace('_', ' ')} {value:.4f}"
                          for name, value in self.figures.items())
        kind = "multi-label" if self.multi_label else "single-label"
        return f"{shown}  ({self.rows} rows, {len(self.labels)} labels, {kind})"


# --------------------------------------------------------------------------- cpudist bench


@dataclass
class BenchResult:
    """The figures of one bench run (cpudist's, or its peer's: `framework` says which). The
    throughput and MFU figures are computed for both sides by one function
    (cpudist.bench.figures.throughput_figures); the communication figures exist for cpudist's."""

    # Throughput, over the timed steps.
    tokens_per_s: float
    label_tokens_per_s: float
    samples_per_s: float
    s_per_step: float
    s_per_step_median: float  # robust to other processes stealing the cores for a while
    label_tokens_per_s_best_step: float
    step_s: list[float]
    padding_fraction: float
    # Model FLOPs per second against the GEMM peak measured in the same run (best probe).
    mfu: float
    mfu_valid: bool  # achieved above the best probe: the probes missed the peak
    model_tflops: float
    peak_tflops: float
    peak_samples_tflops: list[float]
    # Memory: peak RSS of each rank, and the node's PSS (shared pages counted once).
    peak_rss_gb: list[float]
    node_pss_gb: float
    # What ran.
    framework: str
    dtype: str
    threads: int
    world_size: int
    steps: int
    warmup_steps: int
    data: str
    model_dir: str
    allocator: str
    flop_model: dict[str, int]
    config: dict[str, Any]  # the resolved config, as config.yaml holds it
    load_s: float = 0.0  # setup (model, data, optimizer) before the first step
    prepare_s: float = 0.0  # the objective's pass before training (DPO's precomputed reference)
    prepared: str = ""  # what that pass did (Objective.prepare), "" for none; not in the figures
    peak_rss_after_load_gb: float | None = None
    losses: list[float] = field(default_factory=list)
    # The gradient allreduce (cpudist.runtime.comm.CommMeter), per timed step.
    comm_mb_per_step: float = 0.0
    comm_last_bucket_mb: float = 0.0  # of which the last bucket (the input embedding's gradient)
    comm_exposed_s_per_step: float = 0.0
    comm_bus_gbps: float = 0.0
    compute_s_per_rank: list[float] = field(default_factory=list)
    compute_spread: float = 0.0
    wait_for_slowest_s: list[float] = field(default_factory=list)
    gradient_mb: float = 0.0
    compiled: bool = False
    preset: str | None = None
    layers: int | None = None
    profile: dict[str, Any] | None = None  # `bench --profile`: cpudist.bench.profile's figures
    host: str | None = None
    quantization: str | None = None  # the peer's own quantization config, when it has one
    link_tx_bytes: int | None = None  # on fake nodes: bytes the nodes' interfaces sent
    mkl: str | None = None  # MKL's kernel choice (cpudist.runtime.mkl_shim.describe)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchResult:
        return cls(**_known(cls, data))

    def figure(self, key: str) -> float:
        """A figure as one number (the largest rank's for per-rank lists)."""
        value = getattr(self, key)
        return max(value) if isinstance(value, list) else float(value)
