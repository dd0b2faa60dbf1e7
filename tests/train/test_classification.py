"""Classification: a head plus a PEFT method on a causal LM (the last real token) and on a
BERT-family encoder (the first token), single- and multi-label. Trained, resumed exactly,
evaluated with the run's own figures, predicted, and reloaded with plain transformers + PEFT to
the same scores."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from cpudist.data.read import resolve_data_path
from cpudist.records import read_summary
from tests.helpers import (
    SCRIPTS,
    cli_in_process,
    metric_records,
    mpirun_cmd,
    run,
    signal_after,
    step_losses,
    stopped_step,
    tiny_overrides,
    write_jsonl,
)

TOPICS = ("ai", "coding", "psychology", "trivia")


def topic_files(root: Path) -> tuple[Path, Path]:
    """chatterbot's questions of four topics: (train file, validation file: every fourth row)."""
    source = resolve_data_path("chatterbot-topics:english", str(root / "corpus"))
    rows = [row for row in map(json.loads, source.read_text().splitlines())
            if row["label"] in TOPICS]
    rows = [row for topic in TOPICS for row in [r for r in rows if r["label"] == topic][:16]]
    return (write_jsonl(root / "train.jsonl", [r for i, r in enumerate(rows) if i % 4]),
            write_jsonl(root / "val.jsonl", rows[::4]))


def classifier_overrides(model: Path, train: Path, val: Path, out: Path, **extra: object
                         ) -> list[str]:
    return tiny_overrides(model, train, out, **{
        "data__format": "classification", "data__val_path": val, "train__max_steps": 6,
        "train__batch_size": 8, "train__lr": 1e-2, "train__eval_batches": "null",
        "prompt__virtual_tokens": 4, **extra})


def reference_scores(model_dir: Path, adapter: Path, texts: list[str], labels: int
                     ) -> torch.Tensor:
    """Softmax scores of plain transformers + PEFT, one text at a time (no padding at all)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=labels, pad_token_id=tokenizer.pad_token_id, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        return torch.cat([model(**tokenizer(text, return_tensors="pt")).logits.softmax(-1)
                          for text in texts])


@pytest.mark.parametrize("method", ["lora", "prompt_tuning"])
def test_causal_lm_classifier_trains_resumes_evaluates_predicts_and_reloads(
        method: str, tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    train, val = topic_files(tmp_path)
    out = tmp_path / "run"
    args = ["train", *classifier_overrides(tiny_llama, train, val, out, peft__method=method,
                                           output__plots=method == "lora")]
    done = cli_in_process(capsys, args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "single-label, 4 labels" in done.stdout, done.stdout[-4000:]
    summary = read_summary(out / "summary.json")
    assert summary is not None
    after = summary.eval_after
    assert after["val_loss"] < summary.eval_before["val_loss"]
    saved = json.loads((out / "adapter" / "classification.json").read_text())
    assert saved["labels"] == sorted(TOPICS)
    val_rows = len(val.read_text().splitlines())
    assert sum(map(sum, saved["confusion"])) == saved["rows"] == val_rows
    assert saved["figures"]["val_accuracy"] == pytest.approx(after["val_accuracy"])
    assert all(0 <= r["accuracy"] <= 1 for r in metric_records(out) if "loss" in r)
    if method == "lora":
        report = (out / "report.html").read_text()
        assert "Confusion matrix" in report and ">psychology</th>" in report

    # Stopped after 2 steps and resumed: the same losses, bit for bit.
    resumed = tmp_path / "resumed"
    args_resumed = [a if not a.startswith("output.dir=") else f"output.dir={resumed}"
                    for a in args]
    with monkeypatch.context() as patch:
        signal_after(patch, 2)
        assert stopped_step(cli_in_process(capsys, args_resumed).stdout) == 2
    assert cli_in_process(capsys, [*args_resumed, "train.resume=auto"]).returncode == 0
    assert step_losses(resumed) == step_losses(out)

    # cpudist eval on the validation file gives the run's own validation figures.
    evaluated = cli_in_process(capsys, ["eval", "--adapter", out / "adapter", "--data", val,
                                        "--json"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    figures = json.loads(evaluated.stdout)["figures"]
    assert figures["val_loss"] == pytest.approx(after["val_loss"], rel=1e-5)
    assert figures["val_accuracy"] == after["val_accuracy"]

    # Predictions (batched, padded) are plain PEFT's scores of each text alone.
    predictions = tmp_path / "preds.jsonl"
    done = cli_in_process(capsys, ["predict", "--adapter", out / "adapter", "--data", val,
                                   "--out", predictions, "--batch-size", "5"])
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(rows) == val_rows and rows[0]["given_label"] in TOPICS
    ours = torch.tensor([[row["scores"][name] for name in sorted(TOPICS)] for row in rows])
    theirs = reference_scores(tiny_llama, out / "adapter", [row["text"] for row in rows], 4)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    assert [row["label"] for row in rows] == [sorted(TOPICS)[int(i)] for i in theirs.argmax(-1)]
    refused = cli_in_process(capsys, ["generate", "--adapter", out / "adapter", "hello"])
    assert refused.returncode == 2 and "is a classifier" in refused.stderr


def animal_rows(count: int) -> list[dict]:
    """Multi-label rows whose labels are the animals the sentence names (zero rows excluded)."""
    animals = ("cat", "dog", "bird")
    rows = []
    for i in range(1, count + 1):
        named = [a for bit, a in enumerate(animals) if (i % 7 + 1) >> bit & 1]
        rows.append({"text": f"In picture {i} we see " + " and a ".join(f"a {a}" for a in named),
                     "labels": named})
    return rows


def test_multi_label_classifier_reports_f1_thresholds_and_predicts_label_sets(
        tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", animal_rows(48))
    val = write_jsonl(tmp_path / "val.jsonl", animal_rows(60)[48:])
    out = tmp_path / "run"
    done = cli_in_process(capsys, ["train", *classifier_overrides(
        tiny_llama, train, val, out, train__max_steps=24, train__lr=2e-2)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "multi-label, 3 labels" in done.stdout and "micro-F1" in done.stdout
    summary = read_summary(out / "summary.json")
    assert summary is not None
    assert summary.eval_after["val_loss"] < summary.eval_before["val_loss"]
    assert {"val_micro_f1", "val_macro_f1", "val_exact_match"} <= set(summary.eval_after)
    saved = json.loads((out / "adapter" / "classification.json").read_text())
    assert saved["multi_label"] and len(saved["thresholds"]) == 3
    assert all(0.0 < t < 1.0 for t in saved["thresholds"])

    evaluated = cli_in_process(capsys, ["eval", "--adapter", out / "adapter", "--data", val])
    assert evaluated.returncode == 0 and "exact match" in evaluated.stdout
    predictions = tmp_path / "preds.jsonl"
    assert cli_in_process(capsys, ["predict", "--adapter", out / "adapter", "--data", val,
                                   "--out", predictions]).returncode == 0
    for row in map(json.loads, predictions.read_text().splitlines()):
        assert set(row["labels"]) <= {"bird", "cat", "dog"}
        thresholds = dict(zip(saved["labels"], saved["thresholds"], strict=True))
        assert row["labels"] == [n for n in saved["labels"] if row["scores"][n] >= thresholds[n]]


def make_tiny_bert(target: Path, texts: list[str]) -> Path:
    """A random BERT (bert-base-uncased's architecture, shrunk) with a WordPiece vocabulary of the
    texts' words, saved as bert-base-uncased is (BertForPreTraining: its pooler too)."""
    from transformers import BertConfig, BertForPreTraining, BertTokenizerFast

    words = sorted({w for text in texts for w in re.findall(r"\w+|[^\w\s]", text.lower())})
    target.mkdir(parents=True)
    vocab = target / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    BertForPreTraining(config).save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return target


def test_encoder_classifier_trains_resumes_and_reloads_in_plain_peft(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    train, val = topic_files(tmp_path)
    texts = [json.loads(line)["text"] for f in (train, val) for line in f.read_text().splitlines()]
    bert = make_tiny_bert(tmp_path / "bert", texts)
    out = tmp_path / "run"
    args = ["train", *classifier_overrides(bert, train, val, out, train__max_steps=8)]
    done = cli_in_process(capsys, args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "single-label, 4 labels" in done.stdout

    resumed = tmp_path / "resumed"
    args_resumed = [a if not a.startswith("output.dir=") else f"output.dir={resumed}"
                    for a in args]
    with monkeypatch.context() as patch:
        signal_after(patch, 3)
        assert stopped_step(cli_in_process(capsys, args_resumed).stdout) == 3
    assert cli_in_process(capsys, [*args_resumed, "train.resume=auto"]).returncode == 0
    assert step_losses(resumed) == step_losses(out)

    predictions = tmp_path / "preds.jsonl"
    assert cli_in_process(capsys, ["predict", "--adapter", out / "adapter", "--data", val,
                                   "--out", predictions, "--batch-size", "4"]).returncode == 0
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    ours = torch.tensor([[row["scores"][name] for name in sorted(TOPICS)] for row in rows])
    theirs = reference_scores(bert, out / "adapter", [row["text"] for row in rows], 4)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("rows", "where", "says"), [
    ([{"text": "a", "label": "x"}, {"text": "b", "label": "y"}, {"text": "c", "label": "z"}],
     "val.jsonl:3", "label 'z' is not one of the classifier's labels (x, y)"),
    ([{"text": "a", "label": "x"}, {"text": "b"}], "val.jsonl:2", "needs a 'label'"),
    ([{"text": "a", "labels": ["x"]}, {"text": "b", "labels": []}], "val.jsonl:2",
     "'labels' is empty"),
])
def test_bad_classification_rows_are_named_by_file_and_line(
        rows: list[dict], where: str, says: str, tiny_llama: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "a", "label": "x"},
                                                    {"text": "b", "label": "y"}] * 4)
    val = write_jsonl(tmp_path / "val.jsonl", rows)
    done = cli_in_process(capsys, ["train", *classifier_overrides(tiny_llama, train, val,
                                                                  tmp_path / "run")])
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert where in line and says in line


def test_classifier_on_a_quantized_base_is_refused(tiny_llama: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    train, val = topic_files(tmp_path)
    done = cli_in_process(capsys, ["train", *classifier_overrides(
        tiny_llama, train, val, tmp_path / "run", model__quantize="int8")])
    assert done.returncode == 2
    assert "a classifier's backbone trains on model.quantize=none" in done.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_two_ranks_train_the_classifier_to_one_ranks_losses(
        tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same global batch of 8 (1 rank x 2 accumulation, or 2 ranks under mpirun): the same
    fp32 losses within 1e-5 and the same held-out figures (on the same capped samples)."""
    train, val = topic_files(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    batch = {"train__batch_size": 4, "train__global_batch": 8, "train__eval_batches": 2}
    done = cli_in_process(capsys, ["train", *classifier_overrides(tiny_llama, train, val, one,
                                                                  **batch)])
    assert done.returncode == 0, done.stderr[-3000:]
    logs = tmp_path / "logs"
    harness = [sys.executable, SCRIPTS / "rank_harness.py", logs]
    result = run([*mpirun_cmd(2), *harness, "train",
                  *classifier_overrides(tiny_llama, train, val, two, **batch)], timeout=300)
    assert result.returncode == 0, (logs / "rank0.err").read_text()[-3000:]
    assert "global batch: 8 = 4 per rank x 1 accumulation x 2 ranks" in (
        logs / "rank0.out").read_text()
    expected, got = step_losses(one), step_losses(two)
    assert [s for s, _ in got] == list(range(1, 7))
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-5)
    summaries = [read_summary(out / "summary.json") for out in (one, two)]
    assert summaries[1] is not None and summaries[1].world_size == 2
    assert summaries[0] is not None
    for when in ("eval_before", "eval_after"):
        first, second = getattr(summaries[0], when), getattr(summaries[1], when)
        assert second["val_accuracy"] == first["val_accuracy"]
        assert second["val_loss"] == pytest.approx(first["val_loss"], rel=1e-5)
