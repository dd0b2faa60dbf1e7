"""DPO and ORPO: equal to TRL's trainers on one fixed batch (losses and LoRA gradients, fp32), the
first DPO loss of a fresh adapter is ln 2, the precomputed reference is cached and read back, a
stopped run resumes exactly, an SFT adapter is a start point (model.init_adapter), and the 2-rank
run equals the 1-rank run (through a resume on another world size)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cpudist.config import load_config
from cpudist.data.formats import preference
from cpudist.data.preference import PreferenceSplit, tokenize_pair
from cpudist.data.tokenize import IGNORE
from cpudist.objectives.preference import PairLoss, collate_pairs
from cpudist.objectives.reference import Reference
from tests.helpers import (
    CHAT_ROWS,
    SCRIPTS,
    cli_in_process,
    lora_model,
    metric_records,
    mpirun_cmd,
    run,
    signal_after,
    step_losses,
    tiny_overrides,
    write_jsonl,
)

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def chat_pairs(count: int = 8) -> list[dict[str, Any]]:
    """Pairs in TRL's conversational format: each question's answer chosen, another's rejected."""
    rows = (CHAT_ROWS * (1 + count // len(CHAT_ROWS)))[:count]
    return [{"prompt": [{"role": "user", "content": q}],
             "chosen": [{"role": "assistant", "content": a}],
             "rejected": [{"role": "assistant", "content": CHAT_ROWS[(i + 3) % len(CHAT_ROWS)][1]}]}
            for i, (q, a) in enumerate(rows)]


def unique_pairs_file(path: Path, count: int = 32) -> Path:
    rows = [{"prompt": f"What is {i} plus {i + 3}?", "chosen": f" {2 * i + 3}.",
             "rejected": f" {2 * i + 5 + i % 3}, I think."} for i in range(count)]
    return write_jsonl(path, rows)


def split_of(tokenizer: Any, rows: list[dict[str, Any]]) -> PreferenceSplit:
    pairs = [tokenize_pair(tokenizer, preference(row, f"row {n}")) for n, row in enumerate(rows)]
    return PreferenceSplit(*(list(column) for column in zip(*pairs, strict=True)))


def ours(model: torch.nn.Module, kind: str, settings: list[str], batch: Any
         ) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:
    """(mean loss over the pairs, metric sums, LoRA gradients) of cpudist's loss module."""
    loss = PairLoss(model, load_config(None, settings), kind)
    loss.reference_source = Reference(model, None)
    model.zero_grad(set_to_none=True)
    output = loss(**batch.as_kwargs())
    (output.total / output.count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return (float(output.total.detach() / output.count),
            {k: float(v) for k, v in output.metrics.items()}, grads)


def same_lora(target: torch.nn.Module, source: torch.nn.Module) -> None:
    weights = dict(source.named_parameters())
    with torch.no_grad():
        for name, param in target.named_parameters():
            if param.requires_grad:
                param.copy_(weights[name])


def assert_grads_equal(mine: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    theirs = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(theirs) == set(mine)
    for name, grad in mine.items():
        scale = float(theirs[name].abs().max())
        assert scale > 0, name
        assert float((grad - theirs[name]).abs().max()) <= 1e-4 * scale, name


@pytest.mark.parametrize("style", ["chat", "plain"])
def test_dpo_loss_and_gradients_equal_trls(style: str, tiny_llama: Path, tmp_path: Path) -> None:
    """TRL's DPOTrainer (PEFT LoRA, reference = adapter disabled) and cpudist on the same weights
    (random LoRA B, so policy and reference differ): same tokens, loss and gradients to 1e-4."""
    trl = pytest.importorskip("trl", reason="TRL is in the dev and peers extras")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rows = chat_pairs(4)
    if style == "plain":
        rows = [{"prompt": f"Q: {CHAT_ROWS[i][0]}\nA:", "chosen": " " + CHAT_ROWS[i][1],
                 "rejected": " " + CHAT_ROWS[(i + 3) % 8][1]} for i in range(4)]
    split = split_of(tokenizer, rows)
    batch = collate_pairs(split, [0, 1, 2, 3], tokenizer.pad_token_id)
    model = lora_model(tiny_llama, tmp_path / "cache")
    loss, sums, grads = ours(model, "dpo", ["preference.beta=0.3"], batch)

    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.3, bf16=False, use_cpu=True,
                         report_to=[], per_device_train_batch_size=4, max_length=None,
                         gradient_checkpointing=False)
    trainer = trl.DPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                             args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    same_lora(trainer.model, model)
    tokenized = trainer.train_dataset
    for i in range(4):  # TRL's own tokenization of the same rows
        assert tokenized[i]["prompt_ids"] == split.prompt[i]
        assert tokenized[i]["chosen_ids"] == split.chosen[i]
        assert tokenized[i]["rejected_ids"] == split.rejected[i]
    trainer.model.train()
    theirs = trainer.compute_loss(trainer.model, trainer.data_collator([tokenized[i] for i in range(4)]))
    theirs.backward()
    assert loss == pytest.approx(float(theirs), rel=1e-4)
    assert abs(loss - math.log(2)) > 1e-3  # policy and reference really differ
    metrics = trainer._metrics["train"]
    assert sums["reward_chosen"] / 4 == pytest.approx(metrics["rewards/chosen"][0], rel=1e-4)
    assert sums["reward_rejected"] / 4 == pytest.approx(metrics["rewards/rejected"][0], rel=1e-4)
    assert_grads_equal(grads, trainer.model)


def _trl_orpo_batch(split: PreferenceSplit, pad_id: int) -> dict[str, torch.Tensor]:
    """The split as ORPOTrainer's padded batch (chosen_/rejected_ input_ids, attention_mask,
    labels with the prompt masked)."""
    batch: dict[str, torch.Tensor] = {}
    for side, answers in (("chosen", split.chosen), ("rejected", split.rejected)):
        sequences = [p + a for p, a in zip(split.prompt, answers, strict=True)]
        width = max(map(len, sequences))
        ids = torch.full((len(sequences), width), pad_id)
        labels = torch.full((len(sequences), width), IGNORE)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, (prompt, sequence) in enumerate(zip(split.prompt, sequences, strict=True)):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
            labels[row, len(prompt) : len(sequence)] = torch.tensor(sequence[len(prompt) :])
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask,
                      f"{side}_labels": labels})
    return batch


def test_orpo_equals_trls(tiny_llama: Path, tmp_path: Path) -> None:
    """ORPOTrainer's loss is its SFT term (token mean over the micro-batch's chosen sequences,
    prompt tokens included) minus lambda x the mean log-sigmoid of the log odds ratio. cpudist's SFT
    term is each pair's mean NLL over its chosen answer's tokens (labels on answers only, and a
    mean per pair, so any world size and micro-batch split trains the same problem). For one pair
    with a one-token prompt the two SFT terms are the same quantity: there the whole loss and its
    gradient are compared; on a batch of four chat pairs the odds-ratio term and the rewards."""
    pytest.importorskip("trl", reason="TRL is in the dev and peers extras")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = lora_model(tiny_llama, tmp_path / "cache")
    one = [{"prompt": "Q", "chosen": " " + CHAT_ROWS[0][1], "rejected": " " + CHAT_ROWS[3][1]}]
    args = ORPOConfig(output_dir=str(tmp_path / "trl"), beta=0.25, bf16=False, use_cpu=True,
                      report_to=[], per_device_train_batch_size=1, gradient_checkpointing=False)
    trainer = ORPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                          args=args, train_dataset=Dataset.from_list(one),
                          processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    same_lora(trainer.model, model)
    trainer.model.train()

    split = split_of(tokenizer, one)
    assert len(split.prompt[0]) == 1
    loss, _, grads = ours(model, "orpo", ["preference.orpo_lambda=0.25"],
                          collate_pairs(split, [0], tokenizer.pad_token_id))
    theirs, _ = trainer.get_batch_loss_metrics(trainer.model, _trl_orpo_batch(split, tokenizer.pad_token_id))
    theirs.backward()
    assert loss == pytest.approx(float(theirs), rel=1e-4)
    assert_grads_equal(grads, trainer.model)

    split = split_of(tokenizer, chat_pairs(4))
    loss, sums, _ = ours(model, "orpo", ["preference.orpo_lambda=0.25"],
                         collate_pairs(split, [0, 1, 2, 3], tokenizer.pad_token_id))
    with torch.no_grad():
        _, metrics = trainer.get_batch_loss_metrics(trainer.model,
                                                    _trl_orpo_batch(split, tokenizer.pad_token_id))
    odds_term = loss - sums["nll"] / 4
    assert odds_term == pytest.approx(-0.25 * metrics["log_odds_ratio"], rel=1e-4)
    assert sums["reward_chosen"] / 4 == pytest.approx(metrics["rewards/chosen"], rel=1e-4)
    assert sums["reward_rejected"] / 4 == pytest.approx(metrics["rewards/rejected"], rel=1e-4)


def test_label_smoothing_is_conservative_dpo(tiny_llama: Path, tmp_path: Path) -> None:
    """-(1 - e) log sigmoid(z) - e log sigmoid(-z), z = beta x (policy - reference log-ratio)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    batch = collate_pairs(split_of(tokenizer, chat_pairs(2)), [0, 1], tokenizer.pad_token_id)
    model = lora_model(tiny_llama, tmp_path / "cache")
    plain, sums, _ = ours(model, "dpo", ["preference.beta=0.5"], batch)
    smoothed, _, _ = ours(model, "dpo", ["preference.beta=0.5", "preference.label_smoothing=0.2"],
                          batch)
    # -log sigmoid(z) = softplus(-z) and softplus(z) - softplus(-z) = z, so the smoothed loss is
    # plain + e x mean(z), and mean(z) is the mean reward margin.
    margin = (sums["reward_chosen"] - sums["reward_rejected"]) / 2
    assert smoothed == pytest.approx(plain + 0.2 * margin, rel=1e-5)


def _pairs_run(tiny_llama: Path, data: Path, out: Path, **extra: object) -> list[str]:
    settings = dict(data__format="preference", train__objective="dpo", train__max_steps=4,
                    preference__reference="precomputed", train__lr=2e-2)
    return ["train", *tiny_overrides(tiny_llama, data, out, **{**settings, **extra})]


def test_fresh_dpo_starts_at_ln2_caches_its_reference_and_resumes_exactly(
        tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    data = unique_pairs_file(tmp_path / "pairs.jsonl")
    whole = tmp_path / "whole"
    first = cli_in_process(capsys, _pairs_run(tiny_llama, data, whole))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "DPO reference of the 24 training pairs: computed in" in first.stdout
    assert "validation reward accuracy: before 0.500 ->" in first.stdout
    losses = step_losses(whole)
    assert abs(losses[0][1] - math.log(2)) < 1e-6
    assert losses[-1][1] < losses[0][1]
    records = metric_records(whole)
    assert {"reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"} <= set(records[0])
    assert records[0]["reward_accuracy"] == 0.5  # every margin 0: ties count half
    assert "val_reward_accuracy" in records[-1]
    assert len(list((tmp_path / "data-cache" / "reference").glob("*.safetensors"))) == 2
    # cpudist eval on the pairs file (data.format from the run): base vs adapter, and the DPO
    # figures of the adapter with the base as reference, the run's reference.
    evaluated = cli_in_process(capsys, ["eval", "--adapter", str(whole / "adapter"), "--data",
                                        str(data), "--json"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    scores = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert scores["pairs"] == 32 and 0.0 <= scores["base_accuracy"] <= 1.0
    assert scores["adapter_accuracy"] >= scores["base_accuracy"]  # easy pairs: the base is often right
    assert scores["reward_accuracy"] > 0.5 and scores["loss"] < math.log(2)

    stopped_out = tmp_path / "stopped"
    with monkeypatch.context() as patch:
        signal_after(patch, 2)
        stopped = cli_in_process(capsys, _pairs_run(tiny_llama, data, stopped_out))
    assert stopped.returncode == 75, stopped.stderr[-3000:]  # preempted with a checkpoint
    assert "DPO reference of the training pairs: read from" in stopped.stdout
    resumed = cli_in_process(capsys, _pairs_run(tiny_llama, data, stopped_out, train__resume="auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "read from" in resumed.stdout
    assert step_losses(stopped_out) == losses  # bitwise


def test_sft_adapter_as_start_and_reference(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """SFT -> DPO: the run starts from the SFT adapter and its reference is base + that adapter,
    so the first loss is ln 2 (policy = reference), in both reference modes alike."""
    sft = tmp_path / "sft"
    done = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, chat_file, sft,
                                                            train__lr=5e-2)])
    assert done.returncode == 0, done.stderr[-3000:]
    data = write_jsonl(tmp_path / "pairs.jsonl", chat_pairs(16))
    curves = {}
    for mode in ("precomputed", "per_step"):
        out = tmp_path / mode
        result = cli_in_process(capsys, _pairs_run(
            tiny_llama, data, out, model__init_adapter=sft / "adapter", preference__reference=mode))
        assert result.returncode == 0, result.stderr[-3000:]
        assert "the base + the start adapter (model.init_adapter), frozen" in result.stdout
        curves[mode] = step_losses(out)
        assert abs(curves[mode][0][1] - math.log(2)) < 1e-6
    assert [v for _, v in curves["per_step"]] == pytest.approx(
        [v for _, v in curves["precomputed"]], rel=1e-5)
    wrong = cli_in_process(capsys, _pairs_run(tiny_llama, data, tmp_path / "wrong",
                                              model__init_adapter=sft / "adapter", lora__r=4))
    assert wrong.returncode != 0
    assert "the adapter was trained with lora.r=8 (the run has 4)" in wrong.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_two_ranks_resume_one_ranks_run_and_match_it(tiny_llama: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank trains 2 steps and is stopped; 2 ranks (mpirun) resume it with the same global
    batch, computing the reference again between them (the cache is removed first): the 4 losses
    equal those of one rank that was never stopped, to 1e-5 (fp32)."""
    data = unique_pairs_file(tmp_path / "pairs.jsonl")
    whole = tmp_path / "whole"
    assert cli_in_process(capsys, _pairs_run(tiny_llama, data, whole)).returncode == 0
    out = tmp_path / "two"
    with monkeypatch.context() as patch:
        signal_after(patch, 2)
        stopped = cli_in_process(capsys, _pairs_run(tiny_llama, data, out, train__global_batch=4))
        assert stopped.returncode == 75, stopped.stderr[-3000:]  # preempted with a checkpoint
    shutil.rmtree(tmp_path / "data-cache" / "reference")
    logs = tmp_path / "logs"
    harness = [sys.executable, SCRIPTS / "rank_harness.py", logs]
    args = _pairs_run(tiny_llama, data, out, train__resume="auto", train__global_batch=4)
    result = run([*mpirun_cmd(2), *harness, *args], timeout=300)
    assert result.returncode == 0, (logs / "rank0.err").read_text()[-3000:]
    log = (logs / "rank0.out").read_text()
    assert "resuming a 1-rank checkpoint" in log
    assert "DPO reference of the 24 training pairs: computed in" in log
    expected, got = step_losses(whole), step_losses(out)
    assert [s for s, _ in got] == [1, 2, 3, 4]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-5)
