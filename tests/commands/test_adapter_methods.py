"""rsLoRA and DoRA through the same paths as LoRA: trained, resumed exactly, merged into a plain
model with the numbers of base + adapter, and saved so that PEFT reloads them from anywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.helpers import cli_in_process, signal_after, step_losses, stopped_step, tiny_overrides

STEPS = 6


@pytest.mark.parametrize("method", ["use_rslora", "use_dora"])
def test_method_trains_resumes_and_merges(method: str, tiny_llama: Path, chat_file: Path,
                                          tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    settings = {f"lora__{method}": True, "train__max_steps": STEPS, "train__lr": 3e-2}
    reference = tmp_path / "reference"
    done = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, chat_file, reference,
                                                            **settings)])
    assert done.returncode == 0, done.stderr[-3000:]
    adapter = reference / "adapter"
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved[method] is True
    # Reloadable from anywhere: the base is named by its absolute path.
    assert saved["base_model_name_or_path"] == str(tiny_llama.resolve())

    # Stopped after 2 steps and resumed: the same losses, bit for bit.
    out = tmp_path / "interrupted"
    args = ["train", *tiny_overrides(tiny_llama, chat_file, out, **settings)]
    with monkeypatch.context() as patch:
        signal_after(patch, 2)
        stopped = cli_in_process(capsys, args)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert stopped_step(stopped.stdout) == 2
    resumed = cli_in_process(capsys, [*args, "train.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert step_losses(out) == step_losses(reference)

    # Merged: a plain model with base + adapter's numbers, and the adapter really moved them.
    merged_dir = tmp_path / "merged"
    done = cli_in_process(capsys, ["merge", "--base", tiny_llama, "--adapter", adapter,
                                   "--out", merged_dir])
    assert done.returncode == 0, done.stderr[-3000:]
    ids = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
        base_logits = base(input_ids=ids).logits
        with_adapter = PeftModel.from_pretrained(base, adapter).eval()
        adapted = with_adapter(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, atol=1e-4, rtol=1e-4)
    assert (adapted - base_logits).abs().max() > 1e-3


def test_dora_on_a_quantized_base_is_refused(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    done = cli_in_process(capsys, ["train", *tiny_overrides(
        tiny_llama, chat_file, tmp_path / "run", lora__use_dora=True, model__quantize="int8",
        model__cache_dir=tmp_path / "models")])
    assert done.returncode == 2
    assert "lora.use_dora=true" in done.stderr and "model.quantize" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
