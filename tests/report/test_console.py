"""Console progress: `--quiet` keeps the progress lines (rows tokenized, training steps) off and
leaves the rest of the log."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpudist.data import shards
from tests.helpers import cli_in_process, tiny_overrides, write_jsonl


def test_quiet_keeps_progress_lines_off(tiny_llama: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "PROGRESS_EVERY_S", 0.0)  # a rows line at every chunk
    data = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                      {"role": "assistant", "content": f"It is {i + 1}."}]} for i in range(24)])

    def train(name: str, *flags: str) -> str:
        done = cli_in_process(capsys, ["train", *flags, *tiny_overrides(
            tiny_llama, data, tmp_path / name, train__max_steps=2,
            data__cache_dir=tmp_path / f"cache-{name}")])
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    loud, quiet = train("loud"), train("quiet", "--quiet")
    assert "step 1/2" in loud and "rows/s" in loud and "rows in" in loud
    assert "step 1/" not in quiet and "rows/s" not in quiet and "rows in" not in quiet
    assert "validation before training" in quiet and "done: 2 steps" in quiet
