"""Bad input through the CLI: one line `error: ...` naming the file/line/key and what to do,
exit code 2 (3 for a run the memory plan refuses), no traceback (unless --debug). The commands
run in this process (cli_in_process), which spares each case a new interpreter and its imports;
test_a_real_process_keeps_the_contract keeps the process boundary itself: the exit code, stderr,
and --debug's traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import cli_in_process, cpudist_cmd, run, tiny_overrides, write_jsonl

Fails = Callable[[list], str]
Succeeds = Callable[[list], None]


def one_line_error(result: subprocess.CompletedProcess, code: int = 2) -> str:
    """The error contract of a finished `cpudist` (a CompletedProcess): exit status `code`, one
    line on stderr ending in its exit class; returns that line."""
    assert result.returncode == code, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: ")
    assert lines[0].endswith(")]") and f" [exit {code}: " in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def fails(capsys: pytest.CaptureFixture[str]) -> Fails:
    """Run `cpudist ARGS` in this process; check the one-line error contract; return that line."""
    return lambda args: one_line_error(cli_in_process(capsys, args))


@pytest.fixture
def succeeds(capsys: pytest.CaptureFixture[str]) -> Succeeds:
    def check(args: list) -> None:
        result = cli_in_process(capsys, args)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    return check


def train_args(model: Path, data: Path, out: Path, *more: str, **settings: object) -> list:
    return ["train", *tiny_overrides(model, data, out, **settings), *more]


# --------------------------------------------------------------------------- data files


def test_malformed_json_line(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                             fails: Fails) -> None:
    lines = chat_file.read_text().splitlines()
    lines[2] = lines[2][:-5]  # cut off the closing brackets of line 3
    chat_file.write_text("\n".join(lines) + "\n")
    error = fails(train_args(tiny_llama, chat_file, tmp_path / "out"))
    assert f"{chat_file}:3: malformed JSON" in error and "fix or remove that line" in error


def test_missing_fields_for_the_format(tiny_llama: Path, tmp_path: Path, fails: Fails) -> None:
    data = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi", "output": "Hi"},
                                                  {"instruction": "Say bye", "answer": "Bye"}])
    error = fails(train_args(tiny_llama, data, tmp_path / "out", data__format="alpaca"))
    assert f"{data}:2: data.format=alpaca needs fields instruction and output" in error
    assert "missing output" in error


def test_chat_format_without_messages(tiny_llama: Path, alpaca_file: Path, tmp_path: Path,
                                      fails: Fails) -> None:
    error = fails(train_args(tiny_llama, alpaca_file, tmp_path / "out"))  # data.format=chat
    assert f"{alpaca_file}:1: data.format=chat needs a 'messages'" in error


def test_empty_dataset(tiny_llama: Path, tmp_path: Path, fails: Fails) -> None:
    data = tmp_path / "empty.jsonl"
    data.write_text("\n\n")
    error = fails(train_args(tiny_llama, data, tmp_path / "out"))
    assert f"{data}: the dataset is empty" in error


def test_empty_training_split(tiny_llama: Path, tmp_path: Path, fails: Fails) -> None:
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    data = write_jsonl(tmp_path / "two.jsonl", rows * 2)
    error = fails(train_args(tiny_llama, data, tmp_path / "out", data__val_fraction=0.9))
    assert "training split is empty" in error and "data.val_fraction=0.9" in error


def test_fewer_samples_than_one_global_batch(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                             fails: Fails) -> None:
    error = fails(train_args(tiny_llama, chat_file, tmp_path / "out", train__batch_size=64))
    assert "fewer than one global batch" in error and "train.batch_size=64" in error


def test_every_sample_longer_than_max_length(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                             fails: Fails) -> None:
    error = fails(train_args(tiny_llama, chat_file, tmp_path / "out", data__max_length=8))
    assert f"{chat_file}: no sample has a response token within data.max_length=8" in error
    assert "raise data.max_length" in error


def test_non_utf8_text(tiny_llama: Path, chat_file: Path, tmp_path: Path, fails: Fails) -> None:
    with open(chat_file, "ab") as handle:
        handle.write(json.dumps({"text": "caf\u00e9"}).encode("utf-8").replace(b"\\u00e9", b"\xe9"))
        handle.write(b"\n")
    error = fails(train_args(tiny_llama, chat_file, tmp_path / "out"))
    assert f"{chat_file}:33: not UTF-8 text" in error and "re-encode" in error


def test_data_file_missing(tiny_llama: Path, tmp_path: Path, fails: Fails) -> None:
    error = fails(train_args(tiny_llama, tmp_path / "nope.jsonl", tmp_path / "out"))
    assert "data file" in error and "nope.jsonl not found (data.path)" in error


# --------------------------------------------------------------------------- config


def test_unknown_key_on_the_command_line_with_suggestion(tmp_path: Path, fails: Fails) -> None:
    error = fails(["train", "train.bach_size=2", f"output.dir={tmp_path / 'out'}"])
    assert "unknown key 'train.bach_size'" in error and "Did you mean 'train.batch_size'?" in error


def test_unknown_key_in_yaml_names_file_and_line(tmp_path: Path, fails: Fails) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  lr: 1.0e-4\n  warmup: 10\n")
    error = fails(["train", config])
    assert f"{config}:3: unknown key 'train.warmup'" in error
    assert "Did you mean 'train.warmup_steps'?" in error


@pytest.mark.parametrize(("override", "key"), [
    ("train.lr=-1e-4", "train.lr"),
    ("lora.r=0", "lora.r"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.lr=fast", "train.lr"),
    ("model.dtype=float16", "model.dtype"),
])
def test_wrong_type_or_out_of_range(override: str, key: str, tmp_path: Path, fails: Fails) -> None:
    error = fails(["train", override, f"output.dir={tmp_path / 'out'}"])
    assert f"command line: key '{key}'" in error
    assert repr(override.split("=", 1)[1]) in error or override.split("=", 1)[1] in error


def test_out_of_range_in_yaml_names_line(tmp_path: Path, fails: Fails) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("lora:\n  r: 8\n  dropout: 1.5\n")
    error = fails(["train", config])
    assert f"{config}:3: key 'lora.dropout'" in error and "less than 1" in error


# --------------------------------------------------------------------------- model


def test_model_dir_missing(chat_file: Path, tmp_path: Path, fails: Fails) -> None:
    error = fails(train_args(tmp_path / "no-model", chat_file, tmp_path / "out"))
    assert "model.path=" in error and "directory not found" in error


def test_model_dir_without_config(chat_file: Path, tmp_path: Path, fails: Fails) -> None:
    (tmp_path / "empty-model").mkdir()
    error = fails(train_args(tmp_path / "empty-model", chat_file, tmp_path / "out"))
    assert "no config.json in it" in error and "save_pretrained" in error


def test_model_that_is_not_a_causal_lm(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                       fails: Fails) -> None:
    model = tmp_path / "vision"
    shutil.copytree(tiny_llama, model)  # a tokenizer and weights, but an image model's config
    (model / "config.json").write_text(json.dumps({"model_type": "vit",
                                                   "architectures": ["ViTModel"]}))
    error = fails(train_args(model, chat_file, tmp_path / "out"))
    assert f"{model}: not loadable as a causal language model" in error


def test_tokenizer_missing(tiny_llama: Path, chat_file: Path, tmp_path: Path, fails: Fails) -> None:
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (tiny_llama / name).exists():
            shutil.copy(tiny_llama / name, model / name)
    error = fails(train_args(model, chat_file, tmp_path / "out"))
    assert f"{model}: no usable tokenizer" in error and "tokenizer.save_pretrained" in error


def test_lora_target_module_absent(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                   fails: Fails) -> None:
    error = fails(train_args(tiny_llama, chat_file, tmp_path / "out",
                             lora__target_modules="[q_proj,qkv_proj]"))
    assert "lora.target_modules: qkv_proj not in this model" in error and "q_proj" in error


# --------------------------------------------------------------------------- output and resume


def test_output_dir_not_writable(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                 fails: Fails) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    error = fails(train_args(tiny_llama, chat_file, blocker / "out"))
    assert f"output.dir='{blocker / 'out'}' is not writable" in error


def test_existing_output_dir_with_different_config(tiny_llama: Path, chat_file: Path,
                                                   tmp_path: Path, fails: Fails,
                                                   succeeds: Succeeds) -> None:
    out = tmp_path / "out"
    succeeds(train_args(tiny_llama, chat_file, out, train__max_steps=1))
    error = fails(train_args(tiny_llama, chat_file, out, train__max_steps=1, train__lr=1e-3))
    assert f"output directory {out} holds a run with a different config (train.lr)" in error
    assert "output.overwrite=true" in error
    error = fails(train_args(tiny_llama, chat_file, out, train__max_steps=1))
    assert "already holds this run" in error and "train.resume=auto" in error
    succeeds(train_args(tiny_llama, chat_file, out, "output.overwrite=true", train__max_steps=1,
                        train__lr=1e-3))


def test_resume_path_that_is_not_a_checkpoint(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                              fails: Fails) -> None:
    error = fails(train_args(tiny_llama, chat_file, tmp_path / "out", f"train.resume={tmp_path}"))
    assert f"train.resume='{tmp_path}' is not a cpudist checkpoint" in error
    assert "train.resume=auto" in error


def test_a_real_process_keeps_the_contract(tmp_path: Path) -> None:
    """A real `python -m cpudist.cli`: exit code 2 and the one line, no traceback; with --debug,
    exit code 1 and the traceback of the UserError."""
    args = ["train", "lora.r=0", f"output.dir={tmp_path / 'out'}"]
    error = one_line_error(run([*cpudist_cmd(), *args], timeout=300))
    assert "command line: key 'lora.r'" in error
    result = run([*cpudist_cmd(), "--debug", *args], timeout=300)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" in result.stderr and "UserError" in result.stderr


def test_damaged_checkpoint(tiny_llama: Path, chat_file: Path, tmp_path: Path, fails: Fails,
                            succeeds: Succeeds) -> None:
    out = tmp_path / "out"
    args = train_args(tiny_llama, chat_file, out, train__max_steps=1)
    succeeds(args)
    damaged = out / "checkpoints" / "step-1" / "optimizer.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])  # cut short, as by a full disk outside cpudist
    error = fails([*args, "train.resume=auto", "train.max_steps=2"])
    # The manifest names what is wrong; with no older checkpoint to fall back to, an error.
    assert (f"no usable checkpoint in {out / 'checkpoints'} (step-1: optimizer.safetensors has "
            "100 bytes, the manifest says") in error
    assert "train.resume=PATH" in error
    # A checkpoint from before manifests: the loader itself finds the damage.
    (out / "checkpoints" / "step-1" / "manifest.json").unlink()
    error = fails([*args, "train.resume=auto", "train.max_steps=2"])
    assert f"checkpoint {out / 'checkpoints' / 'step-1'} is unreadable" in error
    assert "train.resume=PATH" in error


def test_model_with_only_pickled_weights_is_refused(tiny_llama: Path, chat_file: Path,
                                                    tmp_path: Path, fails: Fails) -> None:
    import torch
    from safetensors.torch import load_file

    model = tmp_path / "pickled"
    shutil.copytree(tiny_llama, model)
    weights = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    torch.save(weights, model / "pytorch_model.bin")  # loading it would mean unpickling
    error = fails(train_args(model, chat_file, tmp_path / "out"))
    assert f"{model}: model weights could not be read" in error
    assert "needs model.safetensors" in error


# --------------------------------------------------------------------------- big models


def test_a_run_too_big_for_the_node_is_refused_before_loading(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        succeeds: Succeeds, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit status 3, its own class: a scheduler must not retry it on the same nodes."""
    args = train_args(tiny_llama, chat_file, tmp_path / "out")
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "300")
    error = one_line_error(cli_in_process(capsys, args), code=3)
    assert "[exit 3: refused by the memory plan" in error
    assert error.startswith("error: this run needs about ") and "the node has 0.3 GB" in error
    assert "(Slurm memory per node)" in error and "train.check_memory=false" in error
    assert not (tmp_path / "out" / "checkpoints").exists()
    succeeds([*args, "train.check_memory=false", "train.max_steps=1"])


def test_unknown_architecture(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                              fails: Fails) -> None:
    model = tmp_path / "unknown"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "llamalike-9000"}))
    error = fails(train_args(model, chat_file, tmp_path / "out"))
    assert f"{model}: not loadable as a causal language model" in error


def test_unsupported_quantize_value(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                    fails: Fails) -> None:
    error = fails(train_args(tiny_llama, chat_file, tmp_path / "out", model__quantize="nf3"))
    assert "command line: key 'model.quantize'" in error and "'int8' or 'int4'" in error


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_truncated_weight_shard(quantize: str, tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                fails: Fails) -> None:
    model = tmp_path / "cut"
    shutil.copytree(tiny_llama, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    error = fails(train_args(model, chat_file, tmp_path / "out", model__quantize=quantize,
                             model__cache_dir=tmp_path / "cache"))
    assert f"{weights}: truncated" in error and "copy the model directory again" in error


# --------------------------------------------------------------------------- counts given as flags


@pytest.mark.parametrize(("args", "error"), [
    (["scaling", "--total-threads", "-1"], "cpudist scaling: argument --total-threads: -1"),
    (["scaling", "--total-threads", "0"], "cpudist scaling: argument --total-threads: 0"),
    (["scaling", "--fake-nodes", "0", "--link", "1gbit"],
     "cpudist scaling: argument --fake-nodes: 0"),
    (["hostfile", "check", "hosts", "--np", "-2"],
     "cpudist hostfile check: argument --np/-np: -2"),
    (["fake-cluster", "up", "-1"], "cpudist fake-cluster: argument count: -1"),
    (["launch", "-np", "0", "--", "train"], "cpudist launch: argument -np/-n/--np: 0"),
    (["launch", "-np", "2", "--threads-per-rank", "0", "--", "train"],
     "cpudist launch: argument --threads-per-rank: 0"),
    (["bench", "--steps", "0"], "cpudist bench: argument --steps: 0"),
    (["eval", "--base", "m", "--data", "d", "--max-new-tokens", "0"],
     "cpudist eval: argument --max-new-tokens: 0"),
    (["generate", "--base", "m", "--max-new-tokens", "0", "hi"],
     "cpudist generate: argument --max-new-tokens: 0"),
])
def test_a_count_below_one_is_refused_by_argparse(args: list[str], error: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Before anything runs: one line naming the flag and what it must be."""
    result = cli_in_process(capsys, args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {error} must be at least 1 (")
