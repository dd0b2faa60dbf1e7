"""cpudist merge / generate / eval against a real (tiny) training run and the real SmolLM2."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from cpudist.cli import main
from cpudist.config import Config, DataConfig, DistConfig, LoraConfig, ModelConfig, TrainConfig, load_config
from cpudist.data.tokenize import IGNORE, load_tokenized, tokenize_records
from cpudist.infer.evaluate import evaluate_file
from cpudist.infer.generate import generate, prompt_ids
from cpudist.infer.session import Session, open_session
from cpudist.objectives.sft import SFT
from cpudist.runtime.process import start_process
from tests.helpers import (
    CHAT_ROWS,
    cli_in_process,
    process_state_kept,
    tiny_overrides,
    write_jsonl,
)

STEPS = 16
VAL_ROWS = CHAT_ROWS[:5]


def _chat_rows(pairs: list[tuple[str, str]]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in pairs]


@pytest.fixture(scope="module")
def trained(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A real `cpudist train` run of the tiny Llama with a separate validation file."""
    root = tmp_path_factory.mktemp("tools")
    train_file = write_jsonl(root / "train.jsonl", _chat_rows(CHAT_ROWS * 4))
    val_file = write_jsonl(root / "val.jsonl", _chat_rows(VAL_ROWS))
    out = root / "run"
    overrides = tiny_overrides(tiny_llama, train_file, out, data__val_path=val_file,
                               train__max_steps=STEPS, train__lr=3e-2, train__eval_batches="null")
    with process_state_kept():
        assert main(["train", *map(str, overrides)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    return {"base": tiny_llama, "out": out, "val": val_file, "summary": summary,
            "overrides": overrides}


def _session(base: Path, adapter: Path | None = None, data: Path | None = None,
             batch_size: int = 4) -> Session:
    """The model as `cpudist eval`/`generate` load it (float32, 64-token samples)."""
    config = Config(model=ModelConfig(path=str(base), dtype="float32"),
                    data=DataConfig(path=str(data or "chatterbot:english"), format="chat",
                                    max_length=64, val_fraction=0.0,
                                    cache_dir=str(Path(data).parent / "data-cache") if data
                                    else ".cache/data"),
                    train=TrainConfig(batch_size=batch_size))
    with process_state_kept(), start_process(DistConfig()) as process:
        return open_session(config, process, str(adapter) if adapter else None)


def _ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 2000, (2, 16))


def _adapter_deltas(adapter: Path) -> dict[str, torch.Tensor]:
    """What a saved adapter adds to each of the base's weights (alpha / r * B @ A), by the base's
    tensor name."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert not (config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"))
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(adapter / "adapter_model.safetensors")
    return {key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight"):
            scale * tensors[key.replace(".lora_A.", ".lora_B.")].float() @ tensors[key].float()
            for key in tensors if ".lora_A." in key}


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.eval()(input_ids=ids).logits


def test_saved_adapter_reloads_with_plain_peft_to_the_trained_weights(trained: dict) -> None:
    from peft import PeftModel, set_peft_model_state_dict

    from cpudist.model.load import build_model
    from cpudist.runtime.precision import choose_precision
    from cpudist.train.checkpoint import load_checkpoint

    # The trained model as the trainer itself rebuilds it on resume: its own model builder plus
    # the LoRA tensors of the final checkpoint.
    config = load_config(None, trained["overrides"])
    model, _, _ = build_model(config, choose_precision(config.model.dtype))
    checkpoint = load_checkpoint(trained["out"] / "checkpoints" / f"step-{STEPS}")
    set_peft_model_state_dict(model, checkpoint.adapter_tensors)

    base = AutoModelForCausalLM.from_pretrained(trained["base"], dtype=torch.float32)
    base_logits = _logits(base, _ids())
    reloaded = PeftModel.from_pretrained(base, trained["out"] / "adapter")
    ids = _ids()
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids))
    # The adapter is not a no-op: training moved the outputs.
    assert (_logits(reloaded, ids) - base_logits).abs().max() > 1e-3


def test_merged_model_loads_without_peft_and_matches_base_plus_adapter(
        trained: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from peft import PeftModel

    merged_dir = tmp_path / "merged"
    result = cli_in_process(capsys, ["merge", "--base", trained["base"], "--adapter",
                  trained["out"] / "adapter", "--out", merged_dir])
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (merged_dir / name).is_file(), name
    assert not (merged_dir / "adapter_config.json").exists()
    with safe_open(merged_dir / "model.safetensors", "pt") as handle:
        keys = list(handle.keys())
    assert keys and not any("lora" in key or "base_layer" in key for key in keys), keys[:5]
    assert json.loads((merged_dir / "config.json").read_text())["use_cache"] is True

    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert type(merged).__name__ == "LlamaForCausalLM"
    base = AutoModelForCausalLM.from_pretrained(trained["base"], dtype=torch.float32)
    ids = _ids()
    base_logits = _logits(base, ids)
    peft_logits = _logits(PeftModel.from_pretrained(base, trained["out"] / "adapter"), ids)
    # What the adapter does to the logits; every tolerance below is small beside it, so a merge
    # that lost, halved or doubled the adapter fails.
    effect = float((peft_logits - base_logits).norm())
    assert effect > 0.2 * float(base_logits.norm()), "the trained adapter barely moves the logits"
    merged_logits = _logits(merged, ids)
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-4, rtol=1e-4)
    assert float((merged_logits - base_logits).norm()) == pytest.approx(effect, rel=1e-3)

    # The merged directory is a base model for the other tools, with the same numbers.
    as_base = evaluate_file(_session(merged_dir, data=trained["val"]))
    assert as_base.loss == pytest.approx(trained["summary"]["val_loss_after"], rel=1e-4)

    # Writing over it needs --force.
    assert cli_in_process(capsys, ["merge", "--base", trained["base"], "--adapter",
                                   trained["out"] / "adapter", "--out", merged_dir]).returncode == 2
    assert cli_in_process(capsys, ["merge", "--base", trained["base"], "--adapter",
                                   trained["out"] / "adapter", "--out", merged_dir, "--force",
                                   "--dtype", "bfloat16"]).returncode == 0
    with safe_open(merged_dir / "model.safetensors", "pt") as handle:
        names = list(handle.keys())
        assert {handle.get_tensor(name).dtype for name in names} == {torch.bfloat16}
    half_logits = _logits(AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32), ids)
    # bf16 weights move the logits by about 0.1 % of the adapter's effect here.
    assert float((half_logits - peft_logits).norm()) < 0.02 * effect
    assert float((half_logits - base_logits).norm()) == pytest.approx(effect, rel=0.02)
    # The final norm flattens how much of the adapter reaches the logits (90 % of it moves them
    # by only 1.4 % of its effect), so the bf16 weights are checked too: they differ from the
    # base's by what the adapter adds, to bf16's rounding (0.2 %; 90 % of the adapter: 10 %).
    base_weights = load_file(Path(trained["base"]) / "model.safetensors")
    half_weights = load_file(merged_dir / "model.safetensors")
    error = added = 0.0
    for key, delta in _adapter_deltas(trained["out"] / "adapter").items():
        moved = half_weights[key].float() - base_weights[key].float()
        error += float((moved - delta).norm()) ** 2
        added += float(delta.norm()) ** 2
    assert added > 0 and math.sqrt(error / added) < 0.01


def test_eval_reproduces_the_trainers_validation_numbers(
        trained: dict, capsys: pytest.CaptureFixture[str]) -> None:
    summary = trained["summary"]
    common = ["--base", trained["base"], "--data", trained["val"], "--format", "chat",
              "--max-length", "64", "--batch-size", "4", "--dtype", "float32", "--json"]
    result = cli_in_process(capsys, ["eval", "--adapter", trained["out"] / "adapter", *common])
    assert result.returncode == 0, result.stderr[-3000:]
    after = json.loads(result.stdout.strip().splitlines()[-1])
    assert after["loss"] == pytest.approx(summary["val_loss_after"], rel=1e-4)
    assert after["perplexity"] == pytest.approx(summary["val_ppl_after"], rel=1e-4)
    assert after["samples"] == len(VAL_ROWS)

    # Without the adapter: the base model's loss, which the run logged before training.
    before = evaluate_file(_session(trained["base"], data=trained["val"]))
    assert before.loss == pytest.approx(summary["val_loss_before"], rel=1e-4)
    assert after["loss"] < before.loss

    # Token accuracy and loss checked independently with full logits from plain transformers.
    session = _session(trained["base"], trained["out"] / "adapter", trained["val"])
    model, tokenizer = session.model, session.tokenizer
    data, _ = load_tokenized(Path(trained["val"]), tokenizer,
                             DataConfig(format="chat", max_length=64,
                                        cache_dir=str(trained["out"].parent / "data-cache")))
    correct = count = 0
    loss_sum = 0.0
    with torch.no_grad():
        for ids, labels in zip(data.input_ids, data.labels, strict=True):
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            targets = torch.tensor(labels[1:])
            keep = targets != IGNORE
            correct += int((logits[keep].argmax(-1) == targets[keep]).sum())
            loss_sum += float(torch.nn.functional.cross_entropy(logits[keep], targets[keep],
                                                                reduction="sum"))
            count += int(keep.sum())
    assert after["label_tokens"] == count
    assert after["token_accuracy"] == pytest.approx(correct / count)
    assert correct > 0, "the tiny run should have learnt some tokens; the check would be empty"
    assert after["loss"] == pytest.approx(loss_sum / count, rel=1e-4)

    # Batching does not change the figures (OUTPUT/ itself resolves to OUTPUT/adapter).
    other = evaluate_file(_session(trained["base"], trained["out"], trained["val"], batch_size=2))
    assert other.loss == pytest.approx(after["loss"], rel=1e-4)
    assert math.isclose(other.token_accuracy, after["token_accuracy"])


def test_eval_takes_unset_settings_from_the_adapters_run(trained: dict,
                                                         capsys: pytest.CaptureFixture) -> None:
    # No --format/--max-length/--batch-size/--dtype: the run's config.yaml supplies them
    # (max_length 64 and float32 here, not the schema defaults 512 and auto).
    captured = cli_in_process(capsys, ["eval", "--base", trained["base"], "--adapter",
                                       trained["out"] / "adapter", "--data", trained["val"]])
    assert captured.returncode == 0, captured.stderr
    assert "data.max_length=64" in captured.stderr and "model.dtype=float32" in captured.stderr
    loss = float(re.search(r"^loss (\S+)", captured.stdout, re.M).group(1))  # type: ignore[union-attr]
    assert loss == pytest.approx(trained["summary"]["val_loss_after"], abs=1e-4)
    assert "token accuracy" in captured.stdout and "perplexity" in captured.stdout


def test_generation_prompt_is_the_training_prompt(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    question, answer = CHAT_ROWS[0]
    for system in (None, "Answer briefly."):
        split, _ = tokenize_records(_chat_rows([(question, answer)]), tokenizer,
                                    DataConfig(system_prompt=system), "mem.jsonl")
        (expected,) = SFT(Config()).held_out_prompts(split, 1)
        assert prompt_ids(tokenizer, question, system) == expected.ids
    text = tokenizer.decode(prompt_ids(tokenizer, question, "Answer briefly."))
    assert "Answer briefly." in text and text.endswith("<|im_start|>assistant\n")


def test_user_errors_are_one_line_and_name_the_culprit(
        trained: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base, val = str(trained["base"]), str(trained["val"])
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(trained["out"] / "adapter" / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    cases = [
        (["eval", "--base", base, "--adapter", str(tmp_path / "missing"), "--data", val],
         str(tmp_path / "missing")),
        (["generate", "--base", base, "--adapter", str(tmp_path), "hi"], "adapter_config.json"),
        (["eval", "--base", str(tmp_path / "nomodel"), "--data", val], "--base"),
        (["eval", "--base", str(tmp_path), "--data", val], "config.json"),
        (["eval", "--base", base, "--data", str(tmp_path / "nodata.jsonl")], "nodata.jsonl"),
        (["eval", "--base", base, "--data", val, "--batch-size", "0"], "--batch-size"),
        (["eval", "--base", base, "--adapter", str(pickled), "--data", val],
         "adapter_model.safetensors"),
        (["merge", "--base", base, "--adapter", str(tmp_path / "missing"),
          "--out", str(tmp_path / "m")], "missing"),
    ]
    for argv, needle in cases:
        done = cli_in_process(capsys, argv)
        assert done.returncode == 2, argv
        err = done.stderr.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        assert needle in err, (needle, err)
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_generate_answers_with_smollm2_and_a_zero_adapter_changes_nothing(
        smol_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cpudist.model.adapters import apply_adapter

    question = "What is the capital of France?"
    plain = cli_in_process(capsys, ["generate", "--base", smol_dir, "--max-new-tokens", "24",
                 "--dtype", "float32", question])
    assert plain.returncode == 0, plain.stderr[-3000:]
    answer = plain.stdout.strip()
    assert answer and "Paris" in answer, answer

    # A freshly initialised LoRA adapter (B = 0) is the identity: same greedy answer.
    base = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    apply_adapter(base, Config(lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
                  ).save_pretrained(
        tmp_path / "adapter")
    with_adapter = cli_in_process(capsys, ["generate", "--base", smol_dir, "--adapter",
                        tmp_path / "adapter", "--max-new-tokens", "24", "--dtype", "float32",
                        "--system", "You are a helpful AI assistant named SmolLM, trained by "
                        "Hugging Face", question])
    assert with_adapter.returncode == 0, with_adapter.stderr[-3000:]
    assert with_adapter.stdout.strip() == answer

    # What streamed to stdout is the whole answer.
    session = _session(smol_dir)
    assert generate(session, prompt_ids(session.tokenizer, question, None), 24) == answer


def test_a_quantized_run_evaluates_and_merges_into_its_dequantized_base(
        tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """eval and merge take model.quantize from the adapter's run; the merged model computes what
    the quantized base plus the adapter computes (the base dequantized, not the original)."""
    from peft import PeftModel

    from cpudist.model.quantize import dequantize_linears

    train_file = write_jsonl(tmp_path / "train.jsonl", _chat_rows(CHAT_ROWS * 4))
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_llama, train_file, out, model__quantize="int4",
                               model__quantize_group=32, model__cache_dir=tmp_path / "cache",
                               train__max_steps=6, train__lr=3e-2)
    trained = cli_in_process(capsys, ["train", *overrides])
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "decoder linears int4" in trained.stdout
    summary = json.loads((out / "summary.json").read_text())

    evaluated = cli_in_process(capsys, ["eval", "--base", tiny_llama, "--adapter", out / "adapter",
                     "--data", train_file, "--json"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "model.quantize=int4" in evaluated.stderr  # taken from the run's config

    merged_dir = tmp_path / "merged"
    merged = cli_in_process(capsys, ["merge", "--base", tiny_llama, "--adapter", out / "adapter",
                  "--out", merged_dir])
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert "model.quantize=int4" in merged.stderr

    # Reference: the quantized base as training mapped it, dequantized, plus the adapter.
    config = load_config(None, overrides)
    from cpudist.model.load import load_for_inference, resolve_model_path
    from cpudist.runtime.precision import choose_precision

    base, _ = load_for_inference(config.model, resolve_model_path(config.model), None,
                                 choose_precision("float32"))
    dequantize_linears(base)
    reference = PeftModel.from_pretrained(base, out / "adapter")
    ids = _ids()
    merged_model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    torch.testing.assert_close(_logits(merged_model, ids), _logits(reference, ids), atol=1e-4,
                               rtol=1e-4)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    assert (_logits(merged_model, ids) - _logits(plain, ids)).abs().max() > 1e-3
    assert summary["steps"] == 6
