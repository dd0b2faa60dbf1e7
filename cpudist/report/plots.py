"""Pictures and a self-contained HTML report of a finished run, and the scaling report.

Everything is made afterwards from the files rank 0 wrote (metrics.jsonl, summary.json,
config.yaml; eval.json when `cpudist eval --task` wrote one), so `cpudist report OUTPUT_DIR` can
redo it for any run, finished or stopped.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cpudist.errors import UserError
from cpudist.files import write_text
from cpudist.jsonl import read_jsonl
from cpudist.records import (
    CLASSIFICATION_FILE,
    ClassificationReport,
    MetricsLine,
    RestartEvent,
    RunSummary,
    StepRecord,
    TaskEvalResult,
    metrics_line,
    read_summary,
)
from cpudist.report.metrics import EVAL_FILE, read_eval

PLOTS = ("loss.png", "lr.png", "throughput.png")
_SMOOTH = 10  # steps in the running mean of the train loss


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def read_run(out_dir: Path) -> tuple[list[MetricsLine], RunSummary | None, str]:
    """(metrics lines, summary when the run finished, config YAML text) of a run directory."""
    metrics_path = out_dir / "metrics.jsonl"
    if not out_dir.is_dir():
        raise UserError(f"{out_dir}: no such run directory; pass the output.dir of a cpudist train run")
    if not metrics_path.exists():
        raise UserError(f"{metrics_path} not found; {out_dir} is not the output.dir of a cpudist "
                        "train run (or the run stopped before its first step)")
    # metrics.jsonl is machine-written: a broken line is best removed, a non-object ignored.
    lines = read_jsonl(metrics_path, skip_non_objects=True, advice="remove that line")
    records = [record for record in map(metrics_line, lines) if record is not None]
    config_path = out_dir / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8") if config_path.exists() else ""
    return records, read_summary(out_dir / "summary.json"), config_text


def _series(records: list[MetricsLine], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the step and evaluation records that carry a finite value for key."""
    steps, values = [], []
    for record in records:
        value = record.value(key)
        if value is not None and math.isfinite(value) and not isinstance(record, RestartEvent):
            steps.append(float(record.step))
            values.append(value)
    return steps, values


def restarts(records: list[MetricsLine]) -> list[RestartEvent]:
    """The launcher's restart records (cpudist launch --restarts), in order."""
    return [r for r in records if isinstance(r, RestartEvent)]


def _line_plot(path: Path, title: str, ylabel: str,
               lines: list[tuple[str, list[float], list[float]]], log_y: bool = False,
               marks: Sequence[float] = ()) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    drawn = False
    for i, step in enumerate(marks):
        # Where a restarted job went on: the steps after it were taken (again) by that job.
        ax.axvline(step, color="tab:red", linestyle="--", linewidth=1,
                   label="restart" if i == 0 else None)
    for label, xs, ys in lines:
        if xs:
            # Markers keep a single point (one-step runs) visible.
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=4, label=label)
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log_y and drawn and all(y > 0 for _, _, ys in lines for y in ys):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if drawn and (len(lines) > 1 or marks):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_plots(records: list[MetricsLine], summary: RunSummary | None, out_dir: Path
                ) -> list[Path]:
    """loss.png, lr.png, throughput.png in out_dir; for preference pairs also rewards.png and
    reward_accuracy.png."""
    train_steps, train_loss = _series(records, "loss")
    val_steps, val_loss = _series(records, "val_loss")
    before = summary.eval_before.get("val_loss") if summary else None
    if before is not None and 0.0 not in val_steps:
        val_steps, val_loss = [0.0, *val_steps], [before, *val_loss]
    lr_steps, lr = _series(records, "lr")
    tps_steps, tps = _series(records, "tokens_per_s")
    loss_lines = [("train", train_steps, train_loss)]
    if len(train_loss) >= 2 * _SMOOTH:
        # Per-step loss of small batches is noisy; a running mean shows the trend.
        means = [sum(train_loss[max(0, i - _SMOOTH + 1) : i + 1]) / (i + 1 - max(0, i - _SMOOTH + 1))
                 for i in range(len(train_loss))]
        loss_lines.append((f"train (mean of last {_SMOOTH})", train_steps, means))
    loss_lines.append(("validation", val_steps, val_loss))
    marks = [float(r.resumed_from_step or 0) for r in restarts(records)]
    pairs = bool(_series(records, "reward_margin")[0])
    return [
        _line_plot(out_dir / "loss.png", "loss", "loss per pair" if pairs else
                   "cross-entropy per label token", loss_lines, marks=marks),
        _line_plot(out_dir / "lr.png", "learning rate", "lr", [("lr", lr_steps, lr)]),
        _line_plot(out_dir / "throughput.png", "throughput (all ranks)", "tokens/s",
                   [("tokens/s", tps_steps, tps)]),
        *(_reward_plots(records, summary, out_dir, marks) if pairs else []),
    ]


def _reward_plots(records: list[MetricsLine], summary: RunSummary | None, out_dir: Path,
                  marks: list[float]) -> list[Path]:
    """rewards.png and reward_accuracy.png of a preference run (DPO, ORPO): per step, and the
    validation figures (before training at step 0)."""
    def validation(key: str) -> tuple[list[float], list[float]]:
        steps, values = _series(records, f"val_{key}")
        before = summary.eval_before.get(f"val_{key}") if summary else None
        if before is not None and 0.0 not in steps:
            steps, values = [0.0, *steps], [before, *values]
        return steps, values

    rewards = [(name.replace("_", " "), *_series(records, name))
               for name in ("reward_chosen", "reward_rejected", "reward_margin")]
    accuracy = [("train", *_series(records, "reward_accuracy")),
                ("validation", *validation("reward_accuracy"))]
    return [
        _line_plot(out_dir / "rewards.png", "rewards (beta x log-ratio to the reference)",
                   "reward", [*rewards, ("validation margin", *validation("reward_margin"))],
                   marks=marks),
        _line_plot(out_dir / "reward_accuracy.png", "reward accuracy (chosen rewarded above "
                   "rejected; ties count half)", "share of pairs", accuracy, marks=marks),
    ]


# --------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:980px;
color:#222;line-height:1.4;padding:0 1em}
h1{font-size:1.6em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:.3em .6em;text-align:left;
vertical-align:top}th{background:#f5f5f5}pre{background:#f7f7f7;padding:.8em;overflow:auto;font-size:.85em}
img{max-width:100%;border:1px solid #eee;margin:.4em 0}td{white-space:pre-wrap}
"""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _table(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
                    for k, v in rows if v is not None)
    return f"<table>{cells}</table>"


def _embedded_image(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(alt)}" '
            f'title="{html.escape(path.name)}"><figcaption>{html.escape(path.name)}</figcaption></figure>')


def _task_table(tasks: dict[str, TaskEvalResult]) -> str:
    """eval.json's tasks as one table: a row per task and metric, base (before) and adapter
    (after) side by side."""
    head = ("<tr><th>task</th><th>items</th><th>metric</th><th>base (before)</th>"
            "<th>adapter (after)</th></tr>")
    rows = []
    for name, result in tasks.items():
        after = result.after or {}
        for metric, value in result.before.items():
            cells = [name, result.items, metric, f"{100 * value:.1f}%",
                     f"{100 * after[metric]:.1f}%" if metric in after else "-"]
            rows.append("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in cells)
                        + "</tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _classification_tables(report: ClassificationReport) -> list[str]:
    """A classifier's last validation: each label's F1 (and threshold), and the confusion matrix
    (rows: true label, columns: predicted)."""
    names = report.labels
    per_label = "".join(
        f"<tr><td>{html.escape(name)}</td>"
        + "".join(f"<td>{html.escape(_fmt(report.per_label.get(name, {}).get(key)))}</td>"
                  for key in ("support", "f1", "threshold", "f1_at_threshold")
                  if report.multi_label or key in ("support", "f1"))
        + "</tr>" for name in names)
    columns = ["label", "rows", "F1"] + (["threshold", "F1 at threshold"] if report.multi_label
                                         else [])
    parts = ["<h2>Classification (validation after training)</h2>",
             _table([(name.removeprefix("val_").replace("_", " "), value)
                     for name, value in report.figures.items()]),
             "<table><tr>" + "".join(f"<th>{c}</th>" for c in columns) + f"</tr>{per_label}</table>"]
    if report.confusion:
        diagonal = ' style="background:#e6f4e6"'  # the rows predicted right
        head = "<tr><th>true / predicted</th>" + "".join(
            f"<th>{html.escape(n)}</th>" for n in names) + "</tr>"
        body = "".join(
            f"<tr><th>{html.escape(name)}</th>" + "".join(
                f"<td{diagonal if i == j else ''}>{count}</td>" for j, count in enumerate(row))
            + "</tr>"
            for i, (name, row) in enumerate(zip(names, report.confusion, strict=True)))
        parts += ["<h3>Confusion matrix</h3>", f"<table>{head}{body}</table>"]
    return parts


def _summary_tables(summary: RunSummary | None, records: list[MetricsLine]) -> list[str]:
    """The final figures and the environment of a run, as HTML tables."""
    steps = [r.step for r in records if isinstance(r, StepRecord)]
    if summary is None:
        return ["<p><strong>No summary.json: the run did not finish (stopped or still running); "
                "the plots show the steps logged so far.</strong></p>",
                "<h2>Final figures</h2>",
                _table([("steps", steps[-1] if steps else None),
                        ("restarts (cpudist launch --restarts)", len(restarts(records)) or None)])]
    before, after = summary.eval_before, summary.eval_after
    figures = [
        ("steps", summary.steps), ("final train loss", summary.train_loss),
        *((f"validation {name.removeprefix('val_')} before", value)
          for name, value in before.items()),
        *((f"validation {name.removeprefix('val_')} after", value) for name, value in after.items()),
        ("tokens/s (whole run)", summary.tokens_per_s), ("tokens seen", summary.tokens_seen),
        ("wall time (s)", summary.wall_s), ("peak RSS rank 0 (GB)", summary.peak_rss_gb),
        ("skipped non-finite steps", summary.bad_steps),
        ("restarts (cpudist launch --restarts)", len(restarts(records)) or None),
    ]
    environment = [
        ("CPU", summary.cpu), ("compute dtype", summary.dtype), ("ranks", summary.world_size),
        ("threads per rank", summary.threads_per_rank), ("communication", summary.communication),
        ("launcher", summary.launcher), ("global batch (samples)", summary.global_batch),
    ]
    parts = ["<h2>Final figures</h2>", _table(figures)]
    if summary.time is not None:
        t = summary.time
        parts += ["<h2>Where the time went</h2>", _table([
            ("setup (s)", t.setup_s),
            (f"data (s, {'cached' if t.data_cached else 'read and tokenized'})", t.data_s),
            ("validation (s)", t.eval_s), ("training steps (s)", t.train_s),
            ("other: checkpoints, held-out answers, adapter (s)", t.other_s),
            ("wall (s)", t.wall_s), ("goodput (training / wall)", f"{t.goodput:.1%}")])]
    if summary.sources:
        parts += ["<h2>Rows per data source</h2>", _table(list(summary.sources.items()))]
    return [*parts, "<h2>Environment</h2>", _table(environment)]


def render_html(records: list[MetricsLine], summary: RunSummary | None, config_text: str,
                images: list[Path], title: str, tasks: dict[str, TaskEvalResult] | None = None,
                classification: ClassificationReport | None = None) -> str:
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>", *_summary_tables(summary, records),
        "<h2>Plots</h2>", *(_embedded_image(p, p.stem) for p in images),
    ]
    if classification is not None:
        parts += _classification_tables(classification)
    if tasks:
        parts += ["<h2>Task evaluation (cpudist eval --task)</h2>", _task_table(tasks)]
    if restarts(records):
        parts += ["<h2>Restarts</h2>", _table([
            (f"restart {r.attempt} at {r.time}",
             f"{r.reason}; resumed from step {r.resumed_from_step}") for r in restarts(records)])]
    if summary is not None and summary.samples:
        parts.append("<h2>Held-out answers before and after training</h2>")
        for sample in summary.samples:
            parts.append(_table([("prompt", sample.prompt), ("reference", sample.reference),
                                 ("before", sample.before), ("after", sample.after)]))
    parts += ["<h2>Config</h2>", f"<pre>{html.escape(config_text or '(no config.yaml)')}</pre>",
              "</body></html>"]
    return "\n".join(parts)


def write_report(out_dir: Path) -> Path:
    """Plots and OUTPUT/report.html for a run directory; returns the HTML path."""
    out_dir = Path(out_dir)
    records, summary, config_text = read_run(out_dir)
    images = write_plots(records, summary, out_dir)
    target = out_dir / "report.html"
    tasks = read_eval(out_dir / EVAL_FILE)
    saved = out_dir / "adapter" / CLASSIFICATION_FILE
    classification = ClassificationReport.read(saved) if saved.is_file() else None
    write_text(target, render_html(records, summary, config_text, images,
                                   f"cpudist run: {out_dir.name}", tasks, classification))
    return target


# --------------------------------------------------------------------------- scaling


def scaling_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows sorted by world size with speedup and efficiency against the smallest rank count."""
    if not rows:
        raise UserError("scaling report: no measurements to report")
    for row in rows:
        if "world_size" not in row or "tokens_per_s" not in row:
            raise UserError(f"scaling report: each row needs world_size and tokens_per_s; got "
                            f"{sorted(row)}")
    ordered = sorted(rows, key=lambda r: int(r["world_size"]))
    base = ordered[0]
    base_n, base_tps = int(base["world_size"]), float(base["tokens_per_s"])
    table = []
    for row in ordered:
        n, tps = int(row["world_size"]), float(row["tokens_per_s"])
        speedup = tps / base_tps if base_tps > 0 else float("nan")
        # Per-rank throughput relative to the smallest run (= tps(n) / (n * tps(1)) when it is 1).
        efficiency = speedup * base_n / n
        table.append({**row, "world_size": n, "tokens_per_s": tps, "speedup": speedup,
                      "efficiency": efficiency})
    return table


def scaling_markdown(table: list[dict[str, Any]]) -> str:
    standard = ["world_size", "tokens_per_s", "speedup", "efficiency"]
    extra = []
    for row in table:
        extra += [k for k, v in row.items() if k not in standard and k not in extra
                  and isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    headers = ["ranks", "tokens/s", "speedup", "efficiency", *extra]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    for row in table:
        cells = [str(row["world_size"]), f"{row['tokens_per_s']:.1f}", f"{row['speedup']:.2f}x",
                 f"{100 * row['efficiency']:.0f}%"]
        cells += [_fmt(row.get(k, "")) for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    base = table[0]["world_size"]
    lines += ["", f"Efficiency = tokens/s(n) / (n / {base} x tokens/s({base})), relative to the "
                  f"smallest rank count measured ({base})."]
    return "\n".join(lines) + "\n"


def write_scaling_report(rows: list[dict[str, Any]], out_dir: Path) -> tuple[Path, Path]:
    """scaling.md (table) and scaling.png (tokens/s and efficiency vs ranks) in out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = scaling_table(rows)
    md_path = out_dir / "scaling.md"
    md_path.write_text("# Scaling\n\n" + scaling_markdown(table), encoding="utf-8")

    plt = _pyplot()
    ranks = [r["world_size"] for r in table]
    tps = [r["tokens_per_s"] for r in table]
    eff = [100 * r["efficiency"] for r in table]
    base_n, base_tps = ranks[0], tps[0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    left.plot(ranks, tps, marker="o", label="measured")
    left.plot(ranks, [base_tps * n / base_n for n in ranks], linestyle="--", color="grey",
              label="linear")
    left.set_xlabel("ranks")
    left.set_ylabel("tokens/s")
    left.set_title("throughput")
    left.legend()
    right.plot(ranks, eff, marker="o")
    right.axhline(100, linestyle="--", color="grey")
    right.set_ylim(0, max(110, max(eff) * 1.1) if all(math.isfinite(e) for e in eff) else 110)
    right.set_xlabel("ranks")
    right.set_ylabel("efficiency (%)")
    right.set_title("scaling efficiency")
    for ax in (left, right):
        ax.set_xticks(ranks)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png_path = out_dir / "scaling.png"
    fig.savefig(png_path)
    plt.close(fig)
    return md_path, png_path


# --------------------------------------------------------------------------- bench vs a peer


def write_vs_plot(series: list[tuple[str, dict[str, float]]], labels: dict[str, str], peer: str,
                  title: str, path: Path) -> Path:
    """Bar chart of cpudist / peer for each figure of a `bench --vs` outcome (above 1 = cpudist
    higher): one series of ratios per comparison ("as each ships", "same malloc"). labels: figure
    key -> its name in the table."""
    plt = _pyplot()
    keys = [k for k in series[0][1] if k != "padding_fraction"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(series)
    for number, (label, ratios) in enumerate(series):
        xs = [i + (number - (len(series) - 1) / 2) * width for i in range(len(keys))]
        bars = ax.bar(xs, [ratios.get(k, 0.0) for k in keys], width, label=label)
        ax.bar_label(bars, fmt="%.2fx", fontsize=7)
    ax.set_xticks(range(len(keys)), [labels[k] for k in keys])
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.axhline(1.0, color="grey", linestyle="--")
    ax.set_ylabel(f"cpudist / {peer}")
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_profile_plot(profile: dict[str, Any], path: Path) -> Path:
    """Horizontal bars: milliseconds of one step per category (`bench --profile`)."""
    plt = _pyplot()
    names = list(profile["categories_ms"])
    values = [profile["categories_ms"][n] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bars = ax.barh(names[::-1], values[::-1])
    wall = profile["wall_ms"]
    ax.bar_label(bars, labels=[f"{v:.0f} ms ({100 * v / wall:.0f} %)" for v in values[::-1]],
                 fontsize=8)
    ax.set_xlabel("ms of one training step")
    ax.set_title(f"where one step's {wall:.0f} ms went")
    ax.set_xlim(0, max(values) * 1.35 if values else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
