"""The output directory of a run (written by rank 0 alone):

  config.yaml         the config as given: what a repeat resolves again on any machine (each
                      checkpoint's config.yaml holds the resolved one: micro-batch, accumulation)
  metrics.jsonl       one line per logged step (cpudist.records)
  adapter/            the final adapter (PEFT, with its base record and model card)
  model/              instead, with peft.method=full: the trained model as a plain Hugging Face
                      directory (config, safetensors, tokenizer)
  checkpoints/        resumable step-N directories (cpudist.train.checkpoint)
  summary.json        final figures (cpudist.records.RunSummary)
  report.html, *.png  plots (cpudist.report.plots)
  eval.json           `cpudist eval --task` results, base and adapter, one entry per task
  tracking.json       the MLflow / W&B runs this run is tracked in (cpudist.report.tracking)
  wandb/              W&B's own files (tracking.wandb_project)
"""

from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpudist.config import Config, TrackingConfig
from cpudist.errors import UserError
from cpudist.files import remove, replacing
from cpudist.records import RestartEvent, RunSummary
from cpudist.report.metrics import append_event
from cpudist.runtime.cluster import Placement

if TYPE_CHECKING:
    from cpudist.objectives import Objective

log = logging.getLogger("cpudist")

# Keys that may differ between a run and its continuation in the same output directory.
RESUMABLE_KEYS = {("train", "resume"), ("output", "overwrite"), ("train", "max_steps"),
                  ("train", "epochs"), ("dist", "threads_per_rank"), ("dist", "master_addr"),
                  ("dist", "master_port"), ("dist", "interface"), ("dist", "timeout_s"),
                  ("train", "check_memory"),
                  # Trackers only watch the run (a changed one starts a new tracked run).
                  *(("tracking", key) for key in TrackingConfig.model_fields)}


def prepare_output(config: Config) -> Path:
    """Create OUTPUT/ (rank 0), refusing to mix a different run's files into it."""
    out = Path(config.output.dir)
    saved = out / "config.yaml"
    if saved.exists() and not config.output.overwrite:
        import yaml

        previous = yaml.safe_load(saved.read_text()) or {}
        current = config.to_dict()
        changed = sorted(
            f"{section}.{key}"
            for section, values in current.items()
            for key, value in values.items()
            if (section, key) not in RESUMABLE_KEYS
            and previous.get(section, {}).get(key, value) != value
        )
        if changed:
            raise UserError(
                f"output directory {out} holds a run with a different config ({', '.join(changed)});"
                " choose another output.dir, or set output.overwrite=true to start over there"
            )
        if config.train.resume is None and (out / "checkpoints").exists():
            raise UserError(
                f"output directory {out} already holds this run; continue it with "
                "train.resume=auto, or set output.overwrite=true to start over"
            )
    if config.output.overwrite and config.train.resume is None and out.exists():
        for name in ("checkpoints", "adapter", "model", "metrics.jsonl", "summary.json", "tracking.json"):
            remove(out / name)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"output.dir={str(out)!r} is not writable ({exc.strerror}); choose a "
                        "directory you can write to") from exc
    saved.write_text(config.to_yaml())
    return out


def save_final_adapter(model: Any, target: Path, record: dict[str, Any] | None = None,
                       training: dict[str, Any] | None = None) -> None:
    """OUTPUT/adapter (with its base record and model card when `record` is given: see
    cpudist.model.provenance), replaced atomically; a failure says where the same weights still
    are."""
    from safetensors import SafetensorError

    from cpudist.model.adapters import save_adapter
    from cpudist.model.provenance import write_provenance

    try:
        with replacing(target) as tmp:
            save_adapter(model, tmp)
            if record is not None:
                write_provenance(tmp, record, training)
    except (OSError, SafetensorError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise UserError(f"could not write the adapter to {target}: {reason}. The same weights are "
                        f"in the newest checkpoint under {target.parent / 'checkpoints'}") from exc


def save_final_model(model: Any, tokenizer: Any, target: Path, max_shard_mb: int) -> None:
    """OUTPUT/model of a peft.method=full run (a Hugging Face directory), replaced atomically; a
    failure says where the same weights still are."""
    from safetensors import SafetensorError

    from cpudist.train.checkpoint import save_full_model

    try:
        with replacing(target) as tmp:
            save_full_model(model, tokenizer, tmp, max_shard_mb)
    except (OSError, SafetensorError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise UserError(f"could not write the model to {target}: {reason}. The same weights are "
                        f"in the newest checkpoint under {target.parent / 'checkpoints'}") from exc


def note_restart(out: Path, placement: Placement, step: int) -> None:
    """The restart record of a launcher that starts the workers again itself (torchrun
    --max-restarts), as `cpudist launch --restarts` writes one between two jobs; here rank 0
    writes it, before it opens metrics.jsonl (which keeps such records when it is cut back)."""
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    append_event(out / "metrics.jsonl", RestartEvent(
        attempt=placement.restarts, reason=f"{placement.launcher} started the workers again "
        f"(restart {placement.restarts}): a worker or node failed", resumed_from_step=step,
        time=now))


def resume_command(out: Path) -> str:
    """The command that continues the run in `out`: its own config.yaml (the settings as given,
    overrides included) plus train.resume=auto. It does not depend on how the run was started
    (a command line, a script using the Python API, a launcher)."""
    return " ".join(shlex.quote(a) for a in ["cpudist", "train", str(out / "config.yaml"),
                                             "train.resume=auto"])


def print_outcome(summary: RunSummary, objective: Objective) -> None:
    lines = [f"done: {summary.steps} steps in {summary.wall_s:.0f} s, "
             f"{summary.tokens_per_s:.0f} tokens/s, peak RSS {summary.peak_rss_gb:.2f} GB"]
    if summary.time is not None:
        lines.append(f"time: {summary.time.describe()}")
    if summary.eval_before and summary.eval_after:
        lines.append(objective.describe_eval(summary.eval_before, summary.eval_after))
    for sample in summary.samples:
        lines.append(f"held-out prompt: {sample.prompt!r}")
        lines.append(f"  reference: {sample.reference}")
        lines.append(f"  before:    {sample.before}")
        lines.append(f"  after:     {sample.after}")
    log.info("\n".join(lines))


def run_dir_of(adapter_dir: Path) -> Path | None:
    """OUTPUT/ of a run's adapter (OUTPUT/adapter or OUTPUT/checkpoints/step-N/adapter), or None
    for an adapter that is not in a run directory."""
    if not (adapter_dir.parent / "config.yaml").is_file():
        return None
    if adapter_dir.parent.parent.name == "checkpoints":
        return adapter_dir.parent.parent.parent
    return adapter_dir.parent
