"""Training a tiny random model end to end: loss falls, only LoRA moves, the adapter reloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cpudist.config import load_config
from cpudist.train import engine
from cpudist.train.run import train
from tests.helpers import cli_in_process, process_state_kept, tiny_overrides


def _spy_on_model(monkeypatch: pytest.MonkeyPatch) -> dict:
    captured: dict = {}
    original = engine.build_model

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        model, tokenizer, path = original(*args, **kwargs)
        captured["model"] = model
        captured["before"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return model, tokenizer, path

    monkeypatch.setattr(engine, "build_model", spy)
    return captured


def test_loss_falls_only_lora_changes_and_adapter_reloads(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from peft import PeftModel

    captured = _spy_on_model(monkeypatch)
    out = tmp_path / "run"
    config = load_config(None, tiny_overrides(tiny_llama, chat_file, out, train__max_steps=8,
                                              train__lr=1e-2))
    with process_state_kept():
        summary = train(config)
    assert summary is not None

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 8
    assert sum(losses[-2:]) < sum(losses[:2])
    assert summary.eval_after["val_loss"] < summary.eval_before["val_loss"]

    model = captured["model"]
    after = dict(model.named_parameters())
    changed = {n for n, before in captured["before"].items() if not torch.equal(before, after[n])}
    assert changed, "training changed nothing"
    assert all("lora_" in n for n in changed), sorted(changed)[:5]
    assert any("lora_B" in n for n in changed)

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, out / "adapter").eval()
    model.eval()
    ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


# Gemma 2: eager attention (it has no sdpa path) and soft-capped logits in the chunked head.
@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_gemma2"])
def test_cli_run_writes_the_documented_outputs(fixture: str, request: pytest.FixtureRequest,
                                               chat_file: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    result = cli_in_process(capsys, ["train", *tiny_overrides(request.getfixturevalue(fixture),
                                                              chat_file, out, train__save_every=2)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "validation loss: before" in result.stdout
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "adapter/adapter_config.json",
                 "adapter/adapter_model.safetensors", "checkpoints/step-4/state.json",
                 "checkpoints/step-2/adapter/adapter_model.safetensors"):
        assert (out / name).exists(), name
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert {"step", "loss", "lr", "tokens_per_s", "elapsed"} <= set(first)
    summary = json.loads((out / "summary.json").read_text())
    for key in ("steps", "train_loss", "val_loss_before", "val_loss_after", "wall_s",
                "tokens_per_s", "peak_rss_gb"):
        assert key in summary, key
    assert summary["steps"] == 4
    times = summary["time"]
    parts = ("setup_s", "data_s", "eval_s", "train_s", "other_s")
    assert all(times[key] >= 0 for key in parts) and times["train_s"] > 0
    assert sum(times[key] for key in parts) == pytest.approx(times["wall_s"], rel=1e-6)
    assert times["goodput"] == pytest.approx(times["train_s"] / times["wall_s"])
    assert "time: setup" in result.stdout and "goodput" in result.stdout


def test_activation_checkpointing_gives_the_same_losses(tiny_llama: Path, chat_file: Path,
                                                        tmp_path: Path) -> None:
    losses = []
    for flag in (False, True):
        out = tmp_path / f"ckpt-{flag}"
        config = load_config(None, tiny_overrides(tiny_llama, chat_file, out,
                                                  model__gradient_checkpointing=flag))
        with process_state_kept():
            train(config)
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in records if "loss" in r])
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-5, atol=1e-6)


def test_global_batch_trains_alike_whatever_the_micro_batch(
        tiny_llama: Path, chat_file: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """train.global_batch=8 as 2 x 4 rows (batch_size=auto) or 4 x 2 rows (batch_size=2): the same
    losses, since a step's loss is the mean over every label token of its global batch."""
    losses, outs = [], []
    for batch in ("auto", 2):
        out = tmp_path / f"batch-{batch}"
        done = cli_in_process(capsys, ["train", *tiny_overrides(
            tiny_llama, chat_file, out, train__batch_size=batch, train__global_batch=8)])
        assert done.returncode == 0, done.stderr[-3000:]
        micro, accum = (4, 2) if batch == "auto" else (2, 4)
        assert f"global batch 8 = 1 rank(s) x micro-batch {micro} x {accum} accumulation" in done.stdout
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in records if "loss" in r])
        outs.append(out)
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-4, atol=1e-6)
    assert "batch_size: auto" in (outs[0] / "config.yaml").read_text()  # kept as the user gave it
    assert json.loads((outs[0] / "summary.json").read_text())["global_batch"] == 8


def test_training_with_packing_matches_padding(tiny_qwen: Path, chat_file: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    losses = {}
    for packing in (False, True):
        out = tmp_path / f"packing-{packing}"
        result = cli_in_process(capsys, ["train", *tiny_overrides(
            tiny_qwen, chat_file, out, data__packing=packing, train__max_steps=2,
            data__group_by_length=False, train__eval_batches=1)])
        assert result.returncode == 0, result.stderr[-2000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[packing] = [r["loss"] for r in records if "loss" in r]
    assert len(losses[True]) == 2
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


