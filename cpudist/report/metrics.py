"""OUTPUT/metrics.jsonl (and TensorBoard, when asked for), written by rank 0 during a run.

Pictures and the HTML report are made from metrics.jsonl afterwards (cpudist.report.plots).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, BinaryIO

from cpudist.errors import UserError
from cpudist.files import replacing, write_text
from cpudist.jsonl import JsonlError, iter_jsonl
from cpudist.records import EvalRecord, RestartEvent, StepRecord, TaskEvalResult

log = logging.getLogger("cpudist")


class _Outage:
    """Says once that writes to a file started failing, and once that they work again."""

    def __init__(self, target: Path, what: str) -> None:
        self.target = target
        self.what = what  # what is lost meanwhile: "metrics", "TensorBoard scalars"
        self.failing = False
        self.skipped = 0  # logged steps missing from the file

    def failed(self, exc: OSError, lost: int = 1) -> None:
        if not self.failing:
            log.warning("could not write %s: %s; %s are skipped until writing works again. "
                        "Training goes on (checkpoints are saved on their own, and one that "
                        "cannot be written still stops the run)",
                        self.target, exc.strerror or exc, self.what)
        self.failing = True
        self.skipped += lost

    def worked(self) -> None:
        if self.failing:
            log.warning("writing %s works again; %d logged step(s) are missing from it",
                        self.target, self.skipped)
        self.failing = False
        self.skipped = 0


class MetricsLog:
    """Append-only metrics.jsonl; on resume, step lines past the checkpoint's step are dropped and
    event lines (`{"event": ...}`, such as the launcher's restart records) are kept.

    Metrics never stop a run: when the disk fills or permissions change, a line that cannot be
    written is cut off again (the file only ever holds whole lines), one warning says so, and
    later writes keep trying. The same goes for TensorBoard.
    """

    def __init__(self, path: Path, resume_step: int | None, tensorboard_dir: Path | None) -> None:
        self.path = path
        self.resume_step = resume_step
        self.size = 0  # bytes of whole lines in the file: a failed append is cut back to this
        self.started = False  # emptied (new run) or cut back to the checkpoint's step (resume)
        self.outage = _Outage(path, "metrics")
        try:
            self._start()
        except OSError as exc:  # tried again before the first append
            self.outage.failed(exc, lost=0)
        self.writer: Any = None
        self.tensorboard_dir: Path | None = None
        if tensorboard_dir is not None:
            self.tensorboard_dir = tensorboard_dir
            self.tb_outage = _Outage(tensorboard_dir, "TensorBoard scalars")
            try:
                self.writer = _summary_writer(tensorboard_dir)
            except ImportError:
                log.warning("output.tensorboard=true but tensorboard is not installed "
                            "(pip install 'cpudist[tensorboard]'); writing metrics.jsonl only")
                self.tensorboard_dir = None
            except OSError as exc:  # tried again at the next write
                self.tb_outage.failed(exc, lost=0)

    def _start(self) -> None:
        if self.resume_step is None:
            self.path.write_bytes(b"")
        elif self.path.exists():
            end = _end_of_step(self.path, self.resume_step)
            events = _event_lines(self.path, end)
            if events:
                # Rewritten whole, so a crash meanwhile leaves the old file, events and all.
                with open(self.path, "rb") as handle:
                    kept = handle.read(end)
                with replacing(self.path) as tmp:
                    tmp.write_bytes(kept + events)
            else:
                # Cut in place: the lines kept are the file's start, and truncating needs no space.
                os.truncate(self.path, end)
        self.size = self.path.stat().st_size if self.path.exists() else 0
        self.started = True

    def write(self, record: StepRecord | EvalRecord) -> None:
        try:
            self._append((json.dumps(record.to_json()) + "\n").encode())
        except OSError as exc:
            self.outage.failed(exc)
        else:
            self.outage.worked()
        if self.tensorboard_dir is not None:
            self._tensorboard(record)

    def _append(self, line: bytes) -> None:
        if not self.started:
            self._start()
        # Unbuffered, so that nothing of a failed line is left to be flushed at close.
        with open(self.path, "ab", buffering=0) as handle:
            end = handle.seek(0, os.SEEK_END)
            if end > self.size:  # part of a failed line that could not be cut off then
                handle.truncate(self.size)
            self.size = min(end, self.size)  # smaller: the file was cut or removed meanwhile
            try:
                rest = memoryview(line)
                while rest:  # a full disk first takes part of the line, then raises
                    rest = rest[handle.write(rest):]
            except OSError:
                with contextlib.suppress(OSError):  # else the next append cuts it
                    handle.truncate(self.size)
                raise
        self.size += len(line)

    def _tensorboard(self, record: StepRecord | EvalRecord) -> None:
        assert self.tensorboard_dir is not None
        if self.writer is None:
            # A writer that failed once stays broken (its thread died): retry with a new event
            # file, but only once metrics.jsonl could be written, so that a full disk does not
            # get one more file at every logged step.
            if self.outage.failing:
                self.tb_outage.skipped += 1
                return
            try:
                self.writer = _summary_writer(self.tensorboard_dir)
            except OSError as exc:
                self.tb_outage.failed(exc)
                return
        line = record.to_json()
        step = line.get("step", 0)
        try:
            for key, value in line.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()  # surfaces a write error of its thread now, at this step
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.writer.close()
            self.writer = None
            self.tb_outage.failed(exc)
        else:
            self.tb_outage.worked()

    def close(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as exc:
                self.tb_outage.failed(exc, lost=0)
            self.writer = None


def _end_of_step(path: Path, step: int) -> int:
    """Length of the leading lines of metrics.jsonl up to `step` (steps only grow along the file).
    A line that cannot be read, such as one cut short by a crash, ends them, with a warning."""
    end = last_start = 0
    try:
        for line in iter_jsonl(path, advice="it and the lines after it are dropped"):
            if isinstance(line.value, dict) and line.value.get("step", 0) > step:
                break
            end, last_start = line.end, line.start
    except JsonlError as exc:
        log.warning("%s", exc)
    with open(path, "rb") as handle:  # a last line without its newline did not finish either
        handle.seek(max(end - 1, 0))
        if end and handle.read(1) != b"\n":
            end = last_start
    return end


def _event_lines(path: Path, start: int) -> bytes:
    """The whole event lines (JSON objects with an "event" key) from byte `start` on."""
    with open(path, "rb") as handle:
        handle.seek(start)
        tail = handle.read()
    kept = []
    for raw in tail.splitlines(keepends=True):
        try:
            value = json.loads(raw)
        except ValueError:  # a line cut short by a crash, or not text
            continue
        if raw.endswith(b"\n") and isinstance(value, dict) and "event" in value:
            kept.append(raw)
    return b"".join(kept)


def append_event(path: Path, record: RestartEvent) -> None:
    """Append one event line to a metrics.jsonl no rank is writing (the launcher, between jobs).
    A last line cut short by a killed rank is dropped first: it belonged to a step after the
    checkpoint, which the resumed job takes again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+", buffering=0) as handle:
        handle.truncate(_whole_lines(handle))
        handle.write((json.dumps(record.to_json()) + "\n").encode())
        os.fsync(handle.fileno())


def _whole_lines(handle: BinaryIO) -> int:
    """Bytes up to and including the last newline of an open file."""
    pos = end = handle.seek(0, os.SEEK_END)
    while pos > 0:
        size = min(1 << 16, pos)
        pos -= size
        handle.seek(pos)
        block = handle.read(size)
        if pos + size == end and block.endswith(b"\n"):
            return end
        newline = block.rfind(b"\n")
        if newline >= 0:
            return pos + newline + 1
    return 0


def _summary_writer(directory: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    _quiet_tensorboard_thread()
    return SummaryWriter(str(directory))


def _quiet_tensorboard_thread() -> None:
    """TensorBoard writes from a thread, which prints a traceback when a write fails. The same
    error reaches MetricsLog at the next add_scalar/flush, which reports it in one line."""
    previous = threading.excepthook
    if getattr(previous, "cpudist_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if not (issubclass(args.exc_type, OSError)
                and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    hook.cpudist_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


# --------------------------------------------------------------------------- eval.json

EVAL_FILE = "eval.json"  # OUTPUT/eval.json: `cpudist eval --task` results, one entry per task


def read_eval(path: Path) -> dict[str, TaskEvalResult]:
    """eval.json's tasks (task name -> result); {} when there is none yet. A file that cannot be
    read, or is not an eval.json, is a UserError: writing over it would lose its results."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UserError(f"{path}: cannot read earlier eval results ({why}); fix or move it") from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg}), so its earlier eval "
                        "results cannot be kept; fix or move it") from None
    tasks = loaded.get("tasks") if isinstance(loaded, dict) else None
    if not isinstance(tasks, dict) or not all(isinstance(t, dict) for t in tasks.values()):
        raise UserError(f"{path}: no 'tasks' object, so not cpudist's eval results; fix or move it")
    return {name: TaskEvalResult.from_json(result) for name, result in tasks.items()}


def write_eval(path: Path, result: TaskEvalResult) -> None:
    """Add (or replace) one task's result in eval.json, keeping the other tasks'."""
    try:
        tasks = read_eval(path)
    except UserError as exc:
        raise UserError(f"{exc}, or pass --out FILE to write these results elsewhere") from None
    tasks[result.task] = result
    try:
        write_text(path, json.dumps({"tasks": {name: task.to_json() for name, task in tasks.items()}},
                                    indent=1, ensure_ascii=False))
    except OSError as exc:
        raise UserError(f"could not write {path} ({exc.strerror}); pass --out FILE somewhere "
                        "writable") from exc
