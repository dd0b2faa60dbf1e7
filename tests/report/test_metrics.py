"""MetricsLog when writing fails mid-run: the run goes on, metrics.jsonl only ever holds whole
lines, one warning when writing stops working and one when it works again."""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cpudist.errors import UserError
from cpudist.records import EvalRecord, RestartEvent, TaskEvalResult
from cpudist.report import metrics as report
from cpudist.report.metrics import MetricsLog, append_event
from tests.helpers import REPO


class FullDisk:
    """A file whose writes take half of what they are given, then fail as on a full disk."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def __enter__(self) -> FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()

    def write(self, data: bytes) -> int:
        self.handle.write(bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fail_writes(monkeypatch: pytest.MonkeyPatch, calls: set[int]) -> None:
    """Make the given calls (1-based) of open() in cpudist.report.metrics hit a full disk."""
    count = 0

    def fake_open(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        handle = builtins.open(*args, **kwargs)  # noqa: SIM115 (closed by the caller's with)
        return FullDisk(handle) if count in calls else handle

    monkeypatch.setattr(report, "open", fake_open, raising=False)


def lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n")  # whole lines only
    return [json.loads(line) for line in text.splitlines()]


def line(step: int, **values: float) -> EvalRecord:
    """A metrics line {"step": step, **values}."""
    return EvalRecord(step, values)


def restart(attempt: int, resumed_from_step: int | None = None) -> RestartEvent:
    return RestartEvent(attempt, "rank lost", resumed_from_step, "2026-12-05T10:00:00+00:00")


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_failed_writes_are_cut_off_warned_once_and_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsLog(path, None, None)
    fail_writes(monkeypatch, {2, 3})
    for step in range(1, 5):
        metrics.write(line(step, loss=1.0 / step))
    metrics.close()
    assert [r["step"] for r in lines(path)] == [1, 4]
    said = warnings(caplog)
    assert len(said) == 2, said
    assert said[0].startswith(f"could not write {path}: No space left on device; metrics are "
                              "skipped until writing works again")
    assert "checkpoints are saved on their own" in said[0]
    assert said[1] == f"writing {path} works again; 2 logged step(s) are missing from it"


def test_partial_write_at_the_file_size_limit_is_cut_off(tmp_path: Path) -> None:
    """A real short write from the kernel (RLIMIT_FSIZE, EFBIG) in a child process."""
    path = tmp_path / "metrics.jsonl"
    script = textwrap.dedent(f"""
        import logging, resource
        from pathlib import Path
        from cpudist.records import EvalRecord
        from cpudist.report.metrics import MetricsLog
        logging.basicConfig(format="%(message)s")
        path = Path({str(path)!r})
        metrics = MetricsLog(path, None, None)
        metrics.write(EvalRecord(1, {{"loss": 2.0}}))
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 10, hard))
        metrics.write(EvalRecord(2, {{"loss": 1.5}}))
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        metrics.write(EvalRecord(3, {{"loss": 1.0}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in lines(path)] == [1, 3]
    said = done.stderr.strip().splitlines()
    assert len(said) == 2, said
    assert said[0].startswith(f"could not write {path}: File too large;")
    assert said[1].endswith("1 logged step(s) are missing from it")


def test_unwritable_file_from_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')

    def refuse(self: Path, data: bytes) -> int:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(Path, "write_bytes", refuse)
    metrics = MetricsLog(path, None, None)  # a new run cannot empty the old file
    metrics.write(line(1, loss=3.0))
    monkeypatch.undo()
    metrics.write(line(2, loss=2.0))  # empties it first, then appends
    assert [r["step"] for r in lines(path)] == [2]
    said = warnings(caplog)
    assert len(said) == 2 and "Permission denied" in said[0], said


class FakeWriter:
    """Stands in for TensorBoard's SummaryWriter; flush fails while `broken`."""

    broken = False
    made: list[FakeWriter] = []

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False
        FakeWriter.made.append(self)

    def add_scalar(self, key: str, value: float, step: int) -> None:
        self.scalars.append((key, value, step))

    def flush(self) -> None:
        if FakeWriter.broken:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        self.closed = True
        self.flush()


def test_tensorboard_write_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    FakeWriter.made = []
    monkeypatch.setattr(report, "_summary_writer", lambda directory: FakeWriter())
    tb = tmp_path / "tensorboard"
    metrics = MetricsLog(tmp_path / "metrics.jsonl", None, tb)
    metrics.write(line(1, loss=2.0))
    FakeWriter.broken = True
    try:
        metrics.write(line(2, loss=1.5))
        metrics.write(line(3, loss=1.2))
    finally:
        FakeWriter.broken = False
    metrics.write(line(4, loss=1.0))
    metrics.close()
    # A broken writer is dropped and a new one (a new event file) tried at the next write.
    assert len(FakeWriter.made) == 3 and all(w.closed for w in FakeWriter.made)
    assert FakeWriter.made[2].scalars == [("loss", 1.0, 4)]
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    said = warnings(caplog)
    assert len(said) == 2, said
    assert said[0].startswith(f"could not write {tb}: No space left on device; TensorBoard "
                              "scalars are skipped")
    assert said[1] == f"writing {tb} works again; 2 logged step(s) are missing from it"


@pytest.mark.parametrize(("content", "kept", "warned"), [
    # Lines past the checkpoint's step go (the final evaluation repeats the last step).
    ('{"step": 1}\n{"step": 2}\n{"step": 2, "val_loss": 1}\n{"step": 3}\n', [1, 2, 2], None),
    # A line cut short by a crash ends the file, with the lines after it.
    ('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n', [1], ":2: malformed JSON"),
    ('{"step": 1}\n{"step": 2}', [1], None),  # no newline: the write did not finish
    ("", [], None),
])
def test_resume_cuts_back_to_the_checkpoint_step(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                 content: str, kept: list[int],
                                                 warned: str | None) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(content)
    metrics = MetricsLog(path, 2, None)
    metrics.write(line(3, loss=1.0))
    assert [r["step"] for r in lines(path)] == [*kept, 3]
    said = warnings(caplog)
    if warned is None:
        assert said == []
    else:
        assert len(said) == 1 and f"{path}{warned}" in said[0], said
        assert said[0].endswith("it and the lines after it are dropped")


def test_resume_keeps_restart_records_after_the_checkpoint(tmp_path: Path) -> None:
    """The launcher appends its restart record after the steps the killed job logged past the
    checkpoint; the resumed job drops those steps but keeps every record."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"event": "restart", "attempt": 1}\n{"step": 2}\n{"step": 3}\n'
                    '{"step": 4, "lo')  # the killed rank's last line, cut short
    append_event(path, restart(2, resumed_from_step=2))
    assert path.read_text().endswith('{"step": 3}\n' + json.dumps(restart(2, 2).to_json()) + "\n")
    metrics = MetricsLog(path, 2, None)
    metrics.write(line(3, loss=1.0))
    assert lines(path) == [{"step": 1}, {"event": "restart", "attempt": 1}, {"step": 2},
                           restart(2, 2).to_json(), {"step": 3, "loss": 1.0}]
    # A job that finds no checkpoint at all (killed before the first) starts from step 0.
    MetricsLog(path, 0, None).write(line(1))
    assert lines(path) == [{"event": "restart", "attempt": 1}, restart(2, 2).to_json(), {"step": 1}]


def test_append_event_to_a_new_or_unterminated_file(tmp_path: Path) -> None:
    path = tmp_path / "out" / "metrics.jsonl"
    append_event(path, restart(1))
    path.write_bytes(path.read_bytes() + b"x" * 70000)  # a long last line without its newline
    append_event(path, restart(2))
    assert lines(path) == [restart(1).to_json(), restart(2).to_json()]


# --------------------------------------------------------------------------- eval.json


def task(name: str, acc: float) -> TaskEvalResult:
    return TaskEvalResult(name, f"{name}.jsonl", "multiple_choice", 4, "chat template", "base",
                          "adapter", "float32", {"acc": 0.25}, {"acc": acc})


def test_eval_results_join_the_earlier_ones(tmp_path: Path) -> None:
    path = tmp_path / "run" / report.EVAL_FILE
    assert report.read_eval(path) == {}  # no results yet
    path.parent.mkdir()
    report.write_eval(path, task("mc", 0.5))
    report.write_eval(path, task("gen", 0.25))
    report.write_eval(path, task("mc", 0.75))
    assert report.read_eval(path) == {"mc": task("mc", 0.75), "gen": task("gen", 0.25)}


@pytest.mark.parametrize(("content", "why"), [
    (b'{"tasks": {"mc": {"after": 0.5}}', ":1: malformed JSON (Expecting ',' delimiter)"),
    (b'[{"mc": 0.5}]', ": no 'tasks' object, so not cpudist's eval results"),
    (b'{"tasks": ["mc"]}', ": no 'tasks' object, so not cpudist's eval results"),
    (b'{"tasks": {"caf\xe9": 1}}', ": cannot read earlier eval results ('utf-8' codec can't"),
])
def test_an_unreadable_eval_json_is_refused_not_overwritten(content: bytes, why: str,
                                                            tmp_path: Path) -> None:
    path = tmp_path / report.EVAL_FILE
    path.write_bytes(content)
    with pytest.raises(UserError) as info:
        report.read_eval(path)
    assert str(info.value).startswith(f"{path}{why}") and str(info.value).endswith("fix or move it")
    with pytest.raises(UserError) as info:
        report.write_eval(path, task("mc", 0.75))
    message = str(info.value)
    assert message.startswith(f"{path}{why}") and "\n" not in message
    assert message.endswith("fix or move it, or pass --out FILE to write these results elsewhere")
    assert path.read_bytes() == content  # the earlier results are still there


def test_an_eval_json_that_cannot_be_opened_is_refused(tmp_path: Path) -> None:
    path = tmp_path / report.EVAL_FILE
    path.mkdir()  # a directory where the file should be: open fails, but not as "missing"
    with pytest.raises(UserError, match=f"{path}: cannot read earlier eval results \\(Is a "
                                        "directory\\); fix or move it, or pass --out FILE"):
        report.write_eval(path, task("mc", 0.75))
