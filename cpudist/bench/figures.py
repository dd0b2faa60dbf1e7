"""The bench's figures: model FLOPs of a step, the GEMM peak they are compared with, padding, and
the table they are printed in.

Model FLOPs of one step (docs/PERFORMANCE.md), summed over samples of real length L:
  (4 * N_frozen + 6 * N_lora) * L + 6 * n_layers * d_attn * L^2  +  4 * V * H * label_tokens
forward 2N and input-gradient 2N for frozen decoder weights (no weight gradient), forward, input-
and weight-gradient 2N each for LoRA weights, causal attention (QK^T and AV, forward 2 L^2 d,
backward twice that), and the LM head only where a label exists (forward + input gradient).
DoRA adds, per micro-batch, its weight norm's B @ A product: 2 r in out forward, twice that back.
Prompt tuning and P-tuning put V virtual tokens in front of each sample (L + V positions in every
term but the head); prefix tuning gives every query P more keys and values: 12 n_layers d_attn P L
more attention. Their own trainable work (embeddings, a small encoder) is negligible.
Padding and recomputation (activation checkpointing) are work, not model FLOPs, so they lower MFU.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from cpudist.data.batches import Batch
from cpudist.records import BenchResult


@dataclass(frozen=True)
class FlopModel:
    n_frozen: int  # frozen decoder weights feeding matmuls (LM head and embeddings excluded)
    n_lora: int  # trainable LoRA weights
    n_layers: int
    attn_dim: int  # query heads x head dim
    head_params: int  # vocab x hidden of the LM head
    dora_products: int = 0  # sum of r x in x out over DoRA layers (their B @ A per micro-batch)
    virtual_tokens: int = 0  # prompt tuning / P-tuning: positions added in front of each sample
    prefix_keys: int = 0  # prefix tuning: keys and values added in every layer
    head_trained: bool = False  # peft.method=full: the head's weight gradient too (6, not 4)

    def step_flops(self, sample_lengths: list[int], label_tokens: int, passes: int = 1) -> float:
        """FLOPs of one step over these samples, in `passes` micro-batches."""
        lengths = [n + self.virtual_tokens for n in sample_lengths if n]
        linear = (4 * self.n_frozen + 6 * self.n_lora) * sum(lengths)
        attention = 6 * self.n_layers * self.attn_dim * sum(
            n * n + 2 * self.prefix_keys * n for n in lengths)
        dora = 6 * self.dora_products * passes
        head = (6 if self.head_trained else 4) * self.head_params * label_tokens
        return float(linear + attention + head + dora)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def flop_model(peft_model: nn.Module) -> FlopModel:
    """Parameter counts of a peft causal LM for the FLOP formula."""
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    config = base.config
    head = base.get_output_embeddings()
    from cpudist.model.quantize import QuantizedLinear

    n_frozen = n_lora = dora = 0
    for module in base.modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if magnitudes:  # a DoRA layer: its weight norm needs B @ A
            for adapter in magnitudes:
                a = module.lora_A[adapter].weight
                dora += a.shape[0] * a.shape[1] * module.lora_B[adapter].weight.shape[0]
    # The decoder's linears: a multimodal model's vision tower does not run on text.
    for name, module in base.get_decoder().named_modules():
        if isinstance(module, QuantizedLinear):  # frozen, stored quantized, computed in full
            n_frozen += module.in_features * module.out_features
            continue
        if not isinstance(module, nn.Linear) or module is head:
            continue
        # in x out, not weight.numel(): a peer's 4-bit layer packs two weights per element.
        # Trained linears (an adapter's, or every one with peft.method=full) cost 6 FLOPs per
        # weight and token (forward, input and weight gradients); frozen ones 4.
        if ".lora_" in name or module.weight.requires_grad:
            n_lora += module.in_features * module.out_features
        elif not module.weight.requires_grad:
            n_frozen += module.in_features * module.out_features
    config = config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    virtual, prefix = _prompt_positions(peft_model)
    return FlopModel(n_frozen=n_frozen, n_lora=n_lora, n_layers=config.num_hidden_layers,
                     attn_dim=config.num_attention_heads * head_dim,
                     head_params=head.in_features * head.out_features, dora_products=dora,
                     virtual_tokens=virtual, prefix_keys=prefix,
                     head_trained=not isinstance(head, QuantizedLinear) and head.weight.requires_grad)


def _prompt_positions(peft_model: nn.Module) -> tuple[int, int]:
    """(virtual tokens in front of each sample, prefix keys per layer) of a prompt-learning
    adapter; (0, 0) for any other model."""
    config = getattr(peft_model, "active_peft_config", None)
    if config is None or not getattr(config, "is_prompt_learning", False):
        return 0, 0
    tokens = int(config.num_virtual_tokens)
    return (0, tokens) if config.peft_type == "PREFIX_TUNING" else (tokens, 0)


def batch_sample_lengths(batch: Batch) -> list[int]:
    """Real lengths of the samples in a batch (packed rows hold several; 0 = padding)."""
    mask = batch.attention_mask
    if batch.position_ids is None:
        return [int(n) for n in (mask > 0).sum(dim=1).tolist()]
    lengths = []
    for row in mask:
        counts = torch.bincount(row)[1:]
        lengths += [int(n) for n in counts.tolist() if n]
    return lengths


class GemmPeak:
    """This machine's matmul peak in a dtype, measured the way MFU needs it: on a square GEMM and on
    the model's own shapes, probed several times through a run (a shared VM's peak drifts over
    minutes), the best probe kept. An achieved rate above it marks the run's MFU invalid."""

    def __init__(self, dtype: torch.dtype, shapes: list[tuple[int, int, int]] | None = None,
                 repeats: int = 3) -> None:
        self.dtype = dtype
        self.repeats = repeats
        self.shapes = [(2048, 2048, 2048), *(shapes or [])]
        self.samples: list[float] = []  # best FLOP/s of each probe

    def probe(self) -> float:
        # The operands live only while a probe runs (about 90 MB for a 0.5B model's shapes): kept
        # for the whole run they would count in the peak RSS the bench reports as the training's.
        best = 0.0
        generator = torch.Generator().manual_seed(0)
        for m, k, n in self.shapes:
            a = torch.randn(m, k, generator=generator, dtype=self.dtype)
            b = torch.randn(k, n, generator=generator, dtype=self.dtype)
            out = torch.empty(m, n, dtype=self.dtype)
            torch.mm(a, b, out=out)  # first call picks kernels
            flops = 2 * m * k * n
            for _ in range(self.repeats):
                start = time.perf_counter()
                torch.mm(a, b, out=out)
                best = max(best, flops / (time.perf_counter() - start))
            del a, b, out
        self.samples.append(best)
        return best

    @property
    def best(self) -> float:
        return max(self.samples)


def model_gemm_shapes(peft_model: nn.Module, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of the model's MLP matmuls for `tokens` rows: the shapes most of a step runs."""
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    config = base.config.get_text_config()
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", 4 * hidden)
    return [(tokens, hidden, inner), (tokens, inner, hidden)]


@dataclass(frozen=True)
class TimedStep:
    """What one timed step did, over every rank: the figures are computed from these."""

    seconds: float
    tokens: float  # real (non-padding) tokens fed
    label_tokens: float  # tokens with loss
    samples: int
    cells: float  # positions computed, padding included (rows x width)
    flops: float  # model FLOPs (FlopModel.step_flops)


@dataclass(frozen=True)
class Throughput:
    """The throughput and MFU figures of a bench (fields of the same names in BenchResult)."""

    tokens_per_s: float
    label_tokens_per_s: float
    samples_per_s: float
    s_per_step: float
    s_per_step_median: float
    label_tokens_per_s_best_step: float
    step_s: list[float]
    padding_fraction: float
    mfu: float
    mfu_valid: bool
    model_tflops: float
    peak_tflops: float
    peak_samples_tflops: list[float]


def throughput_figures(steps: list[TimedStep], peaks: list[float]) -> Throughput:
    """The figures of a bench's timed steps against the GEMM peaks probed in the same run: one
    definition for cpudist and its peers. Model FLOPs above the best probe make the MFU invalid
    (the probes missed the peak, or the FLOP model is off): tables mark it."""
    wall = sum(s.seconds for s in steps)
    tokens = sum(s.tokens for s in steps)
    cells = sum(s.cells for s in steps)
    achieved = sum(s.flops for s in steps) / wall
    peak = max(peaks)
    return Throughput(
        tokens_per_s=tokens / wall, label_tokens_per_s=sum(s.label_tokens for s in steps) / wall,
        samples_per_s=sum(s.samples for s in steps) / wall, s_per_step=wall / len(steps),
        s_per_step_median=statistics.median(s.seconds for s in steps),
        label_tokens_per_s_best_step=max(s.label_tokens / s.seconds for s in steps),
        step_s=[s.seconds for s in steps],
        padding_fraction=1.0 - tokens / cells if cells else 0.0,
        mfu=achieved / peak, mfu_valid=achieved <= peak, model_tflops=achieved / 1e12,
        peak_tflops=peak / 1e12, peak_samples_tflops=[p / 1e12 for p in peaks])


FIGURES = [("tokens_per_s", "tokens/s", "{:.1f}"), ("label_tokens_per_s", "label tokens/s", "{:.1f}"),
           ("samples_per_s", "samples/s", "{:.3f}"), ("s_per_step", "s/step", "{:.2f}"),
           ("s_per_step_median", "median s/step", "{:.2f}"),
           ("label_tokens_per_s_best_step", "label tokens/s, best step", "{:.1f}"),
           ("peak_rss_gb", "peak RSS GB (max rank)", "{:.2f}"), ("node_pss_gb", "node PSS GB", "{:.2f}"),
           ("mfu", "MFU", "{:.1%}"), ("padding_fraction", "padding", "{:.1%}"),
           ("comm_mb_per_step", "allreduce MB/step", "{:.1f}"),
           ("comm_exposed_s_per_step", "exposed allreduce s/step", "{:.3f}"),
           ("wait_for_slowest_s", "wait for slowest rank s (max rank)", "{:.3f}")]
# Figures of cpudist's own allreduce and ranks, which a peer's result does not measure.
PER_RANK_FIGURES = ("comm_mb_per_step", "comm_exposed_s_per_step", "wait_for_slowest_s")


def format_table(results: dict[str, BenchResult],
                 ratios: list[tuple[str, str]] | None = None) -> str:
    """A markdown table: one column per result, and one per ratio (a / b) asked for."""
    names = list(results)
    ratios = ratios or []
    header = ["figure", *names, *(f"{a} / {b}" for a, b in ratios)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, label, fmt in FIGURES:
        if key in PER_RANK_FIGURES and any(r.framework != "cpudist" for r in results.values()):
            continue  # only cpudist's side measures its allreduce and ranks
        cells = [fmt.format(results[name].figure(key))
                 + (" (invalid: above the measured peak)"
                    if key == "mfu" and not results[name].mfu_valid else "")
                 for name in names]
        for a_name, b_name in ratios:
            a, b = results[a_name].figure(key), results[b_name].figure(key)
            cells.append(f"{a / b:.2f}x" if b else "-")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    first = next(iter(results.values()))
    lines.append("")
    lines.append(f"dtype {first.dtype}; {first.world_size} rank(s) x {first.threads} "
                 f"thread(s); peak GEMM {first.peak_tflops * 1000:.0f} GFLOP/s (this run); "
                 f"{first.steps} timed steps after {first.warmup_steps} warm-up; {first.data}")
    for name, result in results.items():
        if result.prepared:  # a pass before the timed steps, which their figures leave out
            spent = (f" ({result.prepare_s:.1f} s before the timed steps)"
                     if result.prepare_s >= 0.05 else "")
            lines.append(f"{name}: {result.prepared}{spent}")
    return "\n".join(lines)
