"""The Python API (cpudist.api, exported by `import cpudist`), in this process on a tiny model:
README's "Python API" block run as it is, and what it leaves out (resume, predict, errors)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

import cpudist
from cpudist.records import DataEvalResult, ExportedGGUF, RunSummary, TaskEvalResult
from tests.helpers import (
    REPO,
    process_state_kept,
    signal_after,
    step_losses,
    tiny_overrides,
)


def settings(model: Path, data: Path, out: Path, **extra: object) -> dict[str, object]:
    """tiny_overrides as the API's mapping, with Python values."""
    return {item.split("=", 1)[0]: item.split("=", 1)[1]
            for item in tiny_overrides(model, data, out, **extra)}


def test_train_returns_the_summary_and_resumes(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    given = {**settings(tiny_llama, chat_file, out), "train.max_steps": 4}
    with process_state_kept(), monkeypatch.context() as patch:
        signal_after(patch, 2)
        with pytest.raises(cpudist.Preempted) as stopped:
            cpudist.train(None, given)
    assert stopped.value.step == 2 and stopped.value.exit_code == 75
    with process_state_kept():
        summary = cpudist.train(None, {**given, "train.resume": "auto"})
    assert isinstance(summary, RunSummary)
    assert summary.steps == 4 and [s for s, _ in step_losses(out)] == [1, 2, 3, 4]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_plan_and_bad_input_raise_user_error(tiny_llama: Path, tmp_path: Path) -> None:
    config = cpudist.make_config(None, [f"model.path={tiny_llama}", "train.batch_size=2"])
    plan = cpudist.plan(config, {"model.gradient_checkpointing": True}, ranks_per_node=2)
    assert plan.ranks_per_node == 2 and plan.node_peak_gb > 0
    with pytest.raises(cpudist.UserError, match="override train.max_steps: .*got 'many'"):
        cpudist.make_config(config, {"train.max_steps": "many"})
    with pytest.raises(cpudist.UserError, match="must be section.key"):
        cpudist.make_config(None, {"max_steps": 3})
    with pytest.raises(cpudist.UserError, match="config file nowhere.yaml not found"):
        cpudist.train("nowhere.yaml")


def readme_api_block() -> str:
    """The python block of README's "Python API" section."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Python API\n"):]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "no python block in README's Python API section"
    return found.group(1)


def test_the_readme_block_runs_as_written(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """README's block, in a directory whose configs/quickstart.yaml names the tiny model (the same
    settings otherwise), runs through: train, plan, a refused override, evaluate on data and on
    the task, generate, merge and export, each returning its record."""
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    config["model"] = {"path": str(tiny_llama), "dtype": "float32"}
    config["data"].update(path=str(chat_file), max_length=64, val_fraction=0.25)
    config["train"].update(batch_size=4, eval_batches=2, save_every=10, max_new_tokens=8)
    (tmp_path / "configs" / "tasks").mkdir(parents=True)
    (tmp_path / "configs" / "quickstart.yaml").write_text(yaml.safe_dump(config))
    task_file = Path("configs/tasks/chatterbot-trivia-mc.jsonl")
    shutil.copy(REPO / task_file, tmp_path / task_file)
    monkeypatch.chdir(tmp_path)
    names: dict[str, object] = {}
    with process_state_kept():
        exec(compile(readme_api_block(), "README.md (Python API)", "exec"), names)
    printed = capsys.readouterr().out
    assert isinstance(names["summary"], RunSummary) and names["summary"].steps == 20
    assert "override train.max_steps:" in printed  # the UserError, caught and printed
    scores, task, gguf = names["scores"], names["task"], names["gguf"]
    assert isinstance(scores, DataEvalResult) and scores.samples > 0 and scores.loss > 0
    assert isinstance(task, TaskEvalResult) and task.items == 30 and task.after is not None
    saved = json.loads(Path("runs/quickstart/eval.json").read_text())
    assert task.task in json.dumps(saved)
    assert (Path(str(names["merged"])) / "model.safetensors").is_file()
    assert isinstance(gguf, ExportedGGUF) and gguf.file_type == "q8_0"
    assert Path(gguf.path).stat().st_size > 0 and gguf.base == str(tiny_llama)


def test_predict_and_the_errors_of_the_trained_model_functions(tiny_llama: Path, tmp_path: Path
                                                               ) -> None:
    """predict: a classifier's rows, the same as written to out; bad arguments of evaluate,
    generate, merge and export are one-line UserErrors raised before any model loads."""
    from tests.train.test_classification import classifier_overrides, topic_files

    train, val = topic_files(tmp_path)
    out = tmp_path / "classifier"
    given = classifier_overrides(tiny_llama, train, val, out, train__max_steps=2)
    with process_state_kept():
        cpudist.train(None, given)
        rows = cpudist.predict(out / "adapter", val, tmp_path / "preds.jsonl", batch_size=3)
    written = [json.loads(line) for line in (tmp_path / "preds.jsonl").read_text().splitlines()]
    assert rows == written and len(rows) == len(val.read_text().splitlines())
    assert {"label", "scores", "given_label"} <= rows[0].keys()
    adapter = out / "adapter"
    with pytest.raises(cpudist.UserError, match="is a classifier"):
        cpudist.generate("hello", adapter)
    with pytest.raises(cpudist.UserError, match="give data=FILE .* or task=FILE"):
        cpudist.evaluate(adapter)
    with pytest.raises(cpudist.UserError, match="dtype='float16': choose one of auto, float32"):
        cpudist.evaluate(adapter, data=val, dtype="float16")
    with pytest.raises(cpudist.UserError, match="max_new_tokens=0: give a whole number"):
        cpudist.generate("hello", base=tiny_llama, max_new_tokens=0)
    with pytest.raises(cpudist.UserError, match="type='q9': choose one of f32"):
        cpudist.export(tmp_path / "x.gguf", base=tiny_llama, type="q9")
    with pytest.raises(cpudist.UserError, match="--base MODEL is required without --adapter"):
        cpudist.generate("hello")
    with pytest.raises(cpudist.UserError, match="nowhere: directory not found"):
        cpudist.predict(tmp_path / "nowhere", val)
