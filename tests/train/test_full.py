"""peft.method=full: every weight trains (no adapter). Resumed exactly, saved as a plain Hugging
Face model directory that transformers loads, generate/export take, and the memory plan counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from cpudist.config import load_config
from cpudist.errors import UserError
from tests.helpers import cli_in_process, signal_after, step_losses, stopped_step, tiny_overrides

STEPS = 6
# A 1 MB shard limit splits the tiny model (13 MB in fp32) into several files with an index.
SETTINGS = {"peft__method": "full", "train__max_steps": STEPS, "train__lr": 1e-3,
            "output__max_shard_mb": 1}


def model_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def test_full_trains_every_weight_resumes_exactly_and_saves_a_hf_model(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tmp_path / "reference"
    done = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, chat_file, reference,
                                                            **SETTINGS)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "frozen-weight sharing: off (peft.method=full" in done.stdout
    assert "full: " in done.stdout and "(100.00%)" in done.stdout
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["val_loss_after"] < summary["val_loss_before"]
    assert not (reference / "adapter").exists()
    saved = reference / "model"
    assert len(list(saved.glob("*.safetensors"))) > 1
    assert (saved / "model.safetensors.index.json").is_file()

    # transformers loads it alone; every weight moved, in fp32, and it is the last checkpoint's.
    trained = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    before = dict(start.named_parameters())
    for name, param in trained.named_parameters():
        if name.endswith("norm.weight"):
            continue  # RMSNorm gains start at 1 and may stay close
        assert not torch.equal(param, before[name]), f"{name} did not train"
    last = model_tensors(reference / "checkpoints" / f"step-{STEPS}" / "model")
    assert last.keys() == model_tensors(saved).keys()
    for name, tensor in model_tensors(saved).items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, last[name])

    # Stopped after 2 steps and resumed: the same losses, bit for bit, and the same model.
    out = tmp_path / "interrupted"
    args = ["train", *tiny_overrides(tiny_llama, chat_file, out, **SETTINGS)]
    with monkeypatch.context() as patch:
        signal_after(patch, 2)
        stopped = cli_in_process(capsys, args)
    assert stopped_step(stopped.stdout) == 2
    files = {p.relative_to(out / "checkpoints" / "step-2").as_posix()
             for p in (out / "checkpoints" / "step-2").rglob("*") if p.is_file()}
    assert {"optimizer.safetensors", "manifest.json", "model/config.json",
            "model/tokenizer.json"} <= files and "trainable.safetensors" not in files
    assert cli_in_process(capsys, [*args, "train.resume=auto"]).returncode == 0
    assert step_losses(out) == step_losses(reference)
    resumed = model_tensors(out / "model")
    for name, tensor in model_tensors(saved).items():
        assert torch.equal(tensor, resumed[name])

    # generate and export take it as a base model.
    answer = cli_in_process(capsys, ["generate", "--base", saved, "--max-new-tokens", "4",
                                     "--dtype", "float32", "hello"])
    assert answer.returncode == 0, answer.stderr[-2000:]
    gguf = tmp_path / "full.gguf"
    exported = cli_in_process(capsys, ["export", "--base", saved, "--out", gguf, "--type", "f32"])
    assert exported.returncode == 0, exported.stderr[-2000:]
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    import numpy as np

    embedding = np.asarray(tensors["token_embd.weight"].data).reshape(-1)
    assert np.allclose(embedding, trained.get_input_embeddings().weight.detach().numpy().reshape(-1))
    wrong = cli_in_process(capsys, ["generate", "--adapter", reference, "hello"])
    assert wrong.returncode != 0 and f"pass --base {saved}" in wrong.stderr


def test_full_refuses_what_it_cannot_train(tiny_llama: Path, chat_file: Path,
                                           tmp_path: Path) -> None:
    base = tiny_overrides(tiny_llama, chat_file, tmp_path / "out", peft__method="full")
    for extra, words in ((["model.quantize=int8"], "model.quantize=none"),
                         (["model.init_adapter=x"], "trains no adapter"),
                         (["train.objective=dpo", "data.format=preference"], "train.objective=orpo")):
        with pytest.raises(UserError, match=words):
            load_config(None, [*base, *extra])


def test_backward_runs_outside_autocast(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside autocast its cache would keep the bf16 copy of every fp32 weight until the context
    ends, past the end of backward where all the fp32 gradients are there too."""
    backward = torch.Tensor.backward
    under_autocast: list[bool] = []

    def recording(self: torch.Tensor, *args: object, **kwargs: object) -> None:
        under_autocast.append(torch.is_autocast_enabled("cpu"))
        backward(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", recording)
    done = cli_in_process(capsys, ["train", *tiny_overrides(
        tiny_llama, chat_file, tmp_path / "out", peft__method="full", model__dtype="bfloat16",
        train__max_steps=2, train__grad_accum=2)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "; dtype bfloat16" in done.stdout  # forward did run under bf16 autocast
    assert len(under_autocast) == 4 and not any(under_autocast)


def test_plan_counts_full_weights_gradients_and_sharded_optimizer(tiny_llama: Path,
                                                                  chat_file: Path,
                                                                  tmp_path: Path) -> None:
    from cpudist.train.plan import GB, estimate, model_parts, total_params

    config = load_config(None, tiny_overrides(tiny_llama, chat_file, tmp_path, peft__method="full"))
    parts = model_parts(config)
    n = total_params(parts)
    assert n == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_llama).parameters())
    plan = estimate(config, parts, 2, (64.0, "test"), "float32")
    assert plan.frozen_gb == {} and not plan.frozen_shared
    assert plan.rank_gb["weights (fp32)"] == pytest.approx(4 * n / GB)
    assert plan.rank_gb["gradients (fp32)"] == pytest.approx(4 * n / GB)
    assert plan.rank_gb["AdamW moments"] == pytest.approx(8 * n / GB)
    assert "DDP gradient buckets" not in plan.rank_gb  # the gradients are the buckets
    config.train.zero = True
    sharded = estimate(config, parts, 2, (64.0, "test"), "float32")
    assert sharded.rank_gb["AdamW moments (1/2, train.zero)"] == pytest.approx(4 * n / GB)
    assert sharded.rank_peak_gb == pytest.approx(plan.rank_peak_gb - 4 * n / GB)
    # A node too small: the advice names train.zero first among what would fit.
    need = plan.node_peak_gb
    sharded_need = sharded.node_peak_gb
    config.train.zero = False
    from cpudist.train.plan import advise

    node = ((need + sharded_need) / 2 / 0.95, "test")
    assert not estimate(config, parts, 2, node, "float32").fits
    assert advise(config, parts, 2, node, "float32")[0] == "train.zero=true"


def test_plan_counts_what_a_trainable_loss_head_keeps_for_backward(tiny_llama: Path,
                                                                    chat_file: Path,
                                                                    tmp_path: Path) -> None:
    from cpudist.model.loss import chunked_lm_loss, padded_rows
    from cpudist.train.plan import GB, estimate, model_parts

    config = load_config(None, tiny_overrides(tiny_llama, chat_file, tmp_path, peft__method="full",
                                              train__loss_chunk_size=100))
    parts = model_parts(config)
    batch, length = config.train.batch_size, config.data.max_length
    head = AutoModelForCausalLM.from_pretrained(tiny_llama).lm_head  # trains, as in full
    hidden = torch.randn(batch, length, parts.hidden, requires_grad=True)
    labels = torch.randint(0, parts.vocab, (batch, length))
    kept: dict[int, int] = {}  # vocabulary-wide tensors autograd saves for backward, by storage
    weight = head.weight.untyped_storage().data_ptr()  # the weight itself is counted elsewhere

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage().data_ptr()
        if tensor.dim() and tensor.shape[-1] == parts.vocab and storage != weight:
            kept[storage] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chunked_lm_loss(hidden, head, labels, config.train.loss_chunk_size)
    plan = estimate(config, parts, 1, (64.0, "test"), "float32").rank_gb["loss head (trains)"]
    weight_grad = parts.vocab * parts.hidden * 4  # made in backward, before it is accumulated
    # Every label row's logit gradient, fp32 here, the rows padded to a multiple of 16 for the
    # GEMMs; the plan counts every position, padded alike (labels shift by one, so a sequence
    # has one label row less).
    assert sum(kept.values()) == padded_rows(batch * (length - 1)) * parts.vocab * 4 > 0
    assert padded_rows(batch * (length - 1)) % 16 == 0
    assert plan * GB - weight_grad == pytest.approx(padded_rows(batch * length) * parts.vocab * 4)
    assert padded_rows(batch * length) >= padded_rows(batch * (length - 1))
    # In bf16 the rows' logit gradients are kept in bf16, half the bytes; the weight's gradient
    # is made in fp32 (a block of rows at a time in bf16 first: no whole bf16 copy).
    bf16 = estimate(config, parts, 1, (64.0, "test"), "bfloat16").rank_gb
    assert bf16["loss head (trains)"] * GB == pytest.approx(
        padded_rows(batch * length) * parts.vocab * 2 + parts.vocab * parts.hidden * 4)
    # On several ranks DDP's buckets hold every gradient beside autocast's bf16 weight copies
    # (the tied head's weight is cast like every linear's); one rank's backward frees each
    # layer's copies as it makes its gradients, so they never add to them.
    two_ranks = estimate(config, parts, 1, (64.0, "test"), "bfloat16", world_size=2).rank_gb
    assert parts.tied and two_ranks["bf16 weight copies (autocast)"] == pytest.approx(
        (parts.linears + parts.embedding) * 2 / GB)
    assert "bf16 weight copies (autocast)" not in bf16
    assert sum(two_ranks.values()) - sum(bf16.values()) == pytest.approx(
        two_ranks["bf16 weight copies (autocast)"])


def test_full_classifier_trains_evaluates_predicts_and_orpo_trains(
        tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A classifier trained in full: head and backbone move; `eval`/`predict --base OUTPUT/model`
    score it as the run did and as plain transformers does; `generate` refuses it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from cpudist.records import read_summary
    from tests.objectives.test_preference import unique_pairs_file
    from tests.train.test_classification import TOPICS, classifier_overrides, topic_files

    train, val = topic_files(tmp_path)
    out = tmp_path / "classifier"
    done = cli_in_process(capsys, ["train", *classifier_overrides(
        tiny_llama, train, val, out, peft__method="full", train__lr=1e-3)])
    assert done.returncode == 0, done.stderr[-3000:]
    saved = out / "model"
    assert json.loads((saved / "classification.json").read_text())["labels"] == [
        "ai", "coding", "psychology", "trivia"]
    model = AutoModelForSequenceClassification.from_pretrained(saved, dtype=torch.float32)
    assert model.config.num_labels == 4
    start = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    layer = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dict(model.named_parameters())[layer],
                           dict(start.named_parameters())[layer])  # the backbone trained too

    # eval takes the run's settings from OUTPUT/config.yaml and gives its last figures.
    evaluated = cli_in_process(capsys, ["eval", "--base", saved, "--data", val, "--json"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    figures, summary = json.loads(evaluated.stdout)["figures"], read_summary(out / "summary.json")
    assert summary is not None
    assert figures["val_loss"] == pytest.approx(summary.eval_after["val_loss"], rel=1e-5)
    assert figures["val_accuracy"] == summary.eval_after["val_accuracy"]
    predictions = tmp_path / "preds.jsonl"
    done = cli_in_process(capsys, ["predict", "--base", saved, "--data", val, "--out",
                                   predictions, "--batch-size", "5"])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(saved)
    model.eval()
    with torch.no_grad():  # plain transformers, one text at a time
        theirs = torch.cat([model(**tokenizer(row["text"], return_tensors="pt")).logits.softmax(-1)
                            for row in rows])
    ours = torch.tensor([[row["scores"][name] for name in sorted(TOPICS)] for row in rows])
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    refused = cli_in_process(capsys, ["generate", "--base", saved, "hello"])
    assert refused.returncode == 2 and "is a classifier" in refused.stderr
    refused = cli_in_process(capsys, ["predict", "--base", tiny_llama, "--data", val, "--out",
                                      tmp_path / "no.jsonl"])
    assert refused.returncode == 2 and "is not a classifier" in refused.stderr

    pairs = tiny_overrides(tiny_llama, unique_pairs_file(tmp_path / "pairs.jsonl"),
                           tmp_path / "orpo", peft__method="full", data__format="preference",
                           train__objective="orpo", train__max_steps=2, train__lr=1e-3)
    orpo = cli_in_process(capsys, ["train", *pairs])
    assert orpo.returncode == 0, orpo.stderr[-3000:]
    assert (tmp_path / "orpo" / "model" / "config.json").is_file()


def test_bench_full_vs_hf_trainer_times_the_same_full_training(tiny_qwen: Path,
                                                               tmp_path: Path) -> None:
    """`bench --method full --vs hf`: both sides train every weight (6 FLOPs per weight and token,
    the head's too) over the same samples; HF's model is fp32 as its full fine-tuning recipe."""
    from tests.bench.test_bench import _bench

    figures, printed = _bench(tiny_qwen, tmp_path, "--method", "full", "--vs", "hf")
    assert "cpudist / hf" in printed
    ours, hf = figures["cpudist"], figures["hf"]
    assert hf["framework"] == "hf-trainer" and ours["config"]["peft"]["method"] == "full"
    assert hf["flop_model"] == ours["flop_model"]
    flops = ours["flop_model"]
    assert flops["n_frozen"] == 0 and flops["n_lora"] > 0 and flops["head_trained"]
    assert ours["tokens_per_s"] * ours["s_per_step"] == pytest.approx(
        hf["tokens_per_s"] * hf["s_per_step"])
