"""`cpudist train`: the training loop, one readable function from config to adapter.

The engine (cpudist.train.engine) sets the rank up and takes each optimizer step; this loop decides
which samples each step sees, logs, evaluates, checkpoints, stops on a signal, and at the end saves
the adapter and the summary. Rank 0 alone writes OUTPUT/ (cpudist.train.output).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path
from typing import Any

from cpudist.config import Config
from cpudist.data.tokenize import build_datasets
from cpudist.errors import UserError
from cpudist.model.quantize import QuantizedLinear
from cpudist.report.console import Progress
from cpudist.report.metrics import MetricsLog
from cpudist.runtime.allocator import in_use as allocator_in_use
from cpudist.runtime.comm import agreed, allreduce, rank0_only
from cpudist.runtime.hardware import cpu_info
from cpudist.runtime.memory import peak_rss_gb
from cpudist.runtime.process import Process, start_process
from cpudist.train import checkpoint, faults
from cpudist.train.engine import Datasets, Engine, build_engine
from cpudist.train.generate import answer_prompts, sample_prompts
from cpudist.train.output import (
    prepare_output,
    print_outcome,
    resume_command,
    save_final_adapter,
    write_summary,
)
from cpudist.train.plan import check_fits, keep_global_batch, resolve_batch
from cpudist.train.signals import StopFlag

log = logging.getLogger("cpudist")


def train(config: Config, debug: bool = False) -> dict[str, Any] | None:
    """Run a fine-tune as this process's rank; returns the summary on rank 0."""
    with start_process(config.dist, debug, resume_hint="Continue from the newest checkpoint "
                       "with train.resume=auto", stacks_dir=Path(config.output.dir)) as process:
        return _run(config, process)


def training_data(config: Config, tokenizer: Any) -> Datasets:
    train, val, stats = build_datasets(config.data, tokenizer, config.train.seed)
    return Datasets(train, val, (
        f"{stats['source']} -> {stats['train']} train / {stats['val']} validation samples; "
        f"{stats['truncated']} of {stats['samples']} truncated to {config.data.max_length} "
        f"tokens; {stats['dropped_no_labels']} dropped (no answer token left)"
        + (f"; {stats['last_answer_only']} conversations train on their last answer only (the chat "
           "template rewrites earlier turns)" if stats["last_answer_only"] else "")))


def _run(config: Config, process: Process) -> dict[str, Any] | None:
    placement = process.placement
    given = config
    # A checkpoint from another world size: its global batch is kept, split anew.
    previous = checkpoint.peek(config.train.resume, Path(config.output.dir), placement)
    if previous is not None and previous.world_size != placement.world_size:
        config, note = agreed(placement, lambda: keep_global_batch(
            given, previous.global_batch, placement.world_size))
        log.info("resuming a %d-rank checkpoint: %s", previous.world_size, note)
    # train.global_batch / batch_size=auto become a concrete micro-batch and accumulation here;
    # the output keeps the settings as given (a resume on another machine resolves them again).
    resolved, batch_line = agreed(placement, lambda: resolve_batch(
        config, placement.world_size, placement.local_size))
    if config.train.batch_size == "auto" and placement.distributed:
        # Nodes may differ in memory: every rank takes the smallest micro-batch any rank chose.
        (negated,) = allreduce([-float(resolved.train.batch_size)], placement, op="max")
        if int(-negated) != resolved.train.batch_size:
            smallest = config.model_copy(deep=True)
            smallest.train.batch_size = int(-negated)
            resolved, batch_line = resolve_batch(smallest, placement.world_size,
                                                 placement.local_size)
            batch_line += ", the smallest any node's memory allows"
    # Before anything is loaded or written: a run that cannot fit stops here, not in the kernel's
    # OOM killer.
    agreed(placement, lambda: check_fits(resolved, placement.local_size))
    rank0_only(placement, lambda: prepare_output(given))
    config = resolved
    tc = config.train
    if batch_line:
        log.info("batch: %s", batch_line)
    out = Path(config.output.dir)
    log.info("config:\n%s", config.to_yaml().rstrip())
    log.info(process.describe())
    log.info("communication: %s; malloc: %s", process.communication, allocator_in_use())

    engine = build_engine(config, process, lambda tokenizer, _: training_data(config, tokenizer))
    _log_setup(engine)
    state = checkpoint.restore(engine, tc.resume, out)
    resumed = state is not None
    state = state or checkpoint.TrainState(world_size=placement.world_size,
                                           global_batch=engine.global_batch)
    faults.install(engine.session.loss, tc.grad_accum, state.step)
    metrics = None
    if placement.is_main:
        # Resume asked for but no checkpoint yet: trimmed to step 0, keeping restart records.
        kept_to = state.step if resumed else (0 if tc.resume is not None else None)
        metrics = MetricsLog(out / "metrics.jsonl", kept_to,
                             out / "tensorboard" if config.output.tensorboard else None)
    stop = StopFlag(tc.save_on_signal)
    summary: dict[str, Any] = {"world_size": placement.world_size, "threads_per_rank": process.threads,
                               "dtype": engine.session.precision.describe(),
                               "communication": process.communication,
                               "global_batch": engine.global_batch, "cpu": cpu_info().model,
                               "launcher": placement.launcher}
    prompts = sample_prompts(engine.data.val, tc.sample_prompts) if placement.is_main else []
    before = {} if resumed else engine.evaluate()
    if before:
        log.info("validation before training: loss %.4f, perplexity %.2f", before["val_loss"],
                 before["val_ppl"])
        summary.update(val_loss_before=before["val_loss"], val_ppl_before=before["val_ppl"])
    answers_before = answer_prompts(engine.session, prompts, tc.max_new_tokens)

    total_steps = engine.total_steps
    progress = Progress(total_steps, state.step, placement.is_main,
                        allow_bar=not placement.distributed)
    started = run_started = time.perf_counter()
    start_step, tokens_this_run = state.step, 0
    last_loss = float("nan")
    stopped_by: int | None = None
    last_saved = -1
    while state.step < total_steps:
        if state.step_in_epoch >= engine.batches.steps_per_epoch:
            state.epoch, state.step_in_epoch = state.epoch + 1, 0
        step_started = time.perf_counter()
        result = engine.step(engine.micro_batches(state.epoch, state.step_in_epoch))
        if result.finite:
            state.bad_steps_in_a_row = 0
            last_loss = result.loss
        else:
            state.bad_steps_total += 1
            state.bad_steps_in_a_row += 1
            log.warning("step %d: non-finite %s; update skipped (%d in a row)", state.step + 1,
                        "gradient norm" if math.isfinite(result.loss) else "loss",
                        state.bad_steps_in_a_row)
        state.step += 1
        state.step_in_epoch += 1
        state.tokens_seen += int(result.tokens)
        tokens_this_run += int(result.tokens)
        step_time = time.perf_counter() - step_started
        record = {
            "step": state.step, "epoch": state.epoch, "loss": result.loss, "lr": result.lr,
            "grad_norm": result.grad_norm, "tokens_per_s": result.tokens / step_time,
            "label_tokens_per_s": result.label_tokens / step_time, "step_s": step_time,
            "elapsed": state.elapsed_s + time.perf_counter() - started,
        }
        if tc.eval_every and state.step % tc.eval_every == 0 and state.step < total_steps:
            record.update(engine.evaluate())
        if metrics is not None and (state.step % tc.log_every == 0 or "val_loss" in record):
            metrics.write(record)
        progress.update(state.step, result.loss, record["tokens_per_s"], result.lr)
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
            checkpoint.save(engine, state, out)
            last_saved = state.step
        if stopped_by:
            break
    progress.close()
    wall = state.elapsed_s + time.perf_counter() - started
    if stopped_by:
        log.info("stopped by signal %d (%s) after step %d; checkpoint saved in %s. Resume with the "
                 "same launch command (same number of ranks) plus train.resume=auto:\n  %s",
                 stopped_by, signal.Signals(stopped_by).name, state.step, out / "checkpoints",
                 resume_command())
        return None

    if last_saved != state.step:
        state.elapsed_s = wall
        checkpoint.save(engine, state, out)
    after = engine.evaluate()
    answers_after = answer_prompts(engine.session, prompts, tc.max_new_tokens)
    if not placement.is_main:
        return None
    save_final_adapter(engine.model, out / "adapter", engine.base_record, {
        "steps": state.step, "train_loss": last_loss if math.isfinite(last_loss) else None,
        "val_loss_before": before.get("val_loss"), "val_loss_after": after.get("val_loss")})
    if metrics is not None:
        if after:
            metrics.write({"step": state.step, **after})
        metrics.close()
    tokenizer = engine.session.tokenizer
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
    write_summary(out, summary)
    print_outcome(summary)
    if config.output.plots:
        from cpudist.report.plots import write_report

        write_report(out)
    return summary


def _log_setup(engine: Engine) -> None:
    session, tc = engine.session, engine.config.train
    log.info("model: %s; dtype %s", session.model_dir, session.precision.describe())
    n_train = sum(p.numel() for _, p in engine.params)
    # A quantized base keeps its frozen linears in buffers: count the weights they stand for.
    n_total = sum(p.numel() for p in session.model.parameters()) + sum(
        m.in_features * m.out_features for m in session.model.modules()
        if isinstance(m, QuantizedLinear))
    log.info("LoRA: %s trainable parameters of %s (%.2f%%)", f"{n_train:,}", f"{n_total:,}",
             100 * n_train / n_total)
    log.info("data: %s", engine.data.description)
    log.info("global batch: %d = %d per rank x %d accumulation x %d ranks; %d steps per epoch, "
             "%d steps", engine.global_batch, tc.batch_size, tc.grad_accum,
             engine.placement.world_size, engine.batches.steps_per_epoch, engine.total_steps)
