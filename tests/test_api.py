"""The Python API (cpudist.api, exported by `import cpudist`), in this process on a tiny model:
the calls of README's "Python API" section."""

from __future__ import annotations

from pathlib import Path

import pytest

import cpudist
from cpudist.records import RunSummary
from tests.helpers import process_state_kept, signal_after, step_losses, tiny_overrides


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
