"""Checkpoint manifests: a damaged newest checkpoint is found, moved aside, and the previous one
used; every checkpoint damaged is a one-line error; an old checkpoint without manifest is taken
with a warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from cpudist.errors import UserError
from cpudist.train import checkpoint_files as files


def fake_checkpoint(root: Path, step: int, manifest: bool = True) -> Path:
    path = root / f"step-{step}"
    (path / "adapter").mkdir(parents=True)
    (path / "adapter" / "adapter_model.safetensors").write_bytes(bytes(range(256)) * (step + 4))
    (path / "optimizer.safetensors").write_bytes(b"o" * 100)
    (path / "state.json").write_text(json.dumps({"train": {"step": step}}))
    if manifest:
        files.write_manifest(path)
    return path


def flip_byte(path: Path, offset: int = 300) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_intact_checkpoint_verifies(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 2)
    assert files.verify(path) is None
    assert files.resume_auto(tmp_path) == path


def test_a_flipped_byte_falls_back_to_the_previous_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    older = fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    flip_byte(newest / "adapter" / "adapter_model.safetensors")
    assert "adapter/adapter_model.safetensors does not match its SHA-256" in str(files.verify(newest))
    # The launcher's look changes nothing on disk.
    assert files.newest_usable(tmp_path)[0] == older and newest.is_dir()
    with caplog.at_level(logging.WARNING, logger="cpudist"):
        assert files.resume_auto(tmp_path) == older
    assert "step-4 is damaged (adapter/adapter_model.safetensors does not match" in caplog.text
    assert not newest.exists() and (tmp_path / "damaged-step-4").is_dir()  # kept for a look
    assert files.checkpoint_dirs(tmp_path) == [older]


def test_a_truncated_or_missing_file_is_named(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 2)
    (path / "optimizer.safetensors").write_bytes(b"o" * 10)
    assert files.verify(path) == "optimizer.safetensors has 10 bytes, the manifest says 100"
    (path / "optimizer.safetensors").unlink()
    assert files.verify(path) == "optimizer.safetensors is missing"


def test_every_checkpoint_damaged_is_one_error_that_moves_nothing(tmp_path: Path) -> None:
    for step in (2, 4):
        flip_byte(fake_checkpoint(tmp_path, step) / "adapter" / "adapter_model.safetensors")
    with pytest.raises(UserError, match=r"no usable checkpoint in .*step-4: adapter.*step-2: "
                                        r"adapter.*train.resume=PATH") as error:
        files.resume_auto(tmp_path)
    assert "\n" not in str(error.value)
    assert [p.name for p in files.checkpoint_dirs(tmp_path)] == ["step-2", "step-4"]


def test_a_damaged_checkpoint_named_explicitly_is_refused(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 2)
    flip_byte(path / "optimizer.safetensors", offset=5)
    with pytest.raises(UserError, match="train.resume=.*step-2: the checkpoint is damaged"):
        files.check_given(path)


def test_a_checkpoint_without_manifest_is_taken_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = fake_checkpoint(tmp_path, 2, manifest=False)
    with caplog.at_level(logging.WARNING, logger="cpudist"):
        assert files.resume_auto(tmp_path) == path
    assert "has no manifest.json" in caplog.text


def test_keep_last_is_at_least_two() -> None:
    from cpudist.config import load_config

    with pytest.raises(UserError, match="keep_last"):
        load_config(None, ["train.keep_last=1"])
