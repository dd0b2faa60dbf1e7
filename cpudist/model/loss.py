"""LM head and cross-entropy only at label positions, in chunks.

Full-vocabulary logits for every token are the largest tensors of a LoRA step (151936-vocab fp32
logits for 2048 tokens are 1.2 GB, and their gradient as much). Here the head runs only where a
label exists, a chunk of rows at a time, and the gradient for the hidden states is computed in the
same pass, so with a frozen head at most one chunk of logits is ever alive. A head that trains
(peft.method=full) keeps each label row's logit gradient in the compute dtype for its weight's
gradient in backward: half of what autograd's log_softmax would keep in bf16 (its fp32 output).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from cpudist.data.tokenize import IGNORE
from cpudist.model.quantize import QuantizedHead, head_input_gradient, head_logits
from cpudist.model.tied_embedding import leave_head_gradient


def softmax_rows() -> int:
    """Rows of a chunk whose softmax is taken together in fp32: two per thread (the softmax
    kernel splits rows among threads), at least 4. On 2 threads that is 2.4 MB of fp32 for a
    152k vocabulary, which stays in cache through the five passes over it; a whole chunk's fp32
    copy would not (docs/PERFORMANCE.md, "Loss head: label-only, chunked")."""
    return max(4, 2 * torch.get_num_threads())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ W^T + b, target_i), with d/dhidden computed chunk by chunk in forward.

    A trainable W (or b) is computed with in the autocast dtype when autocast is on, as an
    nn.Linear would be, and every row's d/dlogits is kept (in that dtype) for d/dW in backward.

    With `segments` (a segment index per row, `count` segments) it returns the per-segment sums
    instead of one total: the log-probability of each sequence of a preference batch, in the same
    single pass. d(CE_i)/d(hidden_i) does not depend on which sum row i goes to, so backward only
    scales each row's precomputed gradient by its segment's incoming gradient.

    `weight` may be a QuantizedHead (frozen, bias inside) instead: its two GEMMs per chunk then go
    a block of vocabulary rows at a time (head_logits, head_input_gradient)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor | QuantizedHead,
                bias: torch.Tensor | None, targets: torch.Tensor, chunk: int,
                softcap: float | None = None,
                segments: torch.Tensor | None = None, count: int = 1) -> torch.Tensor:
        total = hidden.new_zeros((count,) if segments is not None else (), dtype=torch.float32)
        quantized = weight if isinstance(weight, QuantizedHead) else None
        # The rows are padded with zeros (padded_rows): oneDNN's GEMMs run
        # slower on odd row counts, and a sequence of n tokens has n - 1 label rows.
        labelled = hidden.shape[0]
        padded = padded_rows(labelled)
        grad_hidden = (hidden.new_empty((padded, hidden.shape[1])) if hidden.requires_grad
                       else None)
        if quantized is not None:
            trains, compute = False, quantized.compute_dtype
        else:
            trains = weight.requires_grad or (bias is not None and bias.requires_grad)
            compute = (torch.get_autocast_dtype("cpu")
                       if trains and torch.is_autocast_enabled("cpu") else weight.dtype)
            ctx.weight_dtype = weight.dtype
            ctx.weight = weight  # the parameter, for a tied embedding (leave_head_gradient)
            weight = weight.detach().to(compute)
            bias = bias.detach().to(compute) if bias is not None else None
        inputs = hidden.detach().to(compute)  # what the head multiplies, and dW needs in backward
        if padded > labelled:
            inputs = torch.cat((inputs, inputs.new_zeros(padded - labelled, inputs.shape[1])))
        # Vocabulary-wide buffers serve every chunk (logits for the chunk, fp32 for a few of its
        # rows). A fresh 100+ MB tensor per chunk and op cost more than the softmax itself:
        # malloc maps such blocks anew each time and the kernel zero-fills every page on first
        # touch (docs/PERFORMANCE.md, "Loss head: label-only, chunked"). A trainable head keeps
        # every row's logit gradient, so its chunks are slices of one tensor of all the rows.
        width = min(chunk, padded)
        vocab = quantized.out_features if quantized is not None else weight.shape[0]
        logits_buffer = torch.empty((padded if trains else width, vocab), dtype=compute)
        # An fp32 head works on its logits in place: there is no copy to keep small, so it takes
        # the whole chunk at once (unless soft-capping needs a second buffer).
        in_place = compute == torch.float32
        rows_fp32 = width if in_place and not softcap else min(width, softmax_rows())
        fp32_buffer = None if in_place else torch.empty((rows_fp32, vocab), dtype=torch.float32)
        # Soft-capped logits (Gemma 2): cap * tanh(z / cap); the tanh is kept for the chain rule.
        tanh_buffer = torch.empty((rows_fp32, vocab), dtype=torch.float32) if softcap else None
        for start in range(0, padded, chunk):
            rows = inputs[start : start + chunk]
            real = max(0, min(rows.shape[0], labelled - start))  # the rows that are not padding
            target = targets[start : start + chunk]
            logits = logits_buffer[start : start + rows.shape[0]] if trains else \
                logits_buffer[: rows.shape[0]]
            if quantized is not None:
                head_logits(rows, quantized, logits)
            elif bias is None:
                torch.mm(rows, weight.t(), out=logits)
            else:
                torch.addmm(bias, rows, weight.t(), out=logits)
            # The softmax runs softmax_rows() rows at a time: rows are independent, so the result
            # is the same as over the whole chunk, while the fp32 copy stays small and in cache.
            for first in range(0, real, rows_fp32):
                part = logits[first : min(first + rows_fp32, real)]
                part_target = target[first : first + rows_fp32]
                # log-probabilities in fp32, in place (the softmax reads a row before writing it).
                logp = part if fp32_buffer is None else fp32_buffer[: part.shape[0]].copy_(part)
                if tanh_buffer is not None:
                    squashed = torch.div(logp, softcap, out=tanh_buffer[: part.shape[0]]).tanh_()
                    torch.mul(squashed, softcap, out=logp)
                torch.log_softmax(logp, dim=-1, out=logp)
                picked = logp.gather(1, part_target[:, None])
                if segments is None:
                    total -= picked.sum()
                else:
                    at = start + first
                    total.index_add_(0, segments[at : at + part.shape[0]], picked[:, 0], alpha=-1)
                if grad_hidden is not None or trains:
                    # d(CE)/d(logits) = softmax - one_hot, then back through the head.
                    probs = logp.exp_()
                    probs[torch.arange(part_target.shape[0]), part_target] -= 1.0
                    if tanh_buffer is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2
                        probs.mul_(squashed.square_().neg_().add_(1.0))
                    if probs is not part:
                        part.copy_(probs)
            if real < logits.shape[0]:
                logits[real:].zero_()  # padding rows: no gradient to the hidden states, W or b
            if grad_hidden is not None:
                grad_rows = grad_hidden[start : start + chunk]
                if quantized is not None:
                    head_input_gradient(logits, quantized, grad_rows)
                elif grad_rows.dtype == weight.dtype:
                    torch.mm(logits, weight, out=grad_rows)
                else:
                    grad_rows.copy_(logits @ weight)
        if grad_hidden is not None:
            grad_hidden = grad_hidden[:labelled]
        if trains:
            ctx.save_for_backward(grad_hidden, segments, logits_buffer, inputs)
        else:
            ctx.save_for_backward(grad_hidden, segments)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, segments, *kept = ctx.saved_tensors
        grads: list[torch.Tensor | None] = [None] * 8
        # Each row's incoming gradient: the total's, or that of its sequence's sum.
        scale = grad_output if segments is None else grad_output.index_select(0, segments)[:, None]
        if grad_hidden is not None:
            grads[0] = grad_hidden * scale.to(grad_hidden.dtype)
        if kept:  # the head trains: dW = sum_i scale_i dlogits_i^T rows_i, db = sum_i scale_i dlogits_i
            logit_grads, rows = kept
            scale = scale.to(rows.dtype)
            if segments is None:
                scale = scale.expand(rows.shape[0], 1)
            else:  # per-row scales for the label rows, none for the padding rows
                scale = torch.cat((scale, scale.new_zeros(rows.shape[0] - scale.shape[0], 1)))
            if ctx.needs_input_grad[1]:
                grads[1] = _weight_gradient(logit_grads, rows * scale, ctx.weight_dtype)
                leave_head_gradient(ctx.weight, grads[1])
            if ctx.needs_input_grad[2]:
                grads[2] = (scale.t() @ logit_grads)[0].to(ctx.weight_dtype)
        return tuple(grads)


def _weight_gradient(logit_grads: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
                     ) -> torch.Tensor:
    """logit_grads^T @ rows in `dtype`. From bf16 it is computed a block of vocabulary rows at a
    time, each cast into the fp32 result: one whole bf16 product would be a vocabulary-sized
    temporary (0.25 GiB for Qwen2.5-0.5B) at the start of backward, where activations are
    still all held."""
    if logit_grads.dtype == dtype:
        return logit_grads.t() @ rows
    vocab = logit_grads.shape[1]
    grad = torch.empty((vocab, rows.shape[1]), dtype=dtype)
    for start in range(0, vocab, _WEIGHT_GRADIENT_BLOCK):
        block = logit_grads[:, start : start + _WEIGHT_GRADIENT_BLOCK]
        grad[start : start + block.shape[1]].copy_(block.t() @ rows)
    return grad


# Label rows are padded to a multiple of this for the head's GEMMs: on Zen 5, 511 rows x 3,584 x
# 152,064 (a 512-token sequence on Qwen2.5-7B's head) took 732 ms forward and 1,034 ms for the
# hidden states' gradient, 512 rows 581 and 731 ms (docs/PERFORMANCE.md, "Loss head: label-only,
# chunked").
_ROW_MULTIPLE = 16


def padded_rows(rows: int) -> int:
    """How many rows the head's GEMMs run on for `rows` label rows (the plan counts them too)."""
    return rows + (-rows % _ROW_MULTIPLE)


# Vocabulary rows per block of the head's weight gradient: 8192 x 896 bf16 is 14 MiB, and a
# GEMM of 8192 rows runs as fast as the whole one (docs/PERFORMANCE.md, "Full fine-tuning: where
# the memory goes").
_WEIGHT_GRADIENT_BLOCK = 8192


def label_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat indices of positions that predict a label, their target ids). Labels shift by one."""
    shifted = labels[:, 1:]
    mask = shifted != IGNORE
    width = labels.shape[1]
    rows, cols = mask.nonzero(as_tuple=True)
    return rows * width + cols, shifted[mask]


def _weight_and_bias(head: nn.Module) -> tuple[Any, torch.Tensor | None]:
    """The head as _ChunkedLinearCrossEntropy takes it: (weight, bias), or (the QuantizedHead,
    None): its bias is added with its blocks."""
    if isinstance(head, QuantizedHead):
        return head, None
    return head.weight, head.bias


def chunked_lm_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor,
                    chunk: int, softcap: float | None = None) -> tuple[torch.Tensor, int]:
    """(sum of token losses, number of label tokens) from final hidden states; softcap: the
    model's final_logit_softcapping (logits become softcap * tanh(logits / softcap))."""
    flat_index, targets = label_positions(labels)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_index)
    total = _ChunkedLinearCrossEntropy.apply(rows, *_weight_and_bias(head), targets, chunk, softcap)
    return total, int(targets.numel())


def chunked_row_logps(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunk: int,
                      softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each row's label tokens summed, label tokens per row) from final hidden
    states: the label-only chunked head, one sum per row, never a full row of logits."""
    flat_index, targets = label_positions(labels)
    rows_of = torch.div(flat_index, labels.shape[1], rounding_mode="floor")
    count = labels.shape[0]
    counts = torch.bincount(rows_of, minlength=count)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_index)
    nll = _ChunkedLinearCrossEntropy.apply(rows, *_weight_and_bias(head), targets, chunk, softcap,
                                           rows_of, count)
    return -nll, counts


def full_row_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path of chunked_row_logps: full logits for every position."""
    shifted = labels[:, 1:]
    mask = shifted != IGNORE
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(2, shifted.clamp(min=0)[..., None])[..., 0]
    return (picked * mask).sum(dim=1), mask.sum(dim=1)


def full_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Reference path: full logits for every position (what HF's model(labels=...) does)."""
    shifted_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    shifted_labels = labels[:, 1:].reshape(-1)
    total = F.cross_entropy(shifted_logits, shifted_labels, ignore_index=IGNORE, reduction="sum")
    return total, int((shifted_labels != IGNORE).sum())


def packed_attention_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """4D additive mask (batch, 1, q, k): causal and only within the same segment (0 = padding)."""
    width = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = same & causal & (segments[:, None, :] > 0)
    # Padding rows attend to themselves so softmax never sees an all-masked row.
    allowed |= torch.eye(width, dtype=torch.bool)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


class LossOutput(NamedTuple):
    """What a loss module returns for a batch (a named tuple: DDP finds its tensors): sums over
    the batch, so that micro-batches and ranks add them up before anything is divided."""

    total: torch.Tensor  # sum of the per-unit losses (units: label tokens, rows, pairs, ...)
    count: torch.Tensor  # how many units: the loss of a step is total / count over all ranks
    metrics: dict[str, torch.Tensor] = {}  # the objective's own sums (rewards, correct rows, ...)


class CausalLMLoss(nn.Module):
    """Wraps a (peft) causal LM so forward returns a LossOutput (sum of token losses, label
    tokens); DDP wraps this.

    Prompt-learning adapters (prompt tuning, P-tuning, prefix tuning) are applied here as PEFT's
    own forward applies them (virtual tokens before the input's embeddings, or a prefix of keys
    and values in every layer), so that the label-only chunked head serves them too.
    """

    def __init__(self, model: nn.Module, chunk_size: int) -> None:
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config.get_text_config()  # a multimodal model's (Gemma 3 4B+) text model
        # Soft-capping (Gemma 2) is done chunk by chunk; other heads that post-process logits
        # (Cohere's logit_scale) take the full model path.
        self.softcap = getattr(config, "final_logit_softcapping", None) or None
        self.chunked = chunk_size > 0 and not getattr(config, "logit_scale", None)
        self.decoder = base.get_decoder()
        self.head = base.get_output_embeddings()
        peft_config = getattr(model, "active_peft_config", None)
        self.prompt = peft_config if getattr(peft_config, "is_prompt_learning", False) else None
        self.keep_hidden = False  # keep the last forward's hidden states (token accuracy)
        self.last_hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> LossOutput:
        if position_ids is not None:
            # Packed rows: attention_mask holds segment ids; keep attention inside each sample.
            dtype = self.decoder.get_input_embeddings().weight.dtype
            attention_mask = packed_attention_mask(attention_mask, dtype)
        if not self.chunked:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, output_hidden_states=self.keep_hidden)
            width = input_ids.shape[1]  # virtual tokens' positions (prompt tuning) are cut off
            if self.keep_hidden:
                self.last_hidden = out.hidden_states[-1][:, -width:]
            total, count = full_lm_loss(out.logits[:, -width:], labels)
            return LossOutput(total, torch.tensor(count))
        hidden = self.hidden_states(input_ids, attention_mask, position_ids)
        if self.keep_hidden:
            self.last_hidden = hidden
        total, count = chunked_lm_loss(hidden, self.head, labels, self.chunk_size, self.softcap)
        return LossOutput(total, torch.tensor(count))

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's last hidden states, one per input position."""
        if self.prompt is None:
            return self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids).last_hidden_state
        from peft import PeftType

        virtual = self.prompt.num_virtual_tokens
        rows, width = input_ids.shape
        mask = torch.cat((attention_mask.new_ones(rows, virtual), attention_mask), dim=1)
        if self.prompt.peft_type == PeftType.PREFIX_TUNING:
            prefix = self.model.get_prompt(rows, max_cache_len=width + virtual)
            return self.decoder(input_ids=input_ids, attention_mask=mask,
                                past_key_values=prefix, use_cache=True).last_hidden_state
        embeds = self.model.word_embeddings(input_ids)
        prompts = self.model.get_prompt(batch_size=rows).to(embeds.dtype)
        hidden = self.decoder(inputs_embeds=torch.cat((prompts, embeds), dim=1),
                              attention_mask=mask).last_hidden_state
        return hidden[:, virtual:]
