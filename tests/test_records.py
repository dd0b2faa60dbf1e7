"""The typed records round-trip through their JSON form, which stays what it was on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpudist.errors import UserError
from cpudist.records import (
    EvalRecord,
    HeldOutAnswer,
    RestartEvent,
    RunSummary,
    StepRecord,
    TaskEvalResult,
    metrics_line,
    read_summary,
)
from tests.helpers import bench_result


def test_a_step_record_is_flat_json_and_reads_back() -> None:
    record = StepRecord(step=3, epoch=0, loss=1.5, lr=2e-4, grad_norm=0.7, tokens_per_s=100.0,
                        label_tokens_per_s=40.0, step_s=0.5, elapsed=1.5,
                        metrics={"reward_margin": 0.25}, evaluation={"val_loss": 1.2})
    line = record.to_json()
    assert line == {"step": 3, "epoch": 0, "loss": 1.5, "lr": 2e-4, "grad_norm": 0.7,
                    "tokens_per_s": 100.0, "label_tokens_per_s": 40.0, "step_s": 0.5,
                    "elapsed": 1.5, "reward_margin": 0.25, "val_loss": 1.2}
    assert metrics_line(json.loads(json.dumps(line))) == record
    assert record.value("val_loss") == 1.2 and record.value("absent") is None


def test_evaluation_and_restart_lines_read_back_as_their_kind() -> None:
    final = EvalRecord(10, {"val_loss": 1.0, "val_ppl": 2.7})
    assert final.to_json() == {"step": 10, "val_loss": 1.0, "val_ppl": 2.7}
    assert metrics_line(final.to_json()) == final
    restart = RestartEvent(2, "a rank was lost", 6, "2026-12-05T10:00:00+00:00")
    assert restart.to_json()["event"] == "restart"
    assert metrics_line(restart.to_json()) == restart
    assert metrics_line({"something": "else"}) is None


def test_the_summary_keeps_its_flat_keys_on_disk(tmp_path: Path) -> None:
    summary = RunSummary(world_size=2, threads_per_rank=1, dtype="float32", communication="gloo",
                         global_batch=8, cpu="AMD EPYC", launcher="openmpi", steps=4,
                         train_loss=1.25, eval_before={"val_loss": 2.0, "val_ppl": 7.4},
                         eval_after={"val_loss": 1.5, "val_ppl": 4.5},
                         samples=[HeldOutAnswer("q", "r", "b", "a")])
    on_disk = summary.to_json()
    assert on_disk["val_loss_before"] == 2.0 and on_disk["val_ppl_after"] == 4.5
    assert "eval_before" not in on_disk and on_disk["samples"][0]["after"] == "a"
    summary.write(tmp_path / "summary.json")
    assert read_summary(tmp_path / "summary.json") == summary
    assert read_summary(tmp_path / "none.json") is None
    (tmp_path / "cut.json").write_text('{"steps": 4, "wall')
    with pytest.raises(UserError, match="cut.json:1: malformed JSON"):
        read_summary(tmp_path / "cut.json")


def test_task_and_bench_results_ignore_keys_they_do_not_know() -> None:
    task = TaskEvalResult("trivia", "t.jsonl", "multiple_choice", 3, "chat template", "base",
                          None, "float32", {"acc": 0.5}, {"acc": 1.0})
    assert TaskEvalResult.from_json({**task.to_json(), "future": 1}) == task
    assert task.lines() == ["trivia acc: base 50.0% -> adapter 100.0%  (3 items)"]
    result = bench_result(peak_rss_gb=[1.5, 2.5], tokens_per_s=10.0)
    assert type(result).from_json({**result.to_json(), "future": 1}) == result
    assert result.figure("peak_rss_gb") == 2.5 and result.figure("tokens_per_s") == 10.0
