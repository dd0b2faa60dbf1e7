"""Config: YAML + overrides, unknown keys with suggestions, type and range errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpudist.config import Config, load_config
from cpudist.errors import UserError
from tests.helpers import REPO


def test_shipped_configs_load() -> None:
    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert isinstance(load_config(path), Config), path


def test_overrides_apply_with_yaml_types(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("train:\n  lr: 0.001\n  batch_size: 2\n")
    config = load_config(file, ["train.lr=1e-4", "lora.target_modules=[q_proj, v_proj]",
                                "data.val_path=", "train.compile=true"])
    assert config.train.lr == pytest.approx(1e-4)
    assert config.train.batch_size == 2  # from the file
    assert config.lora.target_modules == ["q_proj", "v_proj"]
    assert config.data.val_path is None
    assert config.train.compile is True


def test_unknown_key_in_file_names_line_and_suggests(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("model:\n  dtype: float32\ntrain:\n  lr: 0.1\n  bach_size: 3\n")
    with pytest.raises(UserError) as info:
        load_config(file)
    message = str(info.value)
    assert f"{file}:5" in message
    assert "train.bach_size" in message and "Did you mean 'train.batch_size'" in message


def test_unknown_override_and_section_suggest() -> None:
    with pytest.raises(UserError, match=r"command line: unknown key 'train.learning_rat'"):
        load_config(None, ["train.learning_rat=1"])
    with pytest.raises(UserError, match=r"command line: unknown key .trian.. Did you mean .train."):
        load_config(None, ["trian.lr=1"])
    with pytest.raises(UserError, match="not key=value"):
        load_config(None, ["train.lr"])


@pytest.mark.parametrize(
    ("override", "key"),
    [("train.lr=-1", "train.lr"), ("lora.r=0", "lora.r"), ("train.batch_size=0", "train.batch_size"),
     ("train.batch_size=four", "train.batch_size"), ("model.dtype=float16", "model.dtype"),
     ("lora.dropout=1.5", "lora.dropout")],
)
def test_bad_values_name_the_key(override: str, key: str) -> None:
    with pytest.raises(UserError) as info:
        load_config(None, [override])
    assert f"key '{key}'" in str(info.value)


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text("train:\n  lr: [1,\n")
    with pytest.raises(UserError, match=rf"{file}:\d+: not valid YAML"):
        load_config(file)


def test_round_trip_through_yaml(tmp_path: Path) -> None:
    config = load_config(REPO / "configs" / "quickstart.yaml", ["train.seed=7"])
    saved = tmp_path / "config.yaml"
    saved.write_text(config.to_yaml())
    assert load_config(saved) == config
