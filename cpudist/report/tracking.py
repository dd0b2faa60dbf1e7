"""Experiment trackers (MLflow, Weights & Biases), written by rank 0 beside metrics.jsonl.

What they get: the resolved config as parameters (once, when the tracked run starts), every step
record metrics.jsonl gets and every evaluation as metrics at its step, and at the end the adapter,
summary.json and report.html as artifacts. OUTPUT/tracking.json keeps each tracked run's id, so a
resumed run (train.resume, a launcher's restart) continues the same tracked run. Steps the tracked
run already holds (logged before a crash, after the checkpoint the run resumed from) are not sent
again: MLflow's own history says which; for W&B, tracking.json's `last_step`, written before each
step is sent, so a crash between the two can lose one step but never send one twice.

Both use their library's client only (MlflowClient, not the fluent API with its global active
run, so a script using cpudist's Python API keeps its own MLflow state). Each is an optional extra;
a tracker that fails mid-run is a warning and training goes on, as with metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cpudist.config import Config, TrackingConfig
from cpudist.errors import UserError
from cpudist.files import write_text
from cpudist.records import EvalRecord, RunSummary, StepRecord

log = logging.getLogger("cpudist")

STATE_FILE = "tracking.json"  # OUTPUT/tracking.json: {tracker: {where, run_id, last_step}}
MLFLOW_PARAM_MAX = 6000  # MLflow refuses longer parameter values


def flat_params(config: Config) -> dict[str, str]:
    """The resolved config as `section.key` -> text, as trackers take parameters."""
    return {f"{section}.{key}": value if isinstance(value, str) else json.dumps(value)
            for section, values in config.to_dict().items() for key, value in values.items()}


def _library(module: str, setting: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{setting} is set but {module} is not installed: pip install "
                        f"'cpudist[{extra}]' (or unset {setting})") from None


class MLflowTracker:
    """One MLflow run through MlflowClient."""

    name = "mlflow"

    def __init__(self, tc: TrackingConfig, run_name: str, previous: dict[str, Any] | None,
                 params: dict[str, str]) -> None:
        _library("mlflow", "tracking.mlflow_uri", "mlflow")
        from mlflow.tracking import MlflowClient

        self.where = tc.mlflow_uri
        self.client = MlflowClient(tracking_uri=tc.mlflow_uri)
        if previous is not None:
            self.run_id = str(previous["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
            self.last_step = self._last_logged_step()
            return
        from mlflow.entities import Param

        found = self.client.get_experiment_by_name(tc.mlflow_experiment)
        experiment = (found.experiment_id if found is not None
                      else self.client.create_experiment(tc.mlflow_experiment))
        run = self.client.create_run(experiment, run_name=run_name, tags=dict(tc.tags))
        self.run_id = run.info.run_id
        items = [Param(k, v[:MLFLOW_PARAM_MAX]) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=items[start:start + 100])
        self.last_step = -1

    def _last_logged_step(self) -> int:
        history = self.client.get_metric_history(self.run_id, "loss")
        return max((m.step for m in history), default=-1)

    def log(self, step: int, figures: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(k, v, now, step) for k, v in figures.items()])

    def finish(self, files: list[tuple[Path, str | None]], summary: RunSummary) -> None:
        for path, folder in files:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), folder)
            else:
                self.client.log_artifact(self.run_id, str(path), folder)
        self.client.set_terminated(self.run_id, "FINISHED")

    def stop(self) -> None:
        self.client.set_terminated(self.run_id, "KILLED")  # resumed later: RUNNING again


class WandbTracker:
    """One W&B run (online, or offline into OUTPUT/wandb for `wandb sync`)."""

    name = "wandb"

    def __init__(self, tc: TrackingConfig, run_name: str, previous: dict[str, Any] | None,
                 params: dict[str, str], out: Path) -> None:
        wandb = _library("wandb", "tracking.wandb_project", "wandb")
        self.where = tc.wandb_project
        run_id = (str(previous["run_id"]) if previous is not None
                  else importlib.import_module("wandb.sdk.lib.runid").generate_id())
        self.run = wandb.init(
            project=tc.wandb_project, entity=tc.wandb_entity, name=run_name, id=run_id,
            resume="allow", mode=tc.wandb_mode, dir=str(out),
            tags=[f"{k}:{v}" for k, v in tc.tags.items()], config=None if previous else params,
            settings=wandb.Settings(console="off", silent=True))
        self.run_id = run_id
        self.last_step = int(previous.get("last_step", -1)) if previous is not None else -1

    def log(self, step: int, figures: dict[str, float]) -> None:
        self.run.log(figures, step=step)

    def finish(self, files: list[tuple[Path, str | None]], summary: RunSummary) -> None:
        import wandb

        for path, _ in files:
            if path.is_dir():
                artifact = wandb.Artifact(f"{self.run.name or self.run_id}-{path.name}",
                                          type="model")
                artifact.add_dir(str(path))
                self.run.log_artifact(artifact)
            else:
                self.run.save(str(path), base_path=str(path.parent), policy="now")
        self.run.summary.update({k: v for k, v in summary.to_json().items()
                                 if isinstance(v, (int, float, str))})
        self.run.finish()

    def stop(self) -> None:
        self.run.finish(exit_code=1)


Tracker = MLflowTracker | WandbTracker


class Trackers:
    """The run's trackers on rank 0; each call reaches every one of them."""

    def __init__(self, trackers: list[Tracker], out: Path) -> None:
        self.trackers = trackers
        self.out = out
        self.failing: set[str] = set()
        self._save()

    def _save(self) -> None:
        write_text(self.out / STATE_FILE, json.dumps(
            {t.name: {"where": t.where, "run_id": t.run_id, "last_step": t.last_step}
             for t in self.trackers}, indent=1))

    @contextlib.contextmanager
    def _guarded(self, tracker: Tracker, what: str) -> Iterator[None]:
        """A tracker's failure is a warning (once until it works again); training goes on."""
        try:
            yield
        except Exception as exc:
            if tracker.name not in self.failing:
                log.warning("%s: could not log %s (%s); it is skipped until the tracker works "
                            "again; training goes on", tracker.name, what,
                            str(exc).strip().splitlines()[0][:200] if str(exc).strip() else
                            type(exc).__name__)
            self.failing.add(tracker.name)
        else:
            self.failing.discard(tracker.name)

    def log(self, step: int, figures: dict[str, float], once: bool = False) -> None:
        """Figures at `step` (numbers only, NaN left out), to every tracker; with `once` (a step's
        record) only to those that do not hold that step yet."""
        figures = {k: float(v) for k, v in figures.items()
                   if isinstance(v, (int, float)) and not math.isnan(v)}
        due = [t for t in self.trackers if not once or step > t.last_step]
        if not figures or not due:
            return
        for tracker in due:
            tracker.last_step = max(tracker.last_step, step)
        self._save()  # before sending: a crash between the two never sends a step twice
        for tracker in due:
            with self._guarded(tracker, f"step {step}"):
                tracker.log(step, figures)

    def step(self, record: StepRecord) -> None:
        figures = record.to_json()
        self.log(int(figures.pop("step")), figures, once=True)

    def evaluation(self, record: EvalRecord) -> None:
        self.log(record.step, record.evaluation)

    def finish(self, files: list[Path], summary: RunSummary) -> None:
        """Artifacts (the adapter directory, then single files), and the tracked run closed."""
        present = [(p, p.name if p.is_dir() else None) for p in files if p.exists()]
        for tracker in self.trackers:
            with self._guarded(tracker, "the run's artifacts"):
                tracker.finish(present, summary)

    def stop(self) -> None:
        """Stopped by a signal: each tracked run marked so, until a resume continues it."""
        for tracker in self.trackers:
            with self._guarded(tracker, "that the run stopped"):
                tracker.stop()


def open_trackers(config: Config, out: Path, continuing: bool) -> Trackers | None:
    """The trackers tracking.* asks for (None when none), started or, when `continuing` (a resumed
    run) and OUTPUT/tracking.json names a run on the same server or project, continued."""
    tc = config.tracking
    if tc.mlflow_uri is None and tc.wandb_project is None:
        return None
    previous = _previous(out) if continuing else {}
    name = tc.run_name or out.resolve().name
    params = flat_params(config)
    makers: list[tuple[str | None, str, Callable[[dict[str, Any] | None], Tracker]]] = [
        (tc.mlflow_uri, "mlflow", lambda prev: MLflowTracker(tc, name, prev, params)),
        (tc.wandb_project, "wandb", lambda prev: WandbTracker(tc, name, prev, params, out))]
    trackers = []
    for where, kind, make in makers:
        if where is None:
            continue
        before = previous.get(kind)
        if before is not None and before.get("where") != where:
            log.warning("%s: the run was tracked in %s; this part goes to a new tracked run in %s",
                        kind, before.get("where"), where)
            before = None
        try:
            trackers.append(make(before))
        except UserError:
            raise
        except Exception as exc:
            setting = "tracking.mlflow_uri" if kind == "mlflow" else "tracking.wandb_project"
            raise UserError(f"{setting}={where!r}: could not start tracking ({type(exc).__name__}: "
                            f"{str(exc).strip()[:300]}); check the setting, or unset it") from exc
        log.info("%s: %s run %s (%s)", kind, "continuing" if before else "tracking in",
                 trackers[-1].run_id, where)
    return Trackers(trackers, out)


def _previous(out: Path) -> dict[str, dict[str, Any]]:
    """OUTPUT/tracking.json's tracked runs ({} when there is none or it cannot be read)."""
    try:
        loaded = json.loads((out / STATE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s); the trackers start new runs", out / STATE_FILE, exc)
        return {}
    return {k: v for k, v in loaded.items() if isinstance(v, dict) and "run_id" in v} \
        if isinstance(loaded, dict) else {}
