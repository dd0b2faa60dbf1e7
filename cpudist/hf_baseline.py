"""The peer to beat: Hugging Face Trainer + PEFT LoRA on the same model, data and settings.

Run as its own process by `cpudist bench --vs hf` (``python -m cpudist.hf_baseline ...``). It
reports the same figures as the bench, computed the same way (cpudist.bench: FLOP formula, GEMM
peak measured in this run, PSS sampler). What HF does is left as a user would set it up: the model
loaded in the compute dtype, TrainingArguments(bf16=...) for autocast, rows padded to the longest
in each batch, full-vocabulary logits, the default random sampler.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cpudist.data import IGNORE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cpudist.hf_baseline",
                                description="HF Trainer + PEFT LoRA benchmark (cpudist's peer)")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", choices=["synthetic", "instruct"], default="synthetic")
    p.add_argument("--data-path", default="chatterbot:english")
    p.add_argument("--data-format", default="chat")
    p.add_argument("--data-cache", default=".cache/data")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--threads", type=int)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--target-modules", default="all-linear")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def load_rows(args: argparse.Namespace, tokenizer: Any, vocab: int, samples: int
              ) -> tuple[list[dict[str, list[int]]], str]:
    """The same samples cpudist's bench builds: synthetic rows or the same fixed set of
    cpudist-tokenized instruct samples."""
    from cpudist.bench import fixed_sample_set, synthetic_split
    from cpudist.config import DataConfig

    if args.data == "synthetic":
        split = synthetic_split(samples, args.seq_len, vocab, args.seed)
        desc = f"synthetic: {samples} rows x {args.seq_len} random tokens, all labels"
    else:
        from cpudist.data import build_datasets

        config = DataConfig(path=args.data_path, format=args.data_format, max_length=args.seq_len,
                            cache_dir=args.data_cache)
        split, _, stats = build_datasets(config, tokenizer, args.seed)
        split = fixed_sample_set(split, samples, args.seed, f"--data-path {args.data_path}")
        desc = (f"instruct: {stats['source']} ({samples} of {stats['train']} samples, "
                "prompt tokens masked)")
    rows = [{"input_ids": ids, "labels": labels}
            for ids, labels in zip(split.input_ids, split.labels, strict=True)]
    return rows, desc


class PadCollator:
    """Right-pad to the longest row of the batch (what DataCollatorForSeq2Seq does), and keep the
    real sample lengths and label counts of every batch for the figures."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id
        self.seen: list[tuple[list[int], int, int]] = []  # (lengths, label tokens, cells)

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[i, :n] = torch.tensor(row["input_ids"])
            labels[i, :n] = torch.tensor(row["labels"])
            mask[i, :n] = 1
        self.seen.append(([len(r["input_ids"]) for r in rows], int((labels[:, 1:] != IGNORE).sum()),
                          ids.numel()))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.threads:
        torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from cpudist.allocator import in_use as allocator_in_use
    from cpudist.bench import PssSampler, flop_model, gemm_peak
    from cpudist.hardware import choose_dtype
    from cpudist.quiet import quiet_libraries
    from cpudist.report import peak_rss_gb

    quiet_libraries()
    dtype_name, why = choose_dtype(args.dtype)
    bf16 = dtype_name == "bfloat16"
    compute_dtype = torch.bfloat16 if bf16 else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=compute_dtype,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    targets: Any = args.target_modules
    if targets != "all-linear":
        targets = targets.split(",")
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha,
                                             lora_dropout=args.lora_dropout,
                                             target_modules=targets, task_type="CAUSAL_LM"))
    total_steps = args.warmup + args.steps
    # One epoch of the timed steps; the warm-up steps run on the same set first (as cpudist's bench).
    samples = args.steps * args.batch_size * args.grad_accum
    rows, desc = load_rows(args, tokenizer, model.get_base_model().config.vocab_size, samples)
    collator = PadCollator(tokenizer.pad_token_id)

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.begins: list[float] = []
            self.ends: list[float] = []

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.begins.append(time.perf_counter())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.perf_counter())

    def train(max_steps: int, out_dir: str) -> StepClock:
        training_args = TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum, max_steps=max_steps,
            learning_rate=args.lr, lr_scheduler_type="constant", max_grad_norm=1.0,
            use_cpu=True, bf16=bf16, logging_strategy="no", save_strategy="no", report_to=[],
            dataloader_num_workers=0, remove_unused_columns=False, seed=args.seed,
            gradient_checkpointing=args.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False}, disable_tqdm=True)
        clock = StepClock()
        Trainer(model=model, args=training_args, train_dataset=rows, data_collator=collator,
                callbacks=[clock]).train()
        return clock

    peaks = [gemm_peak(compute_dtype)]
    with tempfile.TemporaryDirectory(prefix="hf-baseline-") as tmp, PssSampler() as pss:
        # Warm-up and timed steps are two trainings of the same model, so that the timed one is
        # exactly one epoch (HF's random sampler) over the set cpudist times.
        if args.warmup:
            train(args.warmup, tmp)
        clock = train(args.steps, tmp)
    peaks.append(gemm_peak(compute_dtype))
    # From one step's end to the next (collation included, as in cpudist's bench); the first timed
    # step from its own begin (HF fetches its batches just before: a few ms in HF's favour).
    timed = [clock.ends[0] - clock.begins[0],
             *(b - a for a, b in zip(clock.ends[:-1], clock.ends[1:], strict=True))]
    # Batches in the order they were drawn; one optimizer step uses grad_accum of them.
    per_step = [collator.seen[i * args.grad_accum:(i + 1) * args.grad_accum]
                for i in range(total_steps)][args.warmup:]
    flops = flop_model(model)
    wall = sum(timed)
    lengths = [n for step in per_step for lens, _, _ in step for n in lens]
    label_tokens = sum(lab for step in per_step for _, lab, _ in step)
    model_flops = sum(flops.step_flops([n for lens, _, _ in step for n in lens],
                                       sum(lab for _, lab, _ in step)) for step in per_step)
    cells = sum(c for step in per_step for _, _, c in step)
    peak = max(peaks)
    result = {
        "tokens_per_s": sum(lengths) / wall, "label_tokens_per_s": label_tokens / wall,
        "samples_per_s": len(lengths) / wall, "s_per_step": wall / len(timed),
        "s_per_step_median": statistics.median(timed),
        "label_tokens_per_s_best_step": max(
            sum(lab for _, lab, _ in step) / t for step, t in zip(per_step, timed, strict=True)),
        "peak_rss_gb": [peak_rss_gb()], "node_pss_gb": pss.peak / 1024**3,
        "mfu": model_flops / wall / peak, "model_tflops": model_flops / wall / 1e12,
        "peak_tflops": peak / 1e12, "peak_samples_tflops": [p / 1e12 for p in peaks],
        "padding_fraction": 1.0 - sum(lengths) / cells if cells else 0.0,
        "dtype": f"{dtype_name}: {why}", "threads": torch.get_num_threads(), "world_size": 1,
        "steps": len(timed), "warmup_steps": args.warmup, "step_s": timed, "data": desc,
        "model_dir": args.model, "flop_model": flops.as_dict(), "framework": "hf-trainer+peft",
        "allocator": allocator_in_use(),
        "host": socket.gethostname(), "settings": {k: str(v) for k, v in vars(args).items()},
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("settings", "step_s")}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
