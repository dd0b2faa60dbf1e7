"""The peer to beat: Hugging Face Trainer + PEFT LoRA on the same model, data and settings (or,
with peft.method=full, Trainer's full fine-tuning of the fp32 model with bf16 autocast).

Run as its own process by `cpudist bench --vs hf` (``python -m cpudist.bench.hf_peer CONFIG ...``)
on the resolved config cpudist's side reads too. It reports the same figures as the bench,
computed the same way (cpudist.bench.figures: FLOP formula, GEMM peak measured in this run; PSS
sampler). What HF does is left as a user would set it up: the model loaded in the compute dtype,
TrainingArguments(bf16=...) for autocast, rows padded to the longest in each batch,
full-vocabulary logits, the default random sampler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from cpudist.bench.figures import (
    FlopModel,
    GemmPeak,
    TimedStep,
    flop_model,
    model_gemm_shapes,
    throughput_figures,
)
from cpudist.bench.options import DATA_KINDS
from cpudist.bench.samples import bench_samples
from cpudist.config import Config, load_config
from cpudist.data.tokenize import IGNORE
from cpudist.records import BenchResult
from cpudist.runtime.allocator import in_use as allocator_in_use
from cpudist.runtime.memory import PssSampler, peak_rss_gb
from cpudist.runtime.mkl_shim import describe as describe_mkl
from cpudist.runtime.precision import Precision


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cpudist.bench.hf_peer",
                                description="HF Trainer + PEFT LoRA benchmark (cpudist's peer)")
    p.add_argument("config", help="the resolved cpudist config both sides read (YAML)")
    p.add_argument("--data", choices=DATA_KINDS, default="synthetic")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


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


def quantization_config(quantize: str, compute: torch.dtype) -> Any:
    """The peer's own CPU quantization for model.quantize: bitsandbytes through transformers'
    BitsAndBytesConfig, int8 as LLM.int8() and int4 as QLoRA's NF4 with the compute dtype."""
    if quantize == "none":
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise SystemExit("error: the peer of a quantized run is HF + PEFT with bitsandbytes, "
                         "which is not installed: pip install 'cpudist[peers]'") from None
    from transformers import BitsAndBytesConfig

    if quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=compute)


class StepClock(TrainerCallback):
    """A Trainer callback noting when each optimizer step begins and ends."""

    def __init__(self) -> None:
        self.begins: list[float] = []
        self.ends: list[float] = []

    def on_step_begin(self, *_: Any, **__: Any) -> None:
        self.begins.append(time.perf_counter())

    def on_step_end(self, *_: Any, **__: Any) -> None:
        self.ends.append(time.perf_counter())


def start_peer(argv: list[str] | None) -> tuple[argparse.Namespace, Config, Precision]:
    """A peer process's arguments, config and precision, its threads set and its libraries quiet
    (offline, as cpudist's side runs)."""
    from cpudist.runtime.precision import choose_precision
    from cpudist.runtime.process import quiet_libraries

    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = load_config(args.config)
    if config.dist.threads_per_rank:
        torch.set_num_threads(config.dist.threads_per_rank)
    quiet_libraries()
    return args, config, choose_precision(config.model.dtype)


def load_hf_model(config: Config, dtype: torch.dtype, quantization: Any = None
                  ) -> tuple[Any, Any, float]:
    """(tokenizer, the model as transformers loads it, with the attention cpudist's side uses;
    seconds to load the model)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cpudist.model.load import attention_implementation

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    loading = time.perf_counter()
    attention = attention_implementation(config.model.attn_implementation,
                                         AutoConfig.from_pretrained(config.model.path))
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=dtype,
                                                 attn_implementation=attention,
                                                 quantization_config=quantization)
    return tokenizer, model, time.perf_counter() - loading


def peft_lora_config(config: Config) -> Any:
    """PEFT's LoraConfig for the config's lora section (a causal LM's)."""
    from peft import LoraConfig

    lora = config.lora
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      use_rslora=lora.use_rslora, use_dora=lora.use_dora,
                      target_modules=lora.target_modules, task_type="CAUSAL_LM")


def load_peer_model(config: Config, precision: Precision, quantization: Any
                    ) -> tuple[Any, Any, float]:
    """(HF model + PEFT LoRA as a user would set it up, on the given quantization config or
    none, or with peft.method=full the model alone, every weight trained; tokenizer, seconds to
    load)."""
    from peft import get_peft_model

    # Full fine-tuning as HF documents it: fp32 weights, bf16 by the Trainer's autocast.
    dtype = torch.float32 if config.peft.method == "full" else precision.compute_dtype
    tokenizer, model, load_s = load_hf_model(config, dtype, quantization)
    wrapping = time.perf_counter()
    model.config.use_cache = False
    if config.peft.method == "full":
        return model, tokenizer, load_s
    if quantization is not None:
        # As the QLoRA recipes do: norms in fp32, input gradients on, checkpointing as configured.
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=config.model.gradient_checkpointing)
    model = get_peft_model(model, peft_lora_config(config))
    return model, tokenizer, load_s + time.perf_counter() - wrapping


def train_peer(model: Any, rows: list[dict[str, list[int]]], collator: PadCollator,
               config: Config, precision: Precision, max_steps: int, out_dir: str) -> StepClock:
    """HF Trainer over rows for max_steps optimizer steps, timed by a StepClock."""
    from transformers import Trainer, TrainingArguments

    tc = config.train
    training_args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=tc.batch_size,
        gradient_accumulation_steps=tc.grad_accum, max_steps=max_steps,
        learning_rate=tc.lr, lr_scheduler_type="constant",
        max_grad_norm=tc.max_grad_norm or 0.0, weight_decay=tc.weight_decay,
        use_cpu=True, bf16=precision.bf16, logging_strategy="no", save_strategy="no",
        report_to=[], dataloader_num_workers=0, remove_unused_columns=False, seed=tc.seed,
        gradient_checkpointing=config.model.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, disable_tqdm=True)
    clock = StepClock()
    Trainer(model=model, args=training_args, train_dataset=rows, data_collator=collator,
            callbacks=[clock]).train()
    return clock


def timed_steps(clock: StepClock, seen: list[tuple[list[int], int, int]], grad_accum: int,
                warmup: int, flops: FlopModel) -> list[TimedStep]:
    """The timed steps of the second training: from one step's end to the next (collation
    included, as in cpudist's bench); the first from its own begin (HF fetches its batches just
    before: a few ms in HF's favour). `seen` holds every batch drawn, warm-up's first."""
    seconds = [clock.ends[0] - clock.begins[0],
               *(b - a for a, b in zip(clock.ends[:-1], clock.ends[1:], strict=True))]
    steps = []
    for index, elapsed in enumerate(seconds):
        batches = seen[(warmup + index) * grad_accum:(warmup + index + 1) * grad_accum]
        lengths = [n for lens, _, _ in batches for n in lens]
        labels = sum(label for _, label, _ in batches)
        steps.append(TimedStep(elapsed, sum(lengths), labels, len(lengths),
                               sum(cells for _, _, cells in batches),
                               flops.step_flops(lengths, labels, len(batches))))
    return steps


def peer_result(config: Config, precision: Precision, steps: list[TimedStep],
                peaks: list[float], pss: PssSampler, flops: FlopModel, framework: str,
                args: argparse.Namespace, description: str, **figures: Any) -> BenchResult:
    """A peer's BenchResult (its figures computed as cpudist's bench computes them), printed
    without the config and per-step times, and written to --json when given."""
    result = BenchResult(
        **dataclasses.asdict(throughput_figures(steps, peaks)),
        peak_rss_gb=[peak_rss_gb()], node_pss_gb=pss.peak / 1024**3, framework=framework,
        dtype=precision.describe(), threads=torch.get_num_threads(), world_size=1,
        steps=len(steps), warmup_steps=args.warmup, data=description,
        model_dir=config.model.path, allocator=allocator_in_use(), mkl=describe_mkl(),
        flop_model=flops.as_dict(),
        config=config.to_dict(), host=socket.gethostname(), **figures)
    print(json.dumps({k: v for k, v in result.to_json().items() if k not in ("config", "step_s")}))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    args, config, precision = start_peer(argv)
    tc = config.train
    quantization = quantization_config(config.model.quantize, precision.compute_dtype)
    model, tokenizer, load_s = load_peer_model(config, precision, quantization)
    # One epoch of the timed steps; the warm-up steps run on the same set first (as cpudist's bench).
    split, description = bench_samples(config, args.data, args.steps * tc.batch_size * tc.grad_accum,
                                       tokenizer, model.config.vocab_size)
    rows = [{"input_ids": ids, "labels": labels}
            for ids, labels in zip(split.input_ids, split.labels, strict=True)]
    collator = PadCollator(tokenizer.pad_token_id)
    gemm = GemmPeak(precision.compute_dtype,
                    model_gemm_shapes(model, tc.batch_size * config.data.max_length))
    peaks = [gemm.probe()]
    with tempfile.TemporaryDirectory(prefix="hf-baseline-") as tmp, PssSampler() as pss:
        # Warm-up and timed steps are two trainings of the same model, so that the timed one is
        # exactly one epoch (HF's random sampler) over the set cpudist times.
        if args.warmup:
            train_peer(model, rows, collator, config, precision, args.warmup, tmp)
        clock = train_peer(model, rows, collator, config, precision, args.steps, tmp)
    peaks.append(gemm.probe())
    flops = flop_model(model)
    peer_result(config, precision, timed_steps(clock, collator.seen, tc.grad_accum, args.warmup,
                                               flops), peaks, pss, flops,
                "hf-trainer" if config.peft.method == "full" else "hf-trainer+peft", args,
                description, load_s=load_s,
                quantization=str(quantization.to_dict() if quantization is not None else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
