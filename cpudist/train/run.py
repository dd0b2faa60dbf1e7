"""`cpudist train`: a run in four phases.

  resolve  the config the run will use, before anything is loaded or written: the checkpoint it
           continues (read once), that checkpoint's global batch kept on another world size,
           train.global_batch / batch_size=auto made concrete, the memory plan checked
  set up   OUTPUT/ prepared, the engine built (cpudist.train.engine: model, the objective's data
           and loss, optimizer, DDP), the checkpoint applied, metrics opened, validation before
  fit      the loop: a step, its record, evaluation, checkpoint, a signal that stops the run
  finish   the last checkpoint, validation after, the adapter, summary.json and the report

Everything a run holds while it fits is one object, `Run`. Rank 0 alone writes OUTPUT/
(cpudist.train.output).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from cpudist.config import Config
from cpudist.errors import Preempted, UserError
from cpudist.infer.generate import answer_prompts
from cpudist.model.adapters import is_full
from cpudist.model.quantize import QuantizedLinear
from cpudist.objectives import Prompt
from cpudist.records import EvalRecord, HeldOutAnswer, RunSummary, StepRecord, TimeSplit
from cpudist.report.console import Progress
from cpudist.report.metrics import MetricsLog
from cpudist.report.tracking import Trackers, open_trackers
from cpudist.runtime.allocator import in_use as allocator_in_use
from cpudist.runtime.cluster import Placement
from cpudist.runtime.comm import agreed, allreduce, rank0_only
from cpudist.runtime.hardware import cpu_info
from cpudist.runtime.memory import peak_rss_gb
from cpudist.runtime.mkl_shim import describe as describe_mkl
from cpudist.runtime.process import Process, start_process
from cpudist.train import checkpoint, faults
from cpudist.train.baseline import baseline_evaluation
from cpudist.train.engine import Engine, StepResult, build_engine
from cpudist.train.output import (
    note_restart,
    prepare_output,
    print_outcome,
    resume_command,
    save_final_adapter,
    save_final_model,
)
from cpudist.train.plan import check_fits, keep_global_batch, resolve_batch
from cpudist.train.signals import StopFlag

log = logging.getLogger("cpudist")


def train(config: Config, debug: bool = False) -> RunSummary | None:
    """Run a fine-tune as this process's rank; returns the summary on rank 0 (None on other
    ranks). A run a signal stopped after its checkpoint raises Preempted, once every rank is
    done."""
    started = time.perf_counter()
    with start_process(config.dist, debug, resume_hint="Continue from the newest checkpoint "
                       "with train.resume=auto", stacks_dir=Path(config.output.dir)) as process:
        resolved = resolve(config, process.placement)
        with StopFlag(config.train.save_on_signal) as stop:
            run = set_up(resolved, process, stop, started)
            fit(run)
            summary = finish(run)
            stopped = run.stopped_by, run.state.step
    if stopped[0] is not None:
        raise Preempted(signal.Signals(stopped[0]).name, stopped[1],
                        str(Path(config.output.dir) / "checkpoints"))
    return summary


# --------------------------------------------------------------------------- resolve


@dataclass
class Resolved:
    """The config a run uses, and where it starts."""

    given: Config  # as given: OUTPUT/config.yaml, what a repeat on any machine resolves again
    config: Config  # what this run uses: a concrete micro-batch and accumulation for its ranks
    checkpoint: checkpoint.LoadedCheckpoint | None  # the one it continues, read once
    batch_line: str  # how train.global_batch was split, for the log ("" when not set)


def resolve(given: Config, placement: Placement) -> Resolved:
    """The run's config on this world size, and its checkpoint; refuses, before anything is
    loaded or written, a run whose global batch does not divide or that does not fit memory."""
    if placement.restarts and given.train.resume is None:
        # torchrun started the workers again: continue, as `cpudist launch --restarts` does.
        given = given.model_copy(update={"train": given.train.model_copy(update={"resume": "auto"})})
        log.info("restart %d by %s: resuming from the newest checkpoint (train.resume=auto)",
                 placement.restarts, placement.launcher)
    loaded = checkpoint.load_resume(given.train.resume, Path(given.output.dir), placement)
    config = given
    if loaded is not None and loaded.state.world_size != placement.world_size:
        # A checkpoint from another world size: its global batch is kept, split anew.
        config, note = agreed(placement, lambda: keep_global_batch(
            given, loaded.state.global_batch, placement.world_size))
        log.info("resuming a %d-rank checkpoint: %s", loaded.state.world_size, note)
    resolved, batch_line = agreed(placement, lambda: resolve_batch(
        config, placement.world_size, placement.local_size))
    if config.train.batch_size == "auto" and placement.distributed:
        # Nodes may differ in memory: every rank takes the smallest micro-batch any rank chose.
        (smallest,) = allreduce([float(resolved.train.batch_size)], placement, op="min")
        if int(smallest) != resolved.train.batch_size:
            fixed = config.model_copy(deep=True)
            fixed.train.batch_size = int(smallest)
            resolved, batch_line = resolve_batch(fixed, placement.world_size, placement.local_size)
            batch_line += ", the smallest any node's memory allows"
    # A run that cannot fit stops here, not in the kernel's OOM killer.
    agreed(placement, lambda: check_fits(resolved, placement.local_size, placement.world_size))
    return Resolved(given, resolved, loaded, batch_line)


# --------------------------------------------------------------------------- set up


class Clock:
    """Training time: what the checkpoint's counters held before this process, plus this
    process's own since its first step."""

    def __init__(self, before_s: float) -> None:
        self.before_s = before_s
        self.started = time.perf_counter()

    def this_process(self) -> float:
        return time.perf_counter() - self.started

    def elapsed(self) -> float:
        return self.before_s + self.this_process()


@dataclass
class Run:
    """A run while it fits: the engine, the counters a checkpoint saves, and this process's own
    state (where it started, what it last saved, whether a signal stopped it)."""

    config: Config
    engine: Engine
    state: checkpoint.TrainState
    out: Path
    resumed: bool
    metrics: MetricsLog | None  # rank 0 only
    trackers: Trackers | None  # rank 0 only, when tracking.* asks for any
    stop: StopFlag
    eval_before: dict[str, float]
    prompts: list[Prompt]
    answers_before: list[str]
    times: TimeSplit  # setup, data and validation so far; completed by finish
    started: float  # perf_counter when train() began
    progress: Progress = field(init=False)
    clock: Clock = field(init=False)
    start_step: int = field(init=False)
    tokens_this_process: int = 0
    last_loss: float = math.nan
    last_saved: int = -1
    stopped_by: int | None = None

    def __post_init__(self) -> None:
        placement = self.engine.placement
        self.progress = Progress(self.engine.total_steps, self.state.step, placement.is_main,
                                 allow_bar=not placement.distributed)
        self.clock = Clock(self.state.elapsed_s)
        self.start_step = self.state.step

    @property
    def placement(self) -> Placement:
        return self.engine.placement


def set_up(resolved: Resolved, process: Process, stop: StopFlag, started: float) -> Run:
    """OUTPUT/ prepared (rank 0), the engine built and the checkpoint applied, metrics opened, and
    the validation figures and held-out answers before training. `started`: when train() began
    (perf_counter), the origin of the run's time split."""
    config, placement = resolved.config, process.placement
    rank0_only(placement, lambda: prepare_output(resolved.given))
    if resolved.batch_line:
        log.info("batch: %s", resolved.batch_line)
    log.info("config:\n%s", config.to_yaml().rstrip())
    log.info(process.describe())
    log.info("communication: %s; malloc: %s; MKL: %s", process.communication, allocator_in_use(),
             describe_mkl())
    engine = build_engine(config, process)
    log_setup(engine)
    resumed = resolved.checkpoint is not None
    state = (checkpoint.apply(engine, resolved.checkpoint) if resolved.checkpoint is not None
             else checkpoint.TrainState(world_size=placement.world_size,
                                        global_batch=engine.global_batch))
    resolved.checkpoint = None  # applied: its tensors need not stay in memory
    engine.objective.prepare(engine)  # e.g. DPO's reference pass, before any step or validation
    faults.install(engine.loss, config.train.grad_accum, state.step)
    out = Path(config.output.dir)
    metrics = None
    if placement.is_main:
        if placement.restarts:
            note_restart(out, placement, state.step)
        # Resume asked for but no checkpoint yet: trimmed to step 0, keeping restart records.
        kept_to = state.step if resumed else (0 if config.train.resume is not None else None)
        metrics = MetricsLog(out / "metrics.jsonl", kept_to,
                             out / "tensorboard" if config.output.tensorboard else None)
    trackers = rank0_only(placement, lambda: open_trackers(config, out,
                                                           config.train.resume is not None))
    prompts = (list(engine.objective.held_out_prompts(engine.data.val, config.train.sample_prompts))
               if placement.is_main else [])
    data = engine.data
    times = TimeSplit(data_s=data.seconds, data_cached=bool(data.counts.get("cache_hit")))
    times.setup_s = time.perf_counter() - started - times.data_s
    before = {} if resumed else timed_evaluation(engine, times, baseline=True)
    if before:
        log.info("validation before training: %s", describe(before))
        if trackers is not None:
            trackers.evaluation(EvalRecord(0, before))
    answers = answer_prompts(engine.session, [p.ids for p in prompts], config.train.max_new_tokens)
    return Run(config, engine, state, out, resumed, metrics, trackers, stop, before, prompts,
               answers, times, started)


def timed_evaluation(engine: Engine, times: TimeSplit, baseline: bool = False) -> dict[str, float]:
    """engine.evaluate(), its seconds added to the run's validation time; baseline: the untrained
    model's, read from the cache where an earlier run made them (cpudist.train.baseline)."""
    began = time.perf_counter()
    figures = baseline_evaluation(engine) if baseline else engine.evaluate()
    times.eval_s += time.perf_counter() - began
    return figures


def describe(figures: dict[str, float]) -> str:
    """Validation figures in words: "loss 2.1234, ppl 8.3612"."""
    return ", ".join(f"{name.removeprefix('val_')} {value:.4f}" for name, value in figures.items())


def log_setup(engine: Engine) -> None:
    session, tc = engine.session, engine.config.train
    log.info("model: %s; dtype %s", session.model_dir, session.precision.describe())
    n_train = sum(p.numel() for _, p in engine.params)
    # A quantized base keeps its frozen linears in buffers: count the weights they stand for.
    n_total = sum(p.numel() for p in session.model.parameters()) + sum(
        m.in_features * m.out_features for m in session.model.modules()
        if isinstance(m, QuantizedLinear))
    log.info("%s: %s trainable parameters of %s (%.2f%%)", engine.config.peft.method,
             f"{n_train:,}", f"{n_total:,}",
             100 * n_train / n_total)
    log.info("data: %s", engine.data.description)
    log.info("global batch: %d = %d per rank x %d accumulation x %d ranks; %d steps per epoch, "
             "%d steps", engine.global_batch, tc.batch_size, tc.grad_accum,
             engine.placement.world_size, engine.batches.steps_per_epoch, engine.total_steps)


# --------------------------------------------------------------------------- fit


def fit(run: Run) -> None:
    """Optimizer steps until the last one, or until a signal stops the run at a step boundary
    (with a checkpoint)."""
    engine, state, tc = run.engine, run.state, run.config.train
    while state.step < engine.total_steps and run.stopped_by is None:
        started = time.perf_counter()
        epoch, index = state.position(engine.batches.steps_per_epoch)
        result = engine.step(engine.micro_batches(epoch, index))
        count_step(run, result)
        record = step_record(run, result, time.perf_counter() - started)
        run.times.train_s += record.step_s
        if tc.eval_every and state.step % tc.eval_every == 0 and state.step < engine.total_steps:
            record.evaluation = timed_evaluation(engine, run.times)
        log_step(run, record)
        (stop_votes,) = allreduce([float(run.stop.signal is not None)], run.placement, op="max")
        if stop_votes:
            run.stopped_by = run.stop.signal or signal.SIGTERM
        if run.stopped_by or (tc.save_every and state.step % tc.save_every == 0):
            save_checkpoint(run)


def count_step(run: Run, result: StepResult) -> None:
    """A step's counters; a run whose steps keep failing stops (no non-finite weights saved)."""
    state = run.state
    state.step += 1
    state.step_in_epoch += 1
    state.tokens_seen += int(result.tokens)
    run.tokens_this_process += int(result.tokens)
    if result.finite:
        state.bad_steps_in_a_row = 0
        run.last_loss = result.loss
        return
    state.bad_steps_total += 1
    state.bad_steps_in_a_row += 1
    log.warning("step %d: non-finite %s; update skipped (%d in a row)", state.step,
                "gradient norm" if math.isfinite(result.loss) else "loss", state.bad_steps_in_a_row)


def step_record(run: Run, result: StepResult, seconds: float) -> StepRecord:
    return StepRecord(step=run.state.step, epoch=run.state.epoch, loss=result.loss, lr=result.lr,
                      grad_norm=result.grad_norm, tokens_per_s=result.tokens / seconds,
                      label_tokens_per_s=result.label_tokens / seconds, step_s=seconds,
                      elapsed=run.clock.elapsed(), metrics=result.metrics)


def log_step(run: Run, record: StepRecord) -> None:
    """The step in metrics.jsonl (every train.log_every steps, and every evaluation) and on the
    console; stops the run after train.max_bad_steps non-finite steps in a row."""
    state, tc = run.state, run.config.train
    if run.metrics is not None and (state.step % tc.log_every == 0 or record.evaluation):
        run.metrics.write(record)
        if run.trackers is not None:
            run.trackers.step(record)
    run.progress.update(state.step, record.loss, record.tokens_per_s, record.lr)
    if state.bad_steps_in_a_row >= tc.max_bad_steps:
        raise UserError(
            f"{state.bad_steps_in_a_row} steps in a row had a non-finite loss or gradient "
            f"(step {state.step}); lower train.lr, check the data, or use model.dtype=float32. "
            "No checkpoint with non-finite weights was written.")
    if record.evaluation:
        run.progress.write(f"step {state.step}: validation {describe(record.evaluation)}")


def save_checkpoint(run: Run) -> None:
    run.state.elapsed_s = run.clock.elapsed()
    checkpoint.save(run.engine, run.state, run.out)
    run.last_saved = run.state.step


# --------------------------------------------------------------------------- finish


def finish(run: Run) -> RunSummary | None:
    """After the last step: a checkpoint of it, validation after training, and on rank 0 the
    adapter, the final metrics line, summary.json, the console's outcome and the report. A run a
    signal stopped only says how to continue it."""
    run.progress.close()
    engine, state = run.engine, run.state
    if run.stopped_by is not None:
        log.info("stopped by signal %d (%s) after step %d; checkpoint saved in %s. Resume it "
                 "(under the same launcher; another number of ranks keeps the global batch) "
                 "with:\n  %s",
                 run.stopped_by, signal.Signals(run.stopped_by).name, state.step,
                 run.out / "checkpoints", resume_command(run.out))
        if run.trackers is not None:
            run.trackers.stop()
        return None
    wall = run.clock.elapsed()
    if run.last_saved != state.step:
        save_checkpoint(run)
    after = timed_evaluation(engine, run.times)
    answers_after = answer_prompts(engine.session, [p.ids for p in run.prompts],
                                   run.config.train.max_new_tokens)
    if not run.placement.is_main:
        return None
    saved = save_output(run, after)
    assert run.metrics is not None
    if after:
        run.metrics.write(EvalRecord(state.step, after))
        if run.trackers is not None:
            run.trackers.evaluation(EvalRecord(state.step, after))
    run.metrics.close()
    times = run.times
    times.wall_s = time.perf_counter() - run.started
    times.other_s = max(0.0, times.wall_s - times.setup_s - times.data_s - times.eval_s
                        - times.train_s)
    summary = summarize(run, wall, after, answers_after)
    summary.write(run.out / "summary.json")
    print_outcome(summary, engine.objective)
    if run.config.output.plots:
        from cpudist.report.plots import write_report

        write_report(run.out)
    if run.trackers is not None:
        run.trackers.finish([saved, run.out / "summary.json", run.out / "report.html"], summary)
    return summary


def save_output(run: Run, after: dict[str, float]) -> Path:
    """The trained weights in OUTPUT/: the adapter (with its base record), or with
    peft.method=full the whole model; the objective's files beside them. Returns the directory."""
    engine, config = run.engine, run.config
    if is_full(config):
        target = run.out / "model"
        save_final_model(engine.model, engine.session.tokenizer, target, config.output.max_shard_mb)
    else:
        target = run.out / "adapter"
        save_final_adapter(engine.model, target, engine.base_record, {
            "steps": run.state.step,
            "train_loss": run.last_loss if math.isfinite(run.last_loss) else None,
            "val_loss_before": run.eval_before.get("val_loss"),
            "val_loss_after": after.get("val_loss")})
    engine.objective.save_extras(target)
    return target


def summarize(run: Run, wall: float, after: dict[str, float], answers_after: list[str]
              ) -> RunSummary:
    engine, state, process = run.engine, run.state, run.engine.session.process
    tokenizer = engine.session.tokenizer
    answers_before = run.answers_before or [""] * len(run.prompts)
    return RunSummary(
        world_size=run.placement.world_size, threads_per_rank=process.threads,
        dtype=engine.session.precision.describe(), communication=process.communication,
        global_batch=engine.global_batch, cpu=cpu_info().model, launcher=run.placement.launcher,
        steps=state.step, train_loss=run.last_loss, wall_s=wall,
        tokens_per_s=(run.tokens_this_process / run.clock.this_process()
                      if state.step > run.start_step else 0.0),
        tokens_seen=state.tokens_seen, bad_steps=state.bad_steps_total, peak_rss_gb=peak_rss_gb(),
        eval_before=run.eval_before, eval_after=after, time=run.times,
        sources=dict(engine.data.counts.get("sources") or {}),
        samples=[HeldOutAnswer(tokenizer.decode(p.ids, skip_special_tokens=False),
                               tokenizer.decode(p.reference, skip_special_tokens=True), b, a)
                 for p, b, a in zip(run.prompts, answers_before, answers_after, strict=False)])
