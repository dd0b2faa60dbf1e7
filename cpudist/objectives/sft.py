"""Supervised fine-tuning: next-token cross-entropy on the answer tokens (prompts masked), with
the label-only chunked LM head (cpudist.model.loss)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from torch import nn

from cpudist.data.batches import Batch, collate, make_batch
from cpudist.data.tokenize import IGNORE, TokenizedSplit, build_datasets
from cpudist.model.loss import CausalLMLoss
from cpudist.objectives.base import Datasets, Objective, Prompt


class SFT(Objective):
    name: ClassVar[str] = "sft"

    def load_data(self, tokenizer: Any) -> Datasets:
        config = self.config
        train, val, stats = build_datasets(config.data, tokenizer, config.train.seed)
        rewritten = stats["last_answer_only"]
        return Datasets(train, val, (
            f"{stats['source']} -> {stats['train']} train / {stats['val']} validation samples; "
            f"{stats['truncated']} of {stats['samples']} truncated to {config.data.max_length} "
            f"tokens; {stats['dropped_no_labels']} dropped (no answer token left)"
            + (f"; {rewritten} conversations train on their last answer only (the chat template "
               "rewrites earlier turns)" if rewritten else "")), counts=stats)

    def loss_module(self, model: nn.Module) -> nn.Module:
        return CausalLMLoss(model, self.config.train.loss_chunk_size)

    def make_batch(self, data: TokenizedSplit, indices: list[int], pad_id: int) -> Batch:
        return make_batch(data, indices, pad_id, self.config)

    def eval_batch(self, data: TokenizedSplit, indices: list[int], pad_id: int) -> Batch:
        return collate(data, indices, pad_id)  # never packed: each sample scored on its own

    def weight(self, batch: Batch) -> float:  # type: ignore[override]
        return float(batch.label_tokens)

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        if sums["units"] == 0:
            return {}
        loss = sums["loss"] / sums["units"]
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def describe_eval(self, before: dict[str, float], after: dict[str, float]) -> str:
        return (f"validation loss: before {before['val_loss']:.4f} -> after "
                f"{after['val_loss']:.4f} (perplexity {before['val_ppl']:.2f} -> "
                f"{after['val_ppl']:.2f})")

    def held_out_prompts(self, val: TokenizedSplit, count: int) -> list[Prompt]:
        """The first `count` held-out samples with a prompt: ids up to the first answer token,
        and the answer's ids."""
        prompts: list[Prompt] = []
        for ids, labels in zip(val.input_ids, val.labels, strict=True):
            if len(prompts) == count:
                break
            first = next((i for i, label in enumerate(labels) if label != IGNORE), None)
            if first:
                answer = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE]
                prompts.append(Prompt(list(ids[:first]), answer))
        return prompts
