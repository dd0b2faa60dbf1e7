"""`cpudist bench` and `cpudist scaling`: throughput, memory and MFU of a short LoRA training.

A bench builds the model from a preset (random weights in the exact architecture, written once as
safetensors plus SmolLM2's tokenizer into .cache/bench/ so cpudist and the Hugging Face baseline read
the same files), trains a few steps with the same pieces as `cpudist train` (CausalLMLoss, DDP,
AdamW, the dtype policy) and reports, after warm-up steps:

- tokens_per_s: every real (non-padding) token fed, all ranks; label_tokens_per_s: tokens with loss.
- peak_rss_gb per rank (ru_maxrss) and node_pss_gb: the sum over the node's ranks of the largest
  proportional set size seen (shared weight pages count once per node, split between ranks).
- mfu: model FLOPs per second / GEMM peak of the compute dtype measured in the same run (before and
  after the timed steps, several times each, maximum kept, all ranks at once).

Model FLOPs of one step (docs/PERFORMANCE.md), summed over samples of real length L:
  (4 * N_frozen + 6 * N_lora) * L + 6 * n_layers * d_attn * L^2  +  4 * V * H * label_tokens
forward 2N and input-gradient 2N for frozen decoder weights (no weight gradient), forward, input-
and weight-gradient 2N each for LoRA weights, causal attention (QK^T and AV, forward 2 L^2 d,
backward twice that), and the LM head only where a label exists (forward + input gradient).
Padding and recomputation (activation checkpointing) are work, not model FLOPs, so they lower MFU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cpudist.allocator import CHOICES as ALLOCATORS
from cpudist.allocator import in_use as allocator_in_use
from cpudist.config import Config, load_config
from cpudist.errors import UserError

log = logging.getLogger("cpudist")

BENCH_CACHE = Path(".cache/bench")
DATA_KINDS = ("synthetic", "instruct")


# --------------------------------------------------------------------------- model presets


@dataclass(frozen=True)
class Preset:
    family: str  # qwen2 | llama | builtin
    config: dict[str, Any]


PRESETS: dict[str, Preset] = {
    # Exact Qwen2.5-0.5B architecture (random weights).
    "qwen2.5-0.5b": Preset("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # The real quickstart model (pretrained weights of the built-in smollm2-135m-instruct).
    "smollm2-135m": Preset("builtin", {"name": "smollm2-135m-instruct"}),
    # Llama-2-7B shape, for memory arithmetic on big nodes (shrink with --layers elsewhere).
    "llama-7b": Preset("llama", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
}


def _builtin_tokenizer_dir(cache_dir: str) -> Path:
    from cpudist.config import ModelConfig
    from cpudist.model import resolve_model_path

    return resolve_model_path(ModelConfig(cache_dir=cache_dir))


def preset_dir(name: str, layers: int | None = None, model_cache: str = ".cache/models",
               root: Path = BENCH_CACHE) -> Path:
    """The preset's model directory (safetensors + tokenizer), written once under a file lock."""
    from cpudist.model import file_lock

    if name not in PRESETS:
        raise UserError(f"--preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    if layers is not None and layers < 1:
        raise UserError(f"--layers {layers}: needs at least 1 layer")
    target = root / (f"{name}-L{layers}" if layers else name)
    with file_lock(root / f".{target.name}.lock"):
        if not (target / "config.json").exists():
            _write_preset(PRESETS[name], layers, model_cache, target)
    return target


def _write_preset(preset: Preset, layers: int | None, model_cache: str, target: Path) -> None:
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    source = _builtin_tokenizer_dir(model_cache)
    tokenizer = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    if preset.family == "builtin":
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        if layers is not None and layers < model.config.num_hidden_layers:
            model.model.layers = model.model.layers[:layers]
            model.config.num_hidden_layers = layers
            if getattr(model.config, "layer_types", None):
                model.config.layer_types = model.config.layer_types[:layers]
    else:
        settings = dict(preset.config)
        if layers is not None:
            settings["num_hidden_layers"] = layers
        settings.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        config_cls, model_cls = ((Qwen2Config, Qwen2ForCausalLM) if preset.family == "qwen2"
                                 else (LlamaConfig, LlamaForCausalLM))
        # Small init keeps random-weight activations and losses finite in bf16.
        model = model_cls(config_cls(initializer_range=0.02, **settings))
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)


# --------------------------------------------------------------------------- data


def synthetic_split(samples: int, seq_len: int, vocab: int, seed: int) -> Any:
    """Uniform-length rows of random token ids in [0, vocab); every token is a label."""
    from cpudist.data import TokenizedSplit

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (samples, seq_len), generator=generator).tolist()
    return TokenizedSplit(ids, [list(row) for row in ids])


def fixed_sample_set(split: Any, samples: int, seed: int, where: str) -> Any:
    """`samples` samples of `split`, drawn once (seeded). cpudist's bench and the HF baseline both
    time exactly one epoch over this set, so label tokens/s compares the same work: each side
    batches the samples its own way (length-grouped vs random) but neither can draw an easier set."""
    from cpudist.data import TokenizedSplit

    if len(split) < samples:
        raise UserError(f"{where} has {len(split)} training samples; the bench times one epoch of "
                        f"--steps x batch x grad_accum x ranks = {samples} samples: lower --steps or "
                        "the batch size, or use a bigger data.path")
    chosen = sorted(random.Random(seed).sample(range(len(split)), samples))
    return TokenizedSplit([split.input_ids[i] for i in chosen], [split.labels[i] for i in chosen])


def bench_step_position(step: int, warmup: int, steps_per_epoch: int) -> tuple[int, int]:
    """(epoch, index) of bench step `step`: warm-up steps run first; the timed steps then start a
    fresh epoch, so `--steps` timed steps cover the fixed sample set exactly once."""
    if step < warmup:
        return divmod(step, steps_per_epoch)
    warm_epochs = -(-warmup // steps_per_epoch)
    epoch, index = divmod(step - warmup, steps_per_epoch)
    return warm_epochs + epoch, index


def padding_fraction(batches: list[Any]) -> float:
    """Share of the computed positions (rows x width) that hold padding."""
    cells = sum(b.input_ids.numel() for b in batches)
    real = sum(b.tokens for b in batches)
    return 0.0 if cells == 0 else 1.0 - real / cells


# --------------------------------------------------------------------------- FLOPs and peak


@dataclass(frozen=True)
class FlopModel:
    n_frozen: int  # frozen decoder weights feeding matmuls (LM head and embeddings excluded)
    n_lora: int  # trainable LoRA weights
    n_layers: int
    attn_dim: int  # query heads x head dim
    head_params: int  # vocab x hidden of the LM head

    def step_flops(self, sample_lengths: list[int], label_tokens: int) -> float:
        linear = (4 * self.n_frozen + 6 * self.n_lora) * sum(sample_lengths)
        attention = 6 * self.n_layers * self.attn_dim * sum(n * n for n in sample_lengths)
        return float(linear + attention + 4 * self.head_params * label_tokens)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def flop_model(peft_model: nn.Module) -> FlopModel:
    """Parameter counts of a peft causal LM for the FLOP formula."""
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    config = base.config
    head = base.get_output_embeddings()
    n_frozen = n_lora = 0
    for name, module in base.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        if ".lora_" in name:
            n_lora += module.weight.numel()
        elif not module.weight.requires_grad:
            n_frozen += module.weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return FlopModel(n_frozen=n_frozen, n_lora=n_lora, n_layers=config.num_hidden_layers,
                     attn_dim=config.num_attention_heads * head_dim,
                     head_params=head.weight.numel())


def batch_sample_lengths(batch: Any) -> list[int]:
    """Real lengths of the samples in a batch (packed rows hold several; 0 = padding)."""
    mask = batch.attention_mask
    if batch.position_ids is None:
        return [int(n) for n in (mask > 0).sum(dim=1).tolist()]
    lengths = []
    for row in mask:
        counts = torch.bincount(row)[1:]
        lengths += [int(n) for n in counts.tolist() if n]
    return lengths


def gemm_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 4) -> float:
    """Best FLOP/s of a size^3 matmul in dtype with this process's threads (the bench calls it
    before and after the timed steps and keeps the maximum: this machine's peak drifts)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # first call picks kernels
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


# --------------------------------------------------------------------------- memory


class PssSampler:
    """Largest proportional set size of this process, sampled in the background (psutil)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        import psutil

        self.process = psutil.Process()
        self.peak = 0
        self.interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        with contextlib.suppress(OSError, AttributeError):  # no smaps: no PSS figure
            self.peak = max(self.peak, self.process.memory_full_info().pss)
        return self.peak

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PssSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# --------------------------------------------------------------------------- the bench


@dataclass
class BenchArgs:
    preset: str | None
    layers: int | None
    data: str
    steps: int
    warmup: int
    batch_size: int | None
    seq_len: int | None
    dtype: str | None
    threads: int | None


def bench_config(config_path: str | None, overrides: list[str], args: BenchArgs) -> Config:
    """The run's config: CONFIG + overrides, then the bench flags (which win)."""
    extra = []
    if args.batch_size:
        extra.append(f"train.batch_size={args.batch_size}")
    if args.seq_len:
        extra.append(f"data.max_length={args.seq_len}")
    if args.dtype:
        extra.append(f"model.dtype={args.dtype}")
    if args.threads:
        extra.append(f"dist.threads_per_rank={args.threads}")
    config = load_config(config_path, [*overrides, *extra])
    if args.preset:
        config.model.path = str(preset_dir(args.preset, args.layers, config.model.cache_dir))
    elif args.layers:
        raise UserError("--layers needs --preset (it shrinks a preset model)")
    return config


def make_data(config: Config, kind: str, samples: int, tokenizer: Any, vocab: int) -> tuple[Any, str]:
    """(training split, description)."""
    from cpudist.data import build_datasets

    if kind == "synthetic":
        return (synthetic_split(samples, config.data.max_length, vocab, config.train.seed),
                f"synthetic: {samples} rows x {config.data.max_length} random tokens, all labels")
    if kind != "instruct":
        raise UserError(f"--data {kind!r}: choose one of {', '.join(DATA_KINDS)}")
    train, _, stats = build_datasets(config.data, tokenizer, config.train.seed)
    train = fixed_sample_set(train, samples, config.train.seed, f"data.path {config.data.path}")
    return train, (f"instruct: {stats['source']} ({samples} of {stats['train']} samples, "
                   "prompt tokens masked)")


def run_bench(config: Config, args: BenchArgs) -> dict[str, Any] | None:
    """Train warm-up + timed steps as this rank; rank 0 returns the result."""
    import torch.distributed as dist

    from cpudist.cluster import (
        configure_logging,
        detect_placement,
        init_process_group,
        pin_threads,
        shutdown,
        threads_for_rank,
    )
    from cpudist.quiet import quiet_libraries

    quiet_libraries()
    placement = detect_placement()
    configure_logging(placement)
    threads = threads_for_rank(placement, config.dist.threads_per_rank)
    pin_threads(placement, threads)
    if placement.distributed:
        init_process_group(placement, config.dist.backend, config.dist.master_addr,
                           config.dist.master_port, config.dist.interface, config.dist.timeout_s)
    try:
        return _bench(config, args, placement, threads, dist)
    finally:
        shutdown()


def _bench(config: Config, args: BenchArgs, placement: Any, threads: int, dist: Any
           ) -> dict[str, Any] | None:
    from cpudist.data import GlobalBatches
    from cpudist.loss import CausalLMLoss
    from cpudist.model import build_model, trainable_parameters
    from cpudist.trainer import (
        _wrap_ddp,
        accumulate_gradients,
        agree_on_error,
        allreduce,
        make_batch,
    )

    tc = config.train
    world, rank = placement.world_size, placement.rank
    random.seed(tc.seed)
    torch.manual_seed(tc.seed)
    total_steps = args.warmup + args.steps
    error = None
    try:
        peft_model, tokenizer, dtype_reason, model_dir = build_model(config.model, config.lora)
        vocab = peft_model.get_base_model().config.vocab_size
        samples = args.steps * tc.batch_size * tc.grad_accum * world
        train_data, data_desc = make_data(config, args.data, samples, tokenizer, vocab)
    except UserError as exc:
        error = str(exc)
    agree_on_error(placement, error)
    compute_bf16 = dtype_reason.startswith("bfloat16")
    compute_dtype = torch.bfloat16 if compute_bf16 else torch.float32

    def autocast() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_bf16)

    loss_module = CausalLMLoss(peft_model, tc.loss_chunk_size)
    params = [p for _, p in trainable_parameters(loss_module)]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    step_module: nn.Module = _wrap_ddp(loss_module, config) if placement.distributed else loss_module
    if tc.compile:
        step_module = torch.compile(step_module)
    batches = GlobalBatches(train_data, tc.batch_size, tc.grad_accum, world, tc.seed,
                            config.data.group_by_length)
    flops = flop_model(peft_model)

    def barrier() -> None:
        if placement.distributed:
            dist.barrier()

    def peak() -> float:
        barrier()
        value = gemm_peak(compute_dtype)
        (total,) = allreduce([value], placement)  # all ranks ran at once: the node's peak
        return total

    peaks = [peak()]
    step_times: list[float] = []
    step_labels: list[float] = []
    fed = labels = 0.0
    model_flops = 0.0
    sample_count = 0
    padded: list[Any] = []
    with PssSampler() as pss:
        for step in range(total_steps):
            barrier()
            started = time.perf_counter()
            epoch, index = bench_step_position(step, args.warmup, batches.steps_per_epoch)
            micro = [make_batch(train_data, ix, tokenizer.pad_token_id, config)
                     for ix in batches.step_batches(epoch, index, rank)]
            lengths = [n for b in micro for n in batch_sample_lengths(b)]
            label_tokens, fed_tokens, step_flops = allreduce(
                [sum(b.label_tokens for b in micro), sum(b.tokens for b in micro),
                 flops.step_flops(lengths, sum(b.label_tokens for b in micro))], placement)
            loss_local = accumulate_gradients(step_module, micro, placement, label_tokens, autocast)
            torch.nn.utils.clip_grad_norm_(params, tc.max_grad_norm or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            (loss_total,) = allreduce([loss_local], placement)
            elapsed = time.perf_counter() - started
            if step >= args.warmup:
                step_times.append(elapsed)
                step_labels.append(label_tokens)
                fed += fed_tokens
                labels += label_tokens
                model_flops += step_flops
                sample_count += len(lengths)
                padded += micro
            log.info("bench step %d/%d%s: %.2f s, loss %.4f", step + 1, total_steps,
                     " (warm-up)" if step < args.warmup else "", elapsed,
                     loss_total / max(label_tokens, 1.0))
    peaks.append(peak())
    peak_rss = _peak_rss_gb()
    (pad_cells, pad_real) = allreduce([float(sum(b.input_ids.numel() for b in padded)),
                                       float(sum(b.tokens for b in padded))], placement)
    per_rank = [(socket.gethostname(), peak_rss, pss.peak / 1024**3)]
    if placement.distributed:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, per_rank[0])
        per_rank = gathered
    if not placement.is_main:
        return None
    wall = sum(step_times)
    node_pss: dict[str, float] = {}
    for host, _, pss_gb in per_rank:
        node_pss[host] = node_pss.get(host, 0.0) + pss_gb
    peak_flops = max(peaks)
    return {
        "tokens_per_s": fed / wall, "label_tokens_per_s": labels / wall,
        "samples_per_s": sample_count / wall, "s_per_step": wall / len(step_times),
        # Robust to other processes stealing the cores for a while (see docs/PERFORMANCE.md).
        "s_per_step_median": statistics.median(step_times),
        "label_tokens_per_s_best_step": max(n / t for n, t in zip(step_labels, step_times,
                                                                   strict=True)),
        "peak_rss_gb": [rss for _, rss, _ in per_rank],
        "node_pss_gb": max(node_pss.values()),
        "mfu": model_flops / wall / peak_flops,
        "model_tflops": model_flops / wall / 1e12, "peak_tflops": peak_flops / 1e12,
        "peak_samples_tflops": [p / 1e12 for p in peaks],
        "padding_fraction": 0.0 if pad_cells == 0 else 1.0 - pad_real / pad_cells,
        "dtype": dtype_reason, "threads": threads, "world_size": world,
        "steps": args.steps, "warmup_steps": args.warmup, "step_s": step_times,
        "data": data_desc, "model_dir": str(model_dir), "preset": args.preset,
        "layers": args.layers, "flop_model": flops.as_dict(),
        "allocator": allocator_in_use(), "framework": "cpudist",
        "config": config.to_dict(),
    }


def _peak_rss_gb() -> float:
    from cpudist.report import peak_rss_gb

    return peak_rss_gb()


# --------------------------------------------------------------------------- reporting

FIGURES = [("tokens_per_s", "tokens/s", "{:.1f}"), ("label_tokens_per_s", "label tokens/s", "{:.1f}"),
           ("samples_per_s", "samples/s", "{:.3f}"), ("s_per_step", "s/step", "{:.2f}"),
           ("s_per_step_median", "median s/step", "{:.2f}"),
           ("label_tokens_per_s_best_step", "label tokens/s, best step", "{:.1f}"),
           ("peak_rss_gb", "peak RSS GB (max rank)", "{:.2f}"), ("node_pss_gb", "node PSS GB", "{:.2f}"),
           ("mfu", "MFU", "{:.1%}"), ("padding_fraction", "padding", "{:.1%}")]


def figure(result: dict[str, Any], key: str) -> float:
    value = result[key]
    return max(value) if isinstance(value, list) else float(value)


def format_table(results: dict[str, dict[str, Any]], ratio_of: tuple[str, str] | None = None) -> str:
    """A markdown table: one column per result (and a ratio column)."""
    names = list(results)
    header = ["figure", *names] + ([f"{ratio_of[0]} / {ratio_of[1]}"] if ratio_of else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, label, fmt in FIGURES:
        if not all(key in r for r in results.values()):
            continue
        cells = [fmt.format(figure(results[name], key)) for name in names]
        if ratio_of:
            a, b = figure(results[ratio_of[0]], key), figure(results[ratio_of[1]], key)
            cells.append(f"{a / b:.2f}x" if b else "-")
        lines.append("| " + " | ".join([label, *cells]) + " |")
    first = next(iter(results.values()))
    lines.append("")
    lines.append(f"dtype {first['dtype']}; {first['world_size']} rank(s) x {first['threads']} "
                 f"thread(s); peak GEMM {first['peak_tflops'] * 1000:.0f} GFLOP/s (this run); "
                 f"{first['steps']} timed steps after {first['warmup_steps']} warm-up; "
                 f"{first['data']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- vs Hugging Face


def _subprocess_env(allocator: str | None) -> dict[str, str]:
    """This process's environment set up for a benchmark child process to run on `allocator`
    (None: what cpudist.allocator.requested says)."""
    from cpudist.allocator import choose_allocator, preload_env, requested

    name, lib = choose_allocator(requested(allocator))
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            **preload_env(name, lib, os.environ.get("LD_PRELOAD"))}


RESULT_MARK = "CPUDIST_BENCH_RESULT "


def _run_json(cmd: list[str], env: dict[str, str], what: str, on_stdout: bool = False
              ) -> dict[str, Any]:
    """Run a benchmark process and return its result: the --json file it wrote, or (on_stdout:
    `--json -`) the one line it printed after RESULT_MARK, which also works when it ran elsewhere."""
    with tempfile.TemporaryDirectory(prefix="cpudist-bench-") as tmp:
        out = Path(tmp) / "result.json"
        target = "-" if on_stdout else str(out)
        print(f"$ {' '.join(cmd)} --json {target}", file=sys.stderr, flush=True)
        proc = subprocess.run([*cmd, "--json", target], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        printed = [line[line.index(RESULT_MARK) + len(RESULT_MARK):]
                   for line in proc.stdout.splitlines() if RESULT_MARK in line]
        if proc.returncode == 0 and on_stdout and printed:
            return json.loads(printed[-1])
        if proc.returncode == 0 and not on_stdout and out.exists():
            return json.loads(out.read_text())
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise UserError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def hf_command(config: Config, args: BenchArgs) -> list[str]:
    """`python -m cpudist.hf_baseline ...` with the same model, data, batch and LoRA settings."""
    lora = config.lora
    targets = (lora.target_modules if isinstance(lora.target_modules, str)
               else ",".join(lora.target_modules))
    cmd = [sys.executable, "-m", "cpudist.hf_baseline", "--model", config.model.path,
           "--data", args.data, "--data-path", config.data.path, "--data-format", config.data.format,
           "--data-cache", config.data.cache_dir, "--seq-len", str(config.data.max_length),
           "--batch-size", str(config.train.batch_size), "--grad-accum", str(config.train.grad_accum),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--dtype", config.model.dtype, "--lr", str(config.train.lr),
           "--lora-r", str(lora.r), "--lora-alpha", str(lora.alpha),
           "--lora-dropout", str(lora.dropout), "--target-modules", targets,
           "--seed", str(config.train.seed)]
    if config.dist.threads_per_rank:
        cmd += ["--threads", str(config.dist.threads_per_rank)]
    if config.model.gradient_checkpointing:
        cmd.append("--gradient-checkpointing")
    return cmd


def run_vs_hf(config_path: str | None, overrides: list[str], args: BenchArgs, config: Config,
              rounds: int, allocator: str | None, hf_allocator: str) -> dict[str, Any]:
    """Alternate cpudist and HF runs (separate processes); best figures of each, and ratios.

    Each side runs on its own allocator: cpudist's (default auto, as `cpudist train` runs) and
    hf_allocator (default none: glibc malloc, as HF Trainer runs unless a user preloads one).
    """
    ours = [sys.executable, "-m", "cpudist.cli", "bench"]
    if config_path:
        ours.append(config_path)
    ours += [*overrides, *_flag_args(args)]
    env, hf_env = _subprocess_env(allocator), _subprocess_env(hf_allocator)
    runs: dict[str, list[dict[str, Any]]] = {"cpudist": [], "hf": []}
    for _ in range(rounds):
        runs["cpudist"].append(_run_json(ours, env, "cpudist bench"))
        runs["hf"].append(_run_json(hf_command(config, args), hf_env, "Hugging Face baseline"))
    best = {name: max(items, key=lambda r: r["tokens_per_s"]) for name, items in runs.items()}
    ratios = {key: figure(best["cpudist"], key) / figure(best["hf"], key)
              for key, _, _ in FIGURES if key in best["hf"] and figure(best["hf"], key)}
    return {"cpudist": best["cpudist"], "hf": best["hf"], "ratios": ratios, "rounds": runs}


def plot_vs(outcome: dict[str, Any], path: Path) -> None:
    """Bar chart of cpudist / HF for each figure (above 1 = cpudist higher)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {key: label for key, label, _ in FIGURES}
    keys = [k for k in outcome["ratios"] if k != "padding_fraction"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bars = ax.bar([labels[k] for k in keys], [outcome["ratios"][k] for k in keys])
    ax.bar_label(bars, fmt="%.2fx")
    ax.axhline(1.0, color="grey", linestyle="--")
    ax.set_ylabel("cpudist / HF Trainer")
    ax.set_title(f"cpudist vs HF Trainer+PEFT: {outcome['cpudist']['data'].split(':')[0]}, "
                 f"{outcome['cpudist']['dtype'].split(':')[0]}")
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _flag_args(args: BenchArgs) -> list[str]:
    flags = ["--data", args.data, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    for flag, value in (("--preset", args.preset), ("--layers", args.layers),
                        ("--batch-size", args.batch_size), ("--seq-len", args.seq_len),
                        ("--dtype", args.dtype), ("--threads", args.threads)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


# --------------------------------------------------------------------------- scaling


def run_scaling(config_path: str | None, overrides: list[str], args: BenchArgs,
                counts: list[int], total_threads: int, allocator: str | None,
                per_rank_batch: bool = False, hostfile: str | None = None,
                mpi_args: list[str] | None = None) -> list[dict[str, Any]]:
    """The bench under mpirun at each rank count, threads split between the ranks of a node; the
    mpirun command (hostfile, binding, thread variables, allocator preload) is the one `cpudist
    launch` builds. Rank 0 prints its figures on stdout, so it may run on another node."""
    from cpudist.allocator import choose_allocator, requested
    from cpudist.launcher import (
        build_command,
        caller_settings,
        detect_mpi,
        plan_layout,
        prepare_hostfile,
    )

    mpi = detect_mpi()
    name, lib = choose_allocator(requested(allocator))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpudist-scaling-") as workdir:
        path, hosts = prepare_hostfile(hostfile, mpi, workdir) if hostfile else (None, None)
        for np in counts:
            # total_threads are one node's: the busiest node's ranks share them.
            threads = plan_layout(np, total_threads, hosts, None).threads
            batch = args.batch_size
            if batch and not per_rank_batch:
                # Same global batch at every rank count: each rank gets its share.
                if batch % np:
                    raise UserError(f"--batch-size {batch} does not split over {np} ranks; choose "
                                    "a multiple of every rank count, or pass --per-rank-batch")
                batch //= np
            flags = _flag_args(BenchArgs(**{**args.__dict__, "threads": threads,
                                            "batch_size": batch}))
            program = ["bench"] + ([config_path] if config_path else []) + [*overrides, *flags]
            cmd = build_command(mpi, np, program, python=sys.executable,
                                cores_per_node=total_threads, hostfile=path, hosts=hosts,
                                threads_per_rank=threads, allocator=name, preload=lib,
                                mpi_args=mpi_args or [], **caller_settings(os.environ))
            rows.append(_run_json(cmd, env, f"bench with {np} rank(s)", on_stdout=True))
    return rows


def scaling_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The figures of each rank count that go into the scaling table."""
    base = rows[0]
    return [{"world_size": r["world_size"], "tokens_per_s": r["tokens_per_s"],
             "threads_per_rank": r["threads"],
             "batch_per_rank": r["config"]["train"]["batch_size"], "s_per_step": round(r["s_per_step"], 3),
             "mfu": round(r["mfu"], 3), "node_pss_gb": round(r["node_pss_gb"], 2),
             "pss_vs_first": round(r["node_pss_gb"] / base["node_pss_gb"], 2),
             "peak_rss_gb_per_rank": round(max(r["peak_rss_gb"]), 2)} for r in rows]


def write_scaling(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    """scaling.json (every figure), scaling.md and scaling.png (cpudist.plots); returns the .md."""
    from cpudist.plots import write_scaling_report

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scaling.json").write_text(json.dumps(rows, indent=1))
    md_path, _ = write_scaling_report(scaling_rows(rows), out_dir)
    return md_path


# --------------------------------------------------------------------------- command line


def _add_bench_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="random-weight model of this architecture (smollm2-135m: the real one)")
    parser.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    parser.add_argument("--data", default="synthetic", choices=DATA_KINDS,
                        help="synthetic: full-length rows, all labels; instruct: data.path with "
                             "real lengths and prompt masking (default chatterbot:english)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps (default 1)")
    parser.add_argument("--batch-size", type=int, help="train.batch_size")
    parser.add_argument("--seq-len", type=int, help="data.max_length (synthetic row length)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], help="model.dtype")
    parser.add_argument("--threads", type=int, help="dist.threads_per_rank")
    parser.add_argument("--allocator", choices=ALLOCATORS,
                        help="malloc of cpudist's benchmark processes (default: CPUDIST_ALLOCATOR, "
                             "else auto = jemalloc when installed); --hf-allocator sets HF's")
    parser.add_argument("--json", type=Path,
                        help="write the result here (bench: - prints it as one line on stdout)")


def _bench_args(ns: argparse.Namespace) -> tuple[str | None, list[str], BenchArgs]:
    config_path, overrides = ns.config, list(ns.overrides)
    if config_path is not None and "=" in config_path:
        overrides.insert(0, config_path)
        config_path = None
    for name in ("steps", "batch_size", "seq_len", "threads"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if ns.warmup < 0:
        raise UserError(f"--warmup {ns.warmup}: must be 0 or more")
    return config_path, overrides, BenchArgs(ns.preset, ns.layers, ns.data, ns.steps, ns.warmup,
                                             ns.batch_size, ns.seq_len, ns.dtype, ns.threads)


def bench_main(ns: argparse.Namespace) -> int:
    config_path, overrides, args = _bench_args(ns)
    config = bench_config(config_path, overrides, args)
    if ns.vs == "hf":
        outcome = run_vs_hf(config_path, overrides, args, config, ns.rounds, ns.allocator,
                            ns.hf_allocator)
        table = format_table({"cpudist": outcome["cpudist"], "hf": outcome["hf"]},
                             ratio_of=("cpudist", "hf"))
        print(table)
        if ns.json:
            ns.json.write_text(json.dumps(outcome, indent=1))
            plot_vs(outcome, ns.json.with_suffix(".png"))
            print(f"written: {ns.json}, {ns.json.with_suffix('.png')}")
        return 0
    result = run_bench(config, args)  # on --allocator: the CLI started this process on it
    if result is None:  # not rank 0
        return 0
    print(format_table({"cpudist": result}))
    if ns.json == Path("-"):
        print(RESULT_MARK + json.dumps(result), flush=True)
    elif ns.json:
        ns.json.write_text(json.dumps(result, indent=1))
    return 0


def scaling_main(ns: argparse.Namespace) -> int:
    config_path, overrides, args = _bench_args(ns)
    try:
        counts = [int(n) for n in ns.np.split(",")]
    except ValueError:
        raise UserError(f"--np {ns.np!r}: give rank counts like 1,2,4") from None
    if not counts or min(counts) < 1:
        raise UserError(f"--np {ns.np!r}: rank counts must be positive")
    bench_config(config_path, overrides, args)  # fail early, and write the preset once
    from cpudist.cluster import physical_cores

    total = ns.total_threads or physical_cores()
    if args.batch_size is None and not ns.per_rank_batch:
        args.batch_size = load_config(config_path, overrides).train.batch_size
    rows = run_scaling(config_path, overrides, args, counts, total, ns.allocator,
                       ns.per_rank_batch, ns.hostfile, ns.mpi_arg)
    md_path = write_scaling(rows, ns.out)
    print(md_path.read_text())
    print(f"written: {md_path}, {ns.out / 'scaling.json'}, {ns.out / 'scaling.png'}")
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=1))
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench", help="throughput / memory / MFU of a short training (optionally vs HF Trainer)",
        description="Train a few steps on a preset (random weights, exact architecture) and report "
                    "tokens/s, label tokens/s, samples/s, s/step, peak RSS per rank, node PSS and "
                    "MFU against the GEMM peak measured in the same run.")
    _add_bench_flags(parser)
    parser.add_argument("--vs", choices=["hf"], help="also run Hugging Face Trainer + PEFT on the "
                        "same model, data and settings (separate processes) and print ratios")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --vs: alternate cpudist/HF this many times, keep the best")
    parser.add_argument("--hf-allocator", default="none", choices=ALLOCATORS,
                        help="with --vs: malloc of the HF side (default none: glibc malloc, as HF "
                             "Trainer runs unless you preload one; auto gives it cpudist's)")
    parser.set_defaults(func=bench_main)

    scaling = subparsers.add_parser(
        "scaling", help="the bench under mpirun at several rank counts (threads split per rank)",
        description="Run `cpudist bench` under mpirun with each rank count; writes scaling.md, "
                    "scaling.json and scaling.png into --out.")
    _add_bench_flags(scaling)
    scaling.add_argument("--np", default="1,2", help="rank counts, comma separated (default 1,2)")
    scaling.add_argument("--total-threads", type=int,
                         help="threads of one node, shared by its ranks (default: this machine's "
                              "physical cores)")
    scaling.add_argument("--hostfile", "-f",
                         help="run the ranks on these hosts, as `cpudist launch --hostfile` (same "
                              "path, venv and .cache/bench on every node)")
    scaling.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                         help="extra argument for mpirun, repeatable (--mpi-arg=--mca ...)")
    scaling.add_argument("--per-rank-batch", action="store_true",
                         help="keep --batch-size per rank (default: the global batch is kept and "
                              "split between the ranks)")
    scaling.add_argument("--out", type=Path, default=Path("runs/scaling"), help="output directory")
    scaling.set_defaults(func=scaling_main)


def main(argv: list[str] | None = None) -> int:
    from cpudist.cli import main as cli_main

    return cli_main(["bench", *(argv or sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())

