"""The training loop: one readable function from config to adapter.

Each optimizer step: this rank's micro-batches -> forward (loss only at label positions) ->
backward under no_sync except the last micro-step -> DDP allreduce of LoRA gradients -> clip ->
AdamW -> schedule. Rank 0 alone logs, checkpoints and writes OUTPUT/.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import random
import shlex
import shutil
import signal
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cpudist import checkpoint as ckpt
from cpudist.allocator import in_use as allocator_in_use
from cpudist.cluster import (
    Placement,
    configure_logging,
    detect_placement,
    init_process_group,
    mpi_allreduce_hook,
    pin_threads,
    shutdown,
    threads_for_rank,
)
from cpudist.config import Config
from cpudist.data import IGNORE, Batch, GlobalBatches, TokenizedSplit, build_datasets, collate, pack
from cpudist.data import eval_batches as eval_batch_indices
from cpudist.errors import UserError
from cpudist.hardware import cpu_info
from cpudist.loss import CausalLMLoss
from cpudist.model import build_model, trainable_parameters
from cpudist.report import MetricsLog, Progress, peak_rss_gb

log = logging.getLogger("cpudist")

# Keys that may differ between a run and its continuation in the same output directory.
_RESUMABLE_KEYS = {("train", "resume"), ("output", "overwrite"), ("train", "max_steps"),
                   ("train", "epochs"), ("dist", "threads_per_rank"), ("dist", "master_addr"),
                   ("dist", "master_port"), ("dist", "interface"), ("dist", "timeout_s")}


# --------------------------------------------------------------------------- collectives


def allreduce(values: list[float], placement: Placement, op: str = "sum") -> list[float]:
    """Sum (or max) a few numbers over ranks; identity for a single process."""
    if not placement.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def agree_on_error(placement: Placement, error: str | None) -> None:
    """Raise the same UserError on every rank if any rank hit one (no rank is left waiting)."""
    if not placement.distributed:
        if error:
            raise UserError(error)
        return
    errors: list[str | None] = [None] * placement.world_size
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise UserError(first)


def rank0_only(placement: Placement, action: Any) -> Any:
    """Run action() on rank 0; a UserError there stops every rank with the same message."""
    error, result = None, None
    if placement.is_main:
        try:
            result = action()
        except UserError as exc:
            error = str(exc)
    agree_on_error(placement, error)
    return result


# --------------------------------------------------------------------------- output directory


def prepare_output(config: Config) -> Path:
    """Create OUTPUT/ (rank 0), refusing to mix a different run's files into it."""
    out = Path(config.output.dir)
    saved = out / "config.yaml"
    if saved.exists() and not config.output.overwrite:
        import yaml

        previous = yaml.safe_load(saved.read_text()) or {}
        current = config.to_dict()
        changed = sorted(
            f"{section}.{key}"
            for section, values in current.items()
            for key, value in values.items()
            if (section, key) not in _RESUMABLE_KEYS
            and previous.get(section, {}).get(key, value) != value
        )
        if changed:
            raise UserError(
                f"output directory {out} holds a run with a different config ({', '.join(changed)});"
                " choose another output.dir, or set output.overwrite=true to start over there"
            )
        if config.train.resume is None and (out / "checkpoints").exists():
            raise UserError(
                f"output directory {out} already holds this run; continue it with "
                "train.resume=auto, or set output.overwrite=true to start over"
            )
    if config.output.overwrite and config.train.resume is None and out.exists():
        for name in ("checkpoints", "adapter", "metrics.jsonl", "summary.json"):
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"output.dir={str(out)!r} is not writable ({exc.strerror}); choose a "
                        "directory you can write to") from exc
    saved.write_text(config.to_yaml())
    return out


# --------------------------------------------------------------------------- schedule


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Any:
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# --------------------------------------------------------------------------- signals


class StopFlag:
    """Set by SIGTERM/SIGINT; checked (and agreed across ranks) at step boundaries."""

    def __init__(self, enabled: bool) -> None:
        self.signal: int | None = None
        if enabled:
            # SIGUSR1 too: Open MPI's mpirun forwards it to every rank without killing them, while
            # on SIGTERM/SIGINT it sends the ranks SIGTERM and then SIGKILL 0.25 s later.
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum


# --------------------------------------------------------------------------- evaluation


@dataclass
class Runtime:
    """What the loop needs besides the config: placement, model pieces, data."""

    placement: Placement
    peft_model: nn.Module
    loss_module: CausalLMLoss
    tokenizer: Any
    train_data: TokenizedSplit
    val_data: TokenizedSplit
    autocast: Any
    pad_id: int


def make_batch(data: TokenizedSplit, indices: list[int], pad_id: int, config: Config) -> Batch:
    if config.data.packing:
        return pack(data, indices, pad_id, config.data.max_length)
    return collate(data, indices, pad_id)


@torch.no_grad()
def evaluate(rt: Runtime, config: Config) -> dict[str, float]:
    """Validation loss (mean over label tokens, all ranks) and perplexity."""
    rt.loss_module.eval()
    total = count = 0.0
    for indices in eval_batch_indices(rt.val_data, config.train.batch_size, rt.placement.rank,
                                      rt.placement.world_size, config.train.eval_batches):
        batch = collate(rt.val_data, indices, rt.pad_id)
        with rt.autocast():
            loss_sum, n = rt.loss_module(**batch.as_kwargs())
        total += float(loss_sum)
        count += float(n)
    total, count = allreduce([total, count], rt.placement)
    rt.loss_module.train()
    if count == 0:
        return {}
    loss = total / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def sample_prompts(data: TokenizedSplit, count: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids up to the first answer token, reference answer ids) of held-out samples."""
    samples: list[tuple[list[int], list[int]]] = []
    if count <= 0:
        return samples
    for ids, labels in zip(data.input_ids, data.labels, strict=True):
        first = next((i for i, label in enumerate(labels) if label != IGNORE), None)
        if first:
            answer = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE]
            samples.append((list(ids[:first]), answer))
        if len(samples) == count:
            break
    return samples


@torch.no_grad()
def generate_answers(rt: Runtime, prompts: list[tuple[list[int], list[int]]],
                     max_new_tokens: int) -> list[str]:
    rt.peft_model.eval()
    answers = []
    for prompt, _ in prompts:
        ids = torch.tensor([prompt])
        with rt.autocast():
            out = rt.peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=max_new_tokens, do_sample=False,
                                         use_cache=True, pad_token_id=rt.pad_id)
        answers.append(rt.tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True).strip())
    rt.peft_model.train()
    return answers


def accumulate_gradients(step_module: nn.Module, micro: list[Batch], placement: Placement,
                         label_tokens: float, autocast: Any, inject_nan: bool = False) -> float:
    """Forward and backward over one optimizer step's micro-batches; returns this rank's loss sum.

    Gradients are allreduced only on the last micro-batch (no_sync before). Each rank's loss is
    scaled so the averaged gradient is the mean over every label token of the global batch,
    whatever the world size or per-rank token counts.
    """
    scale = placement.world_size / max(label_tokens, 1.0)
    loss_local = 0.0
    for k, batch in enumerate(micro):
        sync = k == len(micro) - 1
        no_sync = (step_module.no_sync() if placement.distributed and not sync
                   and hasattr(step_module, "no_sync") else contextlib.nullcontext())
        with no_sync, autocast():
            loss_sum, _ = step_module(**batch.as_kwargs())
            if inject_nan:
                loss_sum = loss_sum * float("nan")
            (loss_sum * scale).backward()
        loss_local += float(loss_sum.detach())
    return loss_local


# --------------------------------------------------------------------------- the run


def train(config: Config, debug: bool = False) -> dict[str, Any] | None:
    """Run a fine-tune as this process's rank; returns the summary on rank 0."""
    from cpudist.quiet import quiet_libraries

    quiet_libraries()
    placement = detect_placement()
    configure_logging(placement, debug)
    threads = threads_for_rank(placement, config.dist.threads_per_rank)
    cpus = pin_threads(placement, threads)
    comm = "single process"
    if placement.distributed:
        comm = init_process_group(placement, config.dist.backend, config.dist.master_addr,
                                  config.dist.master_port, config.dist.interface,
                                  config.dist.timeout_s)
        if config.dist.backend == "mpi":
            comm += ("; DDP comm hook: non-blocking MPI Iallreduce" if config.dist.mpi_nonblocking
                     else "; DDP comm hook: MPI Allreduce")
        comm += f"; collective timeout {config.dist.timeout_s:g} s"
    peers: list[tuple[str, int]] = []
    try:
        if placement.distributed:
            # Who runs where: if a peer vanishes, this rank can say which one (on its own node).
            peers = [("", 0)] * placement.world_size
            dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
        result = _train(config, placement, threads, cpus, comm)
        if placement.distributed:
            # Every rank ends here together (done, or stopped by a signal). gloo's worker threads
            # drop the tensors of the last collective (Python-owned, from *_object collectives)
            # after wait() returns; if that lands during interpreter shutdown the process aborts.
            # A barrier, then freeing DDP and the group, keeps that inside the live interpreter.
            dist.barrier()
            gc.collect()
        return result
    except RuntimeError as exc:
        if not placement.distributed or debug or not _lost_peer(exc):
            raise
        log.error("error: lost contact with the other ranks (%s). %s; see the other ranks' output "
                  "(mpirun names a rank that died). Continue from the newest checkpoint with "
                  "train.resume=auto", _first_line(exc), _peer_fate(peers, placement.rank))
        sys.stdout.flush()
        sys.stderr.flush()
        # No clean shutdown: destroying the group or MPI_Finalize would wait for the lost peer.
        os._exit(1)
    finally:
        shutdown()


def _peer_fate(peers: list[tuple[str, int]], rank: int) -> str:
    """What became of the peers this rank can see (those on its own node)."""
    import psutil

    host = socket.gethostname()
    fates = []
    for peer, (peer_host, pid) in enumerate(peers):
        if peer == rank or peer_host != host:
            continue
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            status = psutil.STATUS_DEAD
        if status in (psutil.STATUS_DEAD, psutil.STATUS_ZOMBIE):
            fates.append(f"rank {peer} (pid {pid}) has exited")
        elif status == psutil.STATUS_STOPPED:
            fates.append(f"rank {peer} (pid {pid}) is stopped")
    if fates:
        return "On this node " + ", ".join(fates)
    return "A rank died, hung or was stopped, or the network failed"


def _lost_peer(exc: BaseException) -> bool:
    """A collective failed because a peer vanished or did not answer within dist.timeout_s."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        marker in text for marker in ("gloo", "Connection reset", "Connection closed", "Timed out"))


def _first_line(exc: BaseException) -> str:
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    # Drop gloo's "[/path/to/pair.cc:537] " source location and its chatty advice.
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". This is typically", 1)[0][:200]


def fault_nan_steps() -> set[int]:
    """Test hook: CPUDIST_FAULT_NAN_AT_STEP=3,4 makes the loss of those steps NaN on this rank.

    The one place a fault-injection variable is read (documented in docs/OPERATIONS.md).
    """
    raw = os.environ.get("CPUDIST_FAULT_NAN_AT_STEP", "")
    return {int(part) for part in raw.split(",") if part.strip().isdigit()}


def _train(config: Config, placement: Placement, threads: int, cpus: list[int] | None,
           comm: str) -> dict[str, Any] | None:
    tc = config.train
    world, rank = placement.world_size, placement.rank
    out = rank0_only(placement, lambda: prepare_output(config))
    out = Path(config.output.dir)
    log.info("config:\n%s", config.to_yaml().rstrip())
    log.info("ranks: %d (%s), this node: %d, threads per rank: %d, cores: %s", world,
             placement.launcher, placement.local_size, threads, _cpu_list(cpus))
    log.info("communication: %s; malloc: %s", comm, allocator_in_use())

    random.seed(tc.seed)
    torch.manual_seed(tc.seed)  # same LoRA init on every rank
    try:
        peft_model, tokenizer, dtype_reason, model_dir = build_model(config.model, config.lora)
        train_data, val_data, data_stats = build_datasets(config.data, tokenizer, tc.seed)
        error = None
    except UserError as exc:
        error = str(exc)
    agree_on_error(placement, error)
    log.info("model: %s; dtype %s", model_dir, dtype_reason)
    n_train = sum(p.numel() for _, p in trainable_parameters(peft_model))
    n_total = sum(p.numel() for p in peft_model.parameters())
    log.info("LoRA: %s trainable parameters of %s (%.2f%%)", f"{n_train:,}", f"{n_total:,}",
             100 * n_train / n_total)
    log.info("data: %s -> %d train / %d validation samples; %d of %d truncated to %d tokens; "
             "%d dropped (no answer token left)", data_stats["source"], data_stats["train"],
             data_stats["val"], data_stats["truncated"], data_stats["samples"],
             config.data.max_length, data_stats["dropped_no_labels"])

    compute_bf16 = dtype_reason.startswith("bfloat16")

    def autocast() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_bf16)

    loss_module = CausalLMLoss(peft_model, tc.loss_chunk_size)
    params = trainable_parameters(loss_module)
    param_names = [name for name, _ in params]
    optimizer = torch.optim.AdamW([p for _, p in params], lr=tc.lr, weight_decay=tc.weight_decay)
    if tc.ipex:
        loss_module, optimizer = _ipex_optimize(loss_module, optimizer)
    batches = GlobalBatches(train_data, tc.batch_size, tc.grad_accum, world, tc.seed,
                            config.data.group_by_length)
    total_steps = tc.max_steps or tc.epochs * batches.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(tc.warmup_steps, total_steps, tc.min_lr_ratio))
    log.info("global batch: %d = %d per rank x %d accumulation x %d ranks; %d steps per epoch, "
             "%d steps", tc.batch_size * tc.grad_accum * world, tc.batch_size, tc.grad_accum,
             world, batches.steps_per_epoch, total_steps)

    step_module: nn.Module = loss_module
    if placement.distributed:
        step_module = _wrap_ddp(loss_module, config)
    if tc.compile:
        step_module = torch.compile(step_module)

    state = ckpt.TrainState(world_size=world)
    resume_from = rank0_only(placement, lambda: ckpt.find_resume(tc.resume, out / "checkpoints"))
    resume_path = _broadcast(placement, str(resume_from) if resume_from else None)
    if resume_path:
        # A checkpoint that does not fit this run stops every rank together.
        restore_error = None
        try:
            state = _restore(Path(resume_path), peft_model, optimizer, param_names, scheduler,
                             placement)
        except UserError as exc:
            restore_error = str(exc)
        agree_on_error(placement, restore_error)
        log.info("resumed from %s at step %d", resume_path, state.step)
    elif tc.resume is not None and tc.resume != "auto":
        raise UserError(f"train.resume={tc.resume!r}: not a checkpoint")

    rt = Runtime(placement, peft_model, loss_module, tokenizer, train_data, val_data, autocast,
                 tokenizer.pad_token_id)
    metrics = None
    if placement.is_main:
        metrics = MetricsLog(out / "metrics.jsonl", state.step if resume_path else None,
                             out / "tensorboard" if config.output.tensorboard else None)
    stop = StopFlag(tc.save_on_signal)
    nan_steps = fault_nan_steps()
    summary: dict[str, Any] = {"world_size": world, "threads_per_rank": threads,
                               "dtype": dtype_reason, "communication": comm,
                               "global_batch": tc.batch_size * tc.grad_accum * world,
                               "cpu": cpu_info().model, "launcher": placement.launcher}

    prompts = sample_prompts(val_data, tc.sample_prompts) if placement.is_main else []
    before = evaluate(rt, config) if not resume_path else {}
    if before:
        log.info("validation before training: loss %.4f, perplexity %.2f", before["val_loss"],
                 before["val_ppl"])
        summary.update(val_loss_before=before["val_loss"], val_ppl_before=before["val_ppl"])
    answers_before = generate_answers(rt, prompts, tc.max_new_tokens) if prompts else []

    progress = Progress(total_steps, state.step, placement.is_main,
                        allow_bar=not placement.distributed)
    started = run_started = time.perf_counter()
    start_step = state.step
    tokens_this_run = 0
    last_loss = float("nan")
    stopped_by: int | None = None
    last_saved = -1
    while state.step < total_steps:
        if state.step_in_epoch >= batches.steps_per_epoch:
            state.epoch, state.step_in_epoch = state.epoch + 1, 0
        step_started = time.perf_counter()
        micro = [make_batch(train_data, ix, rt.pad_id, config)
                 for ix in batches.step_batches(state.epoch, state.step_in_epoch, rank)]
        label_tokens, fed_tokens = allreduce(
            [sum(b.label_tokens for b in micro), sum(b.tokens for b in micro)], placement)
        loss_local = accumulate_gradients(step_module, micro, placement, label_tokens, autocast,
                                          inject_nan=state.step + 1 in nan_steps)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for _, p in params], tc.max_grad_norm or float("inf"))
        (loss_global,) = allreduce([loss_local], placement)
        loss = loss_global / max(label_tokens, 1.0)
        finite = math.isfinite(loss) and bool(torch.isfinite(grad_norm))
        if finite:
            optimizer.step()
            state.bad_steps_in_a_row = 0
        else:
            state.bad_steps_total += 1
            state.bad_steps_in_a_row += 1
            log.warning("step %d: non-finite %s; update skipped (%d in a row)", state.step + 1,
                        "loss" if not math.isfinite(loss) else "gradient norm",
                        state.bad_steps_in_a_row)
        lr_used = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.step_in_epoch += 1
        state.tokens_seen += int(fed_tokens)
        tokens_this_run += int(fed_tokens)
        last_loss = loss if finite else last_loss
        step_time = time.perf_counter() - step_started
        record = {
            "step": state.step, "epoch": state.epoch, "loss": loss,
            "lr": lr_used, "grad_norm": float(grad_norm),
            "tokens_per_s": fed_tokens / step_time, "label_tokens_per_s": label_tokens / step_time,
            "step_s": step_time, "elapsed": state.elapsed_s + time.perf_counter() - started,
        }
        if tc.eval_every and state.step % tc.eval_every == 0 and state.step < total_steps:
            record.update(evaluate(rt, config))
        if metrics is not None and (state.step % tc.log_every == 0 or "val_loss" in record):
            metrics.write(record)
        progress.update(state.step, loss, record["tokens_per_s"], record["lr"])
        if state.bad_steps_in_a_row >= tc.max_bad_steps:
            raise UserError(
                f"{state.bad_steps_in_a_row} steps in a row had a non-finite loss or gradient "
                f"(step {state.step}); lower train.lr, check the data, or use model.dtype=float32. "
                "No checkpoint with non-finite weights was written."
            )
        if "val_loss" in record:
            progress.write(f"step {state.step}: validation loss {record['val_loss']:.4f}")
        (stop_votes,) = allreduce([float(stop.signal is not None)], placement, op="max")
        if stop_votes:
            stopped_by = stop.signal or signal.SIGTERM
        if (tc.save_every and state.step % tc.save_every == 0) or stopped_by:
            state.elapsed_s += time.perf_counter() - started
            started = time.perf_counter()
            _save(out, peft_model, optimizer, param_names, scheduler, state, config, placement)
            last_saved = state.step
        if stopped_by:
            break
    progress.close()
    wall = state.elapsed_s + time.perf_counter() - started
    if stopped_by:
        log.info("stopped by signal %d (%s) after step %d; checkpoint saved in %s. Resume with the "
                 "same launch command (same number of ranks) plus train.resume=auto:\n  %s",
                 stopped_by, signal.Signals(stopped_by).name, state.step, out / "checkpoints",
                 _resume_command())
        return None

    if last_saved != state.step:
        state.elapsed_s = wall
        _save(out, peft_model, optimizer, param_names, scheduler, state, config, placement)
    after = evaluate(rt, config)
    answers_after = generate_answers(rt, prompts, tc.max_new_tokens) if prompts else []
    if not placement.is_main:
        return None
    _save_adapter(peft_model, out / "adapter")
    if metrics is not None:
        if after:
            metrics.write({"step": state.step, **after})
        metrics.close()
    summary.update(
        steps=state.step, train_loss=last_loss, wall_s=wall,
        tokens_per_s=(tokens_this_run / (time.perf_counter() - run_started)
                      if state.step > start_step else 0.0),
        tokens_seen=state.tokens_seen, bad_steps=state.bad_steps_total, peak_rss_gb=peak_rss_gb(),
        samples=[{"prompt": tokenizer.decode(p, skip_special_tokens=False),
                  "reference": tokenizer.decode(r, skip_special_tokens=True),
                  "before": b, "after": a}
                 for (p, r), b, a in zip(prompts, answers_before or [""] * len(prompts),
                                         answers_after, strict=False)],
    )
    if after:
        summary.update(val_loss_after=after["val_loss"], val_ppl_after=after["val_ppl"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    _print_outcome(summary)
    if config.output.plots:
        from cpudist.plots import write_report

        write_report(out)
    return summary


def _resume_command() -> str:
    """This process's command line as `cpudist ...` with train.resume=auto."""
    args = [a for a in sys.argv[1:] if not a.startswith("train.resume=")]
    return " ".join(shlex.quote(a) for a in ["cpudist", *args, "train.resume=auto"])


def _cpu_list(cpus: list[int] | None) -> str:
    return "not bound" if cpus is None else ",".join(map(str, cpus))


def _broadcast(placement: Placement, value: Any) -> Any:
    if not placement.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _wrap_ddp(module: CausalLMLoss, config: Config) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Frozen weights and buffers are identical on every rank already (same files); keeping them
    # out of DDP's start-up broadcast also keeps shared read-only pages from being written.
    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]
    frozen += [name for name, _ in module.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(module, frozen)
    with warnings.catch_warnings():
        # broadcast_buffers is deprecated, but its successor still syncs buffers at init; every
        # buffer is ignored above anyway, so the warning says nothing about this run.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        ddp = DDP(module, bucket_cap_mb=config.dist.bucket_cap_mb, broadcast_buffers=False,
                  find_unused_parameters=False)
    if config.dist.backend == "mpi":
        ddp.register_comm_hook(None, mpi_allreduce_hook(config.dist.mpi_nonblocking))
    return ddp


def _ipex_optimize(module: CausalLMLoss, optimizer: torch.optim.Optimizer) -> Any:
    try:
        import intel_extension_for_pytorch as ipex
    except ImportError:
        log.warning("train.ipex=true but intel_extension_for_pytorch does not import (it is "
                    "retired upstream and needs torch 2.8); continuing with stock PyTorch")
        return module, optimizer
    log.info("IPEX %s: ipex.optimize on the model and optimizer", ipex.__version__)
    return ipex.optimize(module, optimizer=optimizer)


def _save(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str],
          scheduler: Any, state: ckpt.TrainState, config: Config, placement: Placement) -> None:
    rng = ckpt.rng_state()
    states = [rng]
    if placement.distributed:
        states = [None] * placement.world_size
        dist.all_gather_object(states, rng)

    def write() -> None:
        path = ckpt.save_checkpoint(out / "checkpoints", model, optimizer, names, scheduler, state,
                                    states, config.to_yaml(), config.train.keep_last)
        log.info("checkpoint: %s", path)

    rank0_only(placement, write)


def _restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, names: list[str],
             scheduler: Any, placement: Placement) -> ckpt.TrainState:
    from peft import set_peft_model_state_dict

    # Rank 0 reads the checkpoint and sends it to the others, so nodes need no shared filesystem.
    # (broadcast_object_list pickles, but only between this job's own processes.)
    loaded = _broadcast(placement, rank0_only(placement, lambda: ckpt.load_checkpoint(path)))
    if loaded.state.world_size != placement.world_size:
        raise UserError(
            f"checkpoint {path} was written by {loaded.state.world_size} ranks and this run has "
            f"{placement.world_size}; resume with -np {loaded.state.world_size} (the data order "
            "and per-rank random states depend on the world size)"
        )
    set_peft_model_state_dict(model, loaded.adapter_tensors)
    ckpt.load_optimizer(optimizer, names, loaded.optimizer_tensors, loaded.optimizer_settings)
    scheduler.load_state_dict(loaded.scheduler_state)
    ckpt.set_rng_state(loaded.rng_states[placement.rank])
    return loaded.state


def _save_adapter(model: nn.Module, target: Path) -> None:
    from safetensors import SafetensorError

    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(exc, "strerror", None) or str(exc)
        raise UserError(f"could not write the adapter to {target}: {reason}. The same weights are "
                        f"in the newest checkpoint under {target.parent / 'checkpoints'}") from exc


def _print_outcome(summary: dict[str, Any]) -> None:
    lines = [f"done: {summary['steps']} steps in {summary['wall_s']:.0f} s, "
             f"{summary['tokens_per_s']:.0f} tokens/s, peak RSS {summary['peak_rss_gb']:.2f} GB"]
    if "val_loss_before" in summary and "val_loss_after" in summary:
        lines.append(f"validation loss: before {summary['val_loss_before']:.4f} -> after "
                     f"{summary['val_loss_after']:.4f} (perplexity {summary['val_ppl_before']:.2f}"
                     f" -> {summary['val_ppl_after']:.2f})")
    for sample in summary.get("samples", []):
        lines.append(f"held-out prompt: {sample['prompt']!r}")
        lines.append(f"  reference: {sample['reference']}")
        lines.append(f"  before:    {sample['before']}")
        lines.append(f"  after:     {sample['after']}")
    log.info("\n".join(lines))
