"""The DPO peer: TRL's DPOTrainer + PEFT LoRA on the same model, pairs and settings.

Run as its own process by `cpudist bench --objective dpo --vs trl` (``python -m
cpudist.bench.trl_peer CONFIG ...``) on the resolved config cpudist's side reads too, and reports
the same figures, computed the same way (cpudist.bench.figures). TRL is set up as its docs show: the
model loaded in the compute dtype, a LoraConfig given to the trainer (so the reference is the model
with the adapter disabled), DPOConfig(bf16=...) for autocast, beta and label smoothing from the
config, its own collator (chosen and rejected rows in one padded batch) and fused LM head, the
default random sampler. preference.reference=precomputed sets precompute_ref_log_probs=True (done
in the trainer's constructor, before the timed steps, as cpudist's pass is); otherwise TRL's default,
a reference forward at every step. Activation checkpointing follows model.gradient_checkpointing
(DPOConfig turns it on by default; cpudist's bench does not).

The pairs are the bench's own token ids (cpudist.bench.samples), so both sides time the same work;
TRL's tokenization of text is skipped, as it is not timed on either side.
"""

from __future__ import annotations

import sys
import tempfile
import time
from typing import Any

from cpudist.bench.figures import GemmPeak, flop_model, model_gemm_shapes
from cpudist.bench.hf_peer import (
    StepClock,
    load_hf_model,
    peer_result,
    peft_lora_config,
    start_peer,
    timed_steps,
)
from cpudist.bench.samples import bench_samples
from cpudist.config import Config
from cpudist.runtime.memory import PssSampler
from cpudist.runtime.precision import Precision


def _trainer(config: Config, precision: Precision, rows: list[dict[str, list[int]]],
             max_steps: int, out_dir: str) -> tuple[Any, Any, float, float]:
    """(DPOTrainer over the pre-tokenized pairs, its recording collator, seconds to load the
    model, seconds to build the trainer: its reference pass when it precomputes one)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from cpudist.data.tokenize import IGNORE

    class Recording(DataCollatorForPreference):
        """TRL's collator, noting each batch's sequence lengths, answer tokens and cells."""

        seen: list[tuple[list[int], int, int]] = []

        def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
            batch = super().torch_call(examples)
            labels = batch["completion_mask"][:, 1:]
            self.seen.append((batch["attention_mask"].sum(dim=1).tolist(), int(labels.sum()),
                              batch["input_ids"].numel()))
            return batch

    class PreTokenized(DPOTrainer):
        def _prepare_dataset(self, dataset: Any, *_: Any, **__: Any) -> Any:
            return dataset  # already the bench's token ids

    tc = config.train
    tokenizer, model, load_s = load_hf_model(config, precision.compute_dtype)
    args = DPOConfig(
        output_dir=out_dir, per_device_train_batch_size=tc.batch_size,
        gradient_accumulation_steps=tc.grad_accum, max_steps=max_steps, learning_rate=tc.lr,
        lr_scheduler_type="constant", max_grad_norm=tc.max_grad_norm or 0.0,
        weight_decay=tc.weight_decay, use_cpu=True, bf16=precision.bf16, logging_strategy="no",
        save_strategy="no", report_to=[], dataloader_num_workers=0, seed=tc.seed,
        gradient_checkpointing=config.model.gradient_checkpointing, disable_tqdm=True,
        beta=config.preference.beta, max_length=None,
        precompute_ref_log_probs=config.preference.reference == "precomputed")
    collator = Recording(pad_token_id=tokenizer.pad_token_id)
    assert IGNORE == -100  # TRL's label padding
    building = time.perf_counter()
    trainer = PreTokenized(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        data_collator=collator, peft_config=peft_lora_config(config))
    collator.seen.clear()  # the reference pass's batches: timed_steps reads the training's only
    return trainer, collator, load_s, time.perf_counter() - building


def _prepared(config: Config, build_s: float, pairs: int) -> dict[str, Any]:
    """BenchResult's prepare_s and prepared: TRL's reference pass, which runs while its trainer is
    built, when it precomputes one."""
    if config.preference.reference != "precomputed":
        return {"prepared": "TRL's default: the reference is a forward at every step"}
    return {"prepare_s": build_s, "prepared": f"TRL's precompute_ref_log_probs: one pass over "
                                              f"{pairs} pairs, in its trainer's constructor"}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig, AutoTokenizer

    args, config, precision = start_peer(argv)
    tc = config.train
    vocab = AutoConfig.from_pretrained(config.model.path).get_text_config().vocab_size
    pairs, description = bench_samples(config, args.data, args.steps * tc.batch_size * tc.grad_accum,
                                       AutoTokenizer.from_pretrained(config.model.path), vocab)
    rows = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}
            for p, c, r in zip(pairs.prompt, pairs.chosen, pairs.rejected, strict=True)]
    with tempfile.TemporaryDirectory(prefix="trl-peer-") as tmp, PssSampler() as pss:
        # One training of warm-up + timed steps; the timed ones are the last --steps.
        trainer, collator, load_s, prepare_s = _trainer(config, precision, rows,
                                                        args.warmup + args.steps, tmp)
        model = trainer.model
        gemm = GemmPeak(precision.compute_dtype,
                        model_gemm_shapes(model, 2 * tc.batch_size * config.data.max_length))
        peaks = [gemm.probe()]
        clock = StepClock()
        trainer.add_callback(clock)
        trainer.train()
    peaks.append(gemm.probe())
    clock.begins, clock.ends = clock.begins[args.warmup:], clock.ends[args.warmup:]
    flops = flop_model(model)
    peer_result(config, precision, timed_steps(clock, collator.seen, tc.grad_accum, args.warmup,
                                               flops), peaks, pss, flops, "trl-dpo+peft", args,
                description, load_s=load_s, **_prepared(config, prepare_s, len(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
