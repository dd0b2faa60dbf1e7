"""The engine: the one setup of a training rank, and the one training step.

`build_engine` loads a model for training (base + fresh adapter, the objective's data and loss,
optimizer, schedule, DDP) and `Engine.step` takes one optimizer step. `cpudist train` loops over
that step, `cpudist bench` times it: there is no other copy of the setup or of the step. What
varies between kinds of training is the objective (cpudist.objectives); nothing here knows which.

One optimizer step: this rank's micro-batches -> forward (the objective's loss module) ->
backward under no_sync except the last micro-step -> DDP allreduce of the trainable gradients ->
clip -> AdamW (skipped when the loss or gradient is not finite) -> LR schedule.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cpudist.config import Config
from cpudist.data.batches import GlobalBatches
from cpudist.errors import UserError
from cpudist.infer.session import Session
from cpudist.model.adapters import trainable_parameters
from cpudist.model.init_adapter import apply_init_adapter, resolve_init_adapter
from cpudist.model.load import build_model, load_tokenizer, resolve_model_path
from cpudist.objectives import Datasets, ModelBatch, Objective, objective_for
from cpudist.objectives.evaluation import add_sums, allreduce_sums, evaluate, zero_sums
from cpudist.runtime.comm import CommMeter, agreed, allreduce, gradient_hook
from cpudist.runtime.precision import choose_precision
from cpudist.runtime.process import Process

log = logging.getLogger("cpudist")

# Data other than the objective's own (the bench's samples): (tokenizer, model) -> Datasets.
DataSource = Callable[[Any, nn.Module], Datasets]


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over every unit (label token, row, pair) of the global batch
    grad_norm: float  # before clipping
    units: float  # what the loss is a mean over, in the global batch (all ranks)
    label_tokens: float  # positions carrying loss in the global batch
    tokens: float  # real (non-padding) tokens of the global batch
    finite: bool  # False: loss or gradient not finite, the update was skipped
    lr: float  # the learning rate this step used
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's own


def lr_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to min_ratio of the peak."""
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_engine(config: Config, process: Process, data: DataSource | None = None,
                 total_steps: int | None = None) -> Engine:
    """Model, data, loss, optimizer, schedule and DDP of a training rank, for the objective
    train.objective names; `data` replaces the objective's own data (the bench's samples). Every
    rank gets the same adapter initialisation (same seed); a UserError on any rank stops them all
    with its message."""
    objective = objective_for(config)
    random.seed(config.train.seed)
    torch.manual_seed(config.train.seed)
    precision = choose_precision(config.model.dtype)

    def load() -> tuple[nn.Module, Any, Any, Datasets]:
        # The data first: a classifier's head is sized by the labels the data holds.
        tokenizer = load_tokenizer(resolve_model_path(config.model), config.model.trust_remote_code)
        started = time.perf_counter()
        own = objective.load_data(tokenizer) if data is None else None
        if own is not None:
            own.seconds = time.perf_counter() - started
        model, tokenizer, model_dir = build_model(config, precision,
                                                  objective.model_head(tokenizer), tokenizer)
        if config.model.init_adapter:
            apply_init_adapter(model, resolve_init_adapter(config.model.init_adapter), config.lora,
                               model_dir)
        datasets = own if data is None else data(tokenizer, model)
        assert datasets is not None
        return model, tokenizer, model_dir, datasets

    model, tokenizer, model_dir, datasets = agreed(process.placement, load)
    session = Session(config, process, precision, model, tokenizer, model_dir,
                      objective.model_head(tokenizer))
    return Engine(session, objective, datasets, total_steps)


class Engine:
    """A training rank: its session, objective, data, optimizer, schedule and the module a step
    runs."""

    def __init__(self, session: Session, objective: Objective, data: Datasets,
                 total_steps: int | None = None) -> None:
        config, placement = session.config, session.process.placement
        tc = config.train
        self.session = session
        self.objective = objective
        self.data = data
        self.config = config
        self.placement = placement
        self.loss = objective.loss_module(session.model)
        self.params = trainable_parameters(self.loss)
        self.param_names = [name for name, _ in self.params]
        self.optimizer = make_optimizer([p for _, p in self.params], config, placement.distributed)
        step_module: nn.Module = self.loss
        if tc.ipex:
            step_module, self.optimizer = _ipex_optimize(step_module, self.optimizer,
                                                         session.precision.compute_dtype)
        self.batches = GlobalBatches(data.train, tc.batch_size, tc.grad_accum,
                                     placement.world_size, tc.seed, config.data.group_by_length)
        self.total_steps = total_steps or tc.max_steps or tc.epochs * self.batches.steps_per_epoch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(tc.warmup_steps, self.total_steps, tc.min_lr_ratio))
        self.comm = CommMeter()  # the gradient allreduce, measured (zero in a single process)
        self.step_module = (wrap_ddp(step_module, config, self.comm) if placement.distributed
                            else step_module)
        hidden = getattr(getattr(self.model, "config", None), "hidden_size", 0) or 0
        self.compiled, why = decide_compile(config, hidden, self.total_steps, compiler_problem)
        if self.compiled:
            compile_decoder_layers(session.model, fall_back_to_eager=tc.compile == "auto")
        log.info("torch.compile: %s (%s)", "on" if self.compiled else "off", why)

    @property
    def model(self) -> nn.Module:
        return self.session.model

    @functools.cached_property
    def base_record(self) -> dict[str, Any]:
        """What saved adapters record about their base (cpudist.model.provenance): read from the
        base's files when rank 0 first saves one, then kept."""
        from cpudist.model.provenance import base_record

        return base_record(self.config, self.session.model_dir,
                           self.objective.model_head(self.session.tokenizer))

    @property
    def global_batch(self) -> int:
        tc = self.config.train
        return tc.batch_size * tc.grad_accum * self.placement.world_size

    def micro_batches(self, epoch: int, index: int) -> list[ModelBatch]:
        """This rank's micro-batches of optimizer step `index` of `epoch`."""
        return [self.objective.make_batch(self.data.train, indices, self.session.pad_id)
                for indices in self.batches.step_batches(epoch, index, self.placement.rank)]

    def step(self, micro: list[ModelBatch]) -> StepResult:
        """One optimizer step over this rank's micro-batches (every rank calls it together)."""
        units, label_tokens, tokens = allreduce(
            [sum(self.objective.weight(b) for b in micro), sum(b.label_tokens for b in micro),
             sum(b.tokens for b in micro)], self.placement)
        sums = allreduce_sums(self._accumulate_gradients(micro, units), self.placement)
        loss = sums["loss"] / max(units, 1.0)
        max_norm = self.config.train.max_grad_norm or float("inf")
        # A named scope, so that `bench --profile` can tell the optimizer's time from the rest.
        with torch.profiler.record_function("cpudist.optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in self.params], max_norm)
            finite = math.isfinite(loss) and bool(torch.isfinite(grad_norm))
            if finite:
                self.optimizer.step()
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, float(grad_norm), units, label_tokens, tokens, finite, lr,
                          self.objective.step_metrics(sums, units))

    def _accumulate_gradients(self, micro: list[ModelBatch], units: float) -> dict[str, float]:
        """Forward and backward over the micro-batches; returns this rank's sums (loss, units and
        the objective's metrics).

        Gradients are allreduced only on the last micro-batch (no_sync before). Each rank's loss
        is scaled so the averaged gradient is the mean over every unit of the global batch,
        whatever the world size or per-rank counts.
        """
        scale = self.placement.world_size / max(units, 1.0)
        module = self.step_module
        sums = zero_sums(self.objective)
        for k, batch in enumerate(micro):
            last = k == len(micro) - 1
            no_sync = (module.no_sync() if self.placement.distributed and not last
                       and hasattr(module, "no_sync") else contextlib.nullcontext())
            with no_sync:
                # Backward runs outside autocast (as torch's docs advise): the autocast cache
                # holds the bf16 copy of every fp32 weight until the context ends, while
                # outside it each copy goes with its layer's saved tensors as backward passes
                # it; with full fine-tuning that is a copy of the model (2 bytes a parameter)
                # less at the end of backward, where the fp32 gradients are all there.
                with self.session.precision.autocast():
                    output = module(**batch.as_kwargs())
                (output.total * scale).backward()
            add_sums(sums, output)
        return sums

    def evaluate(self) -> dict[str, float]:
        """The objective's validation figures (all ranks)."""
        session, tc = self.session, self.config.train
        return evaluate(self.objective, self.loss, self.data.val, tc.batch_size, session.pad_id,
                        session.precision, self.placement, tc.eval_batches)


def make_optimizer(params: list[nn.Parameter], config: Config, distributed: bool
                   ) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; with train.zero on several ranks, its state sharded
    across them (ZeroRedundancyOptimizer: each rank updates its share and broadcasts it)."""
    tc = config.train
    # fused: torch's one-pass CPU kernel (what HF Trainer uses too). On CPU AdamW otherwise runs
    # its per-tensor loop of a dozen element-wise passes: 0.21-0.24 s of a SmolLM2-135M full step
    # against 0.08 s (docs/PERFORMANCE.md, "Full fine-tuning: where the step goes").
    kwargs: dict[str, Any] = {"lr": tc.lr, "weight_decay": tc.weight_decay,
                              "fused": all(p.dtype in _FUSED_DTYPES for p in params)}
    if not tc.zero:
        return torch.optim.AdamW(params, **kwargs)
    if not distributed:
        log.info("train.zero: one rank holds the whole optimizer state (nothing to shard)")
        return torch.optim.AdamW(params, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    log.info("train.zero: AdamW state sharded across the ranks (ZeroRedundancyOptimizer)")
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kwargs)


# The parameter dtypes torch's fused CPU AdamW takes.
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a causal LM (the ModuleList that holds the most parameters)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


# train.compile=auto compiles where compiling repaid its own time on the measured shapes: hidden
# sizes from Qwen2.5-0.5B's up, runs long enough to win back the compile; SmolLM2-135M's compiled
# steps were slower than eager (docs/PERFORMANCE.md, "torch.compile: where it pays").
COMPILE_MIN_HIDDEN = 768
COMPILE_MIN_STEPS = 200


def compiler_problem() -> str | None:
    """Why Inductor's CPU backend cannot build here (no C++ compiler, no Python headers), or None."""
    import os
    import sysconfig

    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # noqa: BLE001 - Inductor raises its own types, all meaning "none found"
        return "no C++ compiler found (apt-get install g++)"
    if not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return "no Python headers (Python.h; apt-get install python3-dev)"
    return None


def decide_compile(config: Config, hidden_size: int, total_steps: int,
                   find_compiler_problem: Callable[[], str | None]) -> tuple[bool, str]:
    """(compile the decoder layers?, why) for train.compile true/false/auto.

    find_compiler_problem (compiler_problem in a run) is asked last, only when the answer depends
    on it: importing Inductor to ask takes over a second. Otherwise pure, so the rule is tested.
    A resumed run on the same world size decides the same way, so it computes what the
    uninterrupted one did (total_steps can change with the world size when train.global_batch is
    not set)."""
    setting = config.train.compile
    if setting is False:
        return False, "train.compile=false"
    if setting == "auto":
        if config.train.ipex:
            return False, "auto: train.ipex=true optimizes the model instead"
        if config.model.quantize != "none":
            return False, ("auto: a quantized base is not measured under compile; "
                           "train.compile=true forces it")
        if hidden_size < COMPILE_MIN_HIDDEN:
            return False, (f"auto: hidden size {hidden_size} < {COMPILE_MIN_HIDDEN}, where "
                           "compiled steps were not faster")
        if total_steps < COMPILE_MIN_STEPS:
            return False, (f"auto: {total_steps} steps < {COMPILE_MIN_STEPS}, too few to repay "
                           "the compile time; train.compile=true forces it")
    problem = find_compiler_problem()
    if problem is not None:
        if setting is True:
            raise UserError(f"train.compile=true: torch.compile cannot build here: {problem}; "
                            "install it or use train.compile=auto (compiles only where it can)")
        return False, f"auto: {problem}"
    if setting is True:
        return True, "train.compile=true"
    return True, f"auto: hidden size {hidden_size}, {total_steps} steps"


def compile_decoder_layers(model: nn.Module, fall_back_to_eager: bool = False) -> None:
    """torch.compile (Inductor, which needs a C++ compiler) over each decoder layer: one graph
    serves every layer, dynamic in batch and length so that length-grouped batches do not
    recompile. The embedding, loss head and DDP stay eager. fall_back_to_eager: a graph that
    Inductor fails to build runs eager instead of stopping the run (train.compile=auto)."""
    from cpudist.model.fast_lora import prepare_for_compile

    if fall_back_to_eager:
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True
    prepare_for_compile(model)
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    log.info("torch.compile: %d decoder layers (Inductor, dynamic shapes)", len(layers))


def wrap_ddp(module: nn.Module, config: Config, meter: CommMeter | None = None) -> nn.Module:
    """DDP over the adapter's parameters only, its allreduce measured by meter; over MPI when
    dist.backend=mpi, in bf16 when dist.grad_compression=bf16."""
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
        # gradient_as_bucket_view: the gradients live in DDP's buckets instead of beside them,
        # one fp32 copy of every trainable weight less per rank (540 MB for SmolLM2-135M full).
        ddp = DDP(module, bucket_cap_mb=config.dist.bucket_cap_mb, broadcast_buffers=False,
                  find_unused_parameters=False, gradient_as_bucket_view=True)
    hook, wire_bytes = gradient_hook(config.dist.backend, config.dist.grad_compression,
                                     config.dist.mpi_nonblocking)
    if meter is not None:
        hook = meter.wrap(hook, wire_bytes)
    ddp.register_comm_hook(None, hook)  # state None: the default group
    return ddp


def _ipex_optimize(module: nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype
                   ) -> tuple[nn.Module, torch.optim.Optimizer]:
    try:
        import intel_extension_for_pytorch as ipex
    except ImportError:
        log.warning("train.ipex=true but intel_extension_for_pytorch does not import (it is "
                    "retired upstream and needs torch 2.8); continuing with stock PyTorch")
        return module, optimizer
    log.info("IPEX %s: ipex.optimize on the model and optimizer (%s)", ipex.__version__, dtype)
    # inplace: the session's model (evaluated, saved, checkpointed) must be the one trained; the
    # default deep copy trained a twin while the saved adapter stayed at its initial values.
    return ipex.optimize(module, optimizer=optimizer, dtype=dtype, inplace=True)
