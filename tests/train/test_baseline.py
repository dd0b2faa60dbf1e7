"""The untrained model's validation figures are cached beside the tokenized data: read back by a
run that differs only in its schedule, computed again when anything they depend on changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import chat_rows, cli_in_process, tiny_overrides, write_jsonl


def _train(capsys: pytest.CaptureFixture[str], model: Path, data: Path, out: Path,
           **extra: object) -> tuple[str, dict]:
    """(its log, its summary.json) of a one-step run; the data cache is out's sibling."""
    result = cli_in_process(capsys, ["train", *tiny_overrides(model, data, out, train__max_steps=1,
                                                              **extra)])
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr, json.loads((out / "summary.json").read_text())


def test_a_run_with_another_lr_reads_the_baseline_and_it_equals_a_fresh_one(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, a = _train(capsys, tiny_llama, chat_file, tmp_path / "a")
    assert "baseline evaluation: computed" in first
    second, b = _train(capsys, tiny_llama, chat_file, tmp_path / "b", train__lr=2e-2,
                       train__save_every=1, train__warmup_steps=1)
    assert "baseline evaluation: cached (" in second
    assert b["val_loss_before"] == a["val_loss_before"]
    assert f"validation before training: loss {a['val_loss_before']:.4f}" in second
    # The cached figures are what that run computes afresh (another cache directory).
    fresh, c = _train(capsys, tiny_llama, chat_file, tmp_path / "c", train__lr=2e-2,
                      train__save_every=1, train__warmup_steps=1,
                      data__cache_dir=tmp_path / "other-cache")
    assert "baseline evaluation: computed" in fresh
    assert c["val_loss_before"] == b["val_loss_before"] and c["val_ppl_before"] == b["val_ppl_before"]
    assert len(list((tmp_path / "data-cache" / "baseline").glob("*.json"))) == 1


@pytest.mark.parametrize("change", ["seed", "method", "held-out", "val-cap", "eval-batches"])
def test_what_the_baseline_depends_on_computes_it_again(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        change: str) -> None:
    """A held-out file of its own, so that the seed changes only the adapter's initialisation,
    and "held-out" only the held-out tokens (the same path, other contents)."""
    held_out = write_jsonl(tmp_path / "val.jsonl", chat_rows()[:12])
    _train(capsys, tiny_llama, chat_file, tmp_path / "a", data__val_path=held_out)
    extra: dict[str, object] = {
        "seed": {"train__seed": 7}, "method": {"lora__r": 4}, "held-out": {},
        "val-cap": {"data__val_max_samples": 3}, "eval-batches": {"train__eval_batches": 1},
    }[change]
    if change == "held-out":
        write_jsonl(held_out, [{"messages": [
            m if m["role"] == "user" else {**m, "content": m["content"] + " Indeed."}
            for m in row["messages"]]} for row in chat_rows()[:12]])
    log, _ = _train(capsys, tiny_llama, chat_file, tmp_path / "b", data__val_path=held_out, **extra)
    assert "baseline evaluation: computed" in log
    assert len(list((tmp_path / "data-cache" / "baseline").glob("*.json"))) == 2


def test_a_cut_short_or_foreign_record_is_not_read(tmp_path: Path) -> None:
    """A record cut off while written, or one stored under another key's name, is computed again
    (read gives None), never trusted."""
    from cpudist.records import BaselineEvaluation

    record = BaselineEvaluation(key="abc", figures={"val_loss": 2.5}, samples=8, seconds=1.0)
    path = tmp_path / "abc.json"
    path.write_text(json.dumps(record.to_json()))
    assert BaselineEvaluation.read(path) == record
    path.write_text(json.dumps(record.to_json())[:20])
    assert BaselineEvaluation.read(path) is None
    (tmp_path / "other.json").write_text(json.dumps(record.to_json()))
    assert BaselineEvaluation.read(tmp_path / "other.json") is None
    assert BaselineEvaluation.read(tmp_path / "missing.json") is None
