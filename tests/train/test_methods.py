"""IA3 and the prompt-learning methods (prompt tuning, P-tuning, prefix tuning) through the same
paths as LoRA: trained, resumed exactly, saved so that plain PEFT reloads them to the same loss,
merged where they can be (IA3), refused in one line where they cannot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from cpudist.config import Config, load_config
from cpudist.data.batches import collate
from cpudist.data.tokenize import load_tokenized
from cpudist.model.loss import CausalLMLoss
from tests.helpers import cli_in_process, signal_after, step_losses, stopped_step, tiny_overrides

METHODS = ("ia3", "prompt_tuning", "p_tuning", "prefix_tuning")
# Methods of a few hundred to a few thousand parameters move a random model slowly: a bigger lr.
SETTINGS = {"train__max_steps": 6, "train__lr": 5e-2, "prompt__virtual_tokens": 4,
            "prompt__encoder_hidden_size": 16}


@pytest.mark.parametrize("method", METHODS)
def test_method_trains_resumes_and_reloads_in_peft(method: str, tiny_llama: Path, chat_file: Path,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    settings = {"peft__method": method, **SETTINGS}
    reference = tmp_path / "reference"
    done = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, chat_file, reference,
                                                            **settings)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{method}: " in done.stdout and "trainable parameters of" in done.stdout
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["val_loss_after"] < summary["val_loss_before"]
    saved = json.loads((reference / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"].lower() == method
    record = json.loads((reference / "adapter" / "cpudist_base.json").read_text())
    assert record["method"] == method and "lora" not in record

    # Stopped after 2 steps and resumed: the same losses, bit for bit.
    out = tmp_path / "interrupted"
    args = ["train", *tiny_overrides(tiny_llama, chat_file, out, **settings)]
    with monkeypatch.context() as patch:
        signal_after(patch, 2)
        stopped = cli_in_process(capsys, args)
    assert stopped_step(stopped.stdout) == 2
    assert cli_in_process(capsys, [*args, "train.resume=auto"]).returncode == 0
    assert step_losses(out) == step_losses(reference)

    # Plain PEFT reloads the adapter; its own forward gives the loss cpudist's chunked head gives.
    config = load_config(None, tiny_overrides(tiny_llama, chat_file, reference, **settings))
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, reference / "adapter").eval()
    from transformers import AutoTokenizer

    data, _ = load_tokenized(chat_file, AutoTokenizer.from_pretrained(tiny_llama), config.data)
    batch = collate(data, [0, 1, 2], pad_id=0)
    with torch.no_grad():
        ours = CausalLMLoss(model, chunk_size=5)(**batch.as_kwargs())
        theirs = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       labels=batch.labels).loss
    assert float(ours.total / ours.count) == pytest.approx(float(theirs), rel=1e-5)


def test_ia3_merges_and_prompt_learning_is_refused_in_one_line(
        tiny_llama: Path, chat_file: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    runs = {}
    for method in ("ia3", "prompt_tuning"):
        runs[method] = tmp_path / method
        done = cli_in_process(capsys, ["train", *tiny_overrides(
            tiny_llama, chat_file, runs[method], peft__method=method, **SETTINGS)])
        assert done.returncode == 0, done.stderr[-3000:]
    merged = tmp_path / "merged"
    done = cli_in_process(capsys, ["merge", "--adapter", runs["ia3"] / "adapter", "--out", merged])
    assert done.returncode == 0, done.stderr[-3000:]
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, runs["ia3"] / "adapter").eval()(input_ids=ids).logits
        folded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(folded, adapted, atol=1e-5, rtol=1e-5)
    assert (adapted - plain).abs().max() > 1e-4  # the adapter moved the model

    prompt = runs["prompt_tuning"] / "adapter"
    for args in (["merge", "--adapter", prompt, "--out", tmp_path / "m2"],
                 ["export", "--adapter", prompt, "--out", tmp_path / "m.gguf"]):
        refused = cli_in_process(capsys, args)
        assert refused.returncode == 2
        (line,) = refused.stderr.strip().splitlines()
        assert "prompt_tuning adapter" in line and "nothing to fold" in line
    refused = cli_in_process(capsys, ["export", "--adapter", runs["ia3"] / "adapter", "--lora",
                                      "--out", tmp_path / "l.gguf"])
    assert refused.returncode == 2 and "ia3 adapter" in refused.stderr
    assert "export it merged" in refused.stderr
    # generate runs the prompt-learning adapter through PEFT's own generation.
    answered = cli_in_process(capsys, ["generate", "--adapter", prompt, "--max-new-tokens", "3",
                                       "Hello"])
    assert answered.returncode == 0, answered.stderr[-3000:]


def test_settings_that_do_not_go_together_are_refused(tmp_path: Path) -> None:
    from cpudist.errors import UserError

    with pytest.raises(UserError, match="data.packing=true with peft.method=prefix_tuning"):
        load_config(None, ["peft.method=prefix_tuning", "data.packing=true"])
    with pytest.raises(UserError, match="train.objective=classification cannot train on "
                                        "data.format=chat"):
        load_config(None, ["train.objective=classification"])
    with pytest.raises(UserError, match="Did you mean 'peft.method'"):
        load_config(None, ["lora.method=ia3"])
    assert Config().peft.method == "lora"


def test_quantized_base_takes_prompt_tuning_and_refuses_ia3(
        tiny_llama: Path, chat_file: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The prompt-learning methods leave the (quantized) linears alone; IA3 would scale them."""
    quantized = {"model__quantize": "int8", **SETTINGS}
    done = cli_in_process(capsys, ["train", *tiny_overrides(
        tiny_llama, chat_file, tmp_path / "prompt", peft__method="prompt_tuning", **quantized)])
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "prompt" / "summary.json").read_text())
    assert summary["val_loss_after"] < summary["val_loss_before"]
    refused = cli_in_process(capsys, ["train", *tiny_overrides(
        tiny_llama, chat_file, tmp_path / "ia3", peft__method="ia3", **quantized)])
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert "peft.method=ia3" in line and "model.quantize" in line
