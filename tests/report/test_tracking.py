"""Experiment tracking (cpudist.report.tracking) in this process: W&B in offline mode, read back
from its run files, across a stop and a resume; a missing extra is a one-line error."""

from __future__ import annotations

import builtins
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import cli_in_process, signal_after, tiny_overrides

BLOCK = 32768  # the transaction log's block (LevelDB's log format)


def wandb_records(run_file: Path) -> list[Any]:
    """The records of an offline W&B run file (run-ID.wandb): a 7-byte header, then LevelDB log
    records (crc32, length, type; FULL=1 or FIRST=2/MIDDLE=3/LAST=4 pieces, never across a block
    end) holding protobuf Records. wandb ships no reader of its own any more (its Go core writes
    the file), hence these lines."""
    from wandb.proto import wandb_internal_pb2

    data, pos, piece, records = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(piece)
            records.append(record)
            piece = b""
    return records


def name(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_continues_across_a_resume(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="pip install 'cpudist[wandb]'")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = ["train", *tiny_overrides(tiny_llama, chat_file, out, train__max_steps=4),
            "tracking.wandb_project=cpudist-test", "tracking.wandb_mode=offline"]
    with monkeypatch.context() as patch:
        signal_after(patch, 2)
        assert cli_in_process(capsys, args).returncode == 75
    resumed = cli_in_process(capsys, [*args, "train.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_id = json.loads((out / "tracking.json").read_text())["wandb"]["run_id"]
    parts = sorted((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(parts) == 2  # the first start and the resume, one W&B run id
    steps, config = [], {}
    for part in parts:
        for record in wandb_records(part):
            if record.WhichOneof("record_type") == "history":
                items = {name(i): json.loads(i.value_json) for i in record.history.item}
                if "loss" in items:
                    steps.append(record.history.step.num)
            elif record.WhichOneof("record_type") == "run" and record.run.config.update:
                config.update({name(i): json.loads(i.value_json)
                               for i in record.run.config.update})
    assert steps == [1, 2, 3, 4]
    assert config["train.max_steps"] == "4"  # the resolved config, once


def test_a_missing_extra_is_a_one_line_error(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def without_mlflow(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "mlflow" or name.startswith("mlflow."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_mlflow)
    monkeypatch.delitem(__import__("sys").modules, "mlflow", raising=False)
    done = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, chat_file, tmp_path / "o"),
                                   "tracking.mlflow_uri=http://127.0.0.1:9"])
    assert done.returncode == 2
    assert ("tracking.mlflow_uri is set but mlflow is not installed: pip install "
            "'cpudist[mlflow]'") in done.stderr
