"""The validation figures of the untrained model (before step 1), cached beside the tokenized data.

They depend on the base model, the adapter as initialised (method, its settings, the seed), the
precision, the held-out samples and how they are evaluated (batch size, eval_batches, world
size), and not on the learning-rate schedule, the step count, checkpoints or where the output
goes. A sweep over train.lr, or the same run started again, evaluated the same untrained model on
the same samples each time (42 s of a 61 s start on the 2,000,000-row benchmark): with the
figures cached it pays once.

The key is conservative: the whole resolved config except a short, explicit list of settings that
cannot change the untrained model, the held-out samples or the evaluation (IGNORED); the held-out
samples themselves (their token ids, hashed); the base model's fingerprint and the start adapter's
digest; the compute dtype, the world size, the CPU's kernel family and the torch and cpudist
versions (numbers that differ in the last bits on another kernel would otherwise be reused). A
setting missing from IGNORED only costs a recomputation. A split whose contents cannot be hashed
is not cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpudist.files import file_lock, write_text
from cpudist.records import BaselineEvaluation
from cpudist.runtime.comm import allreduce

if TYPE_CHECKING:
    from cpudist.train.engine import Engine

log = logging.getLogger("cpudist")

# Settings that cannot change the untrained model, the held-out samples or their evaluation: the
# schedule and length of training, checkpoints, logging, what is done after training, where the
# output goes, how ranks find each other and who is told.
IGNORED = {
    "train": {"lr", "weight_decay", "warmup_steps", "min_lr_ratio", "max_grad_norm", "max_steps",
              "epochs", "grad_accum", "global_batch", "eval_every", "log_every", "save_every",
              "keep_last", "resume", "save_on_signal", "max_bad_steps", "check_memory",
              "sample_prompts", "max_new_tokens"},
    "dist": {"master_addr", "master_port", "interface", "timeout_s"},
    "output": "all",
    "tracking": "all",
}
# DPO's reference is computed once or at every step depending on the steps and batch (reference
# "auto"): for it those stay in the key.
SCHEDULE = {"max_steps", "epochs", "grad_accum", "global_batch"}


class _Unhashable(Exception):
    """A split holds something the key cannot be made from."""


def baseline_key(engine: Engine) -> str | None:
    """The cache key of the run's baseline evaluation; None where one cannot be made."""
    import torch

    from cpudist import __version__
    from cpudist.model.init_adapter import adapter_digest, resolve_init_adapter
    from cpudist.model.provenance import base_fingerprint

    config = engine.config.model_dump(mode="json")
    for section, names in IGNORED.items():
        if names == "all":
            config.pop(section, None)
            continue
        kept = SCHEDULE if engine.objective.name == "dpo" else set()
        for name in set(names) - kept:
            config[section].pop(name, None)
    init = engine.config.model.init_adapter
    digest = hashlib.sha256()
    try:
        _update(digest, engine.data.val)
    except _Unhashable:
        return None
    parts = [config, base_fingerprint(engine.session.model_dir),
             adapter_digest(resolve_init_adapter(init)) if init else "fresh",
             engine.session.precision.describe(), engine.placement.world_size,
             torch.backends.cpu.get_cpu_capability(), torch.__version__, __version__,
             digest.hexdigest()]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _update(digest: Any, value: Any) -> None:
    """Hash a split's contents: token rows (cpudist.data.tokenize.Rows), lists, arrays, numbers,
    strings and objects of those; anything else is _Unhashable."""
    import numpy as np

    from cpudist.data.tokenize import Rows

    if isinstance(value, Rows):
        digest.update(np.asarray(value.length, dtype=np.int64).tobytes())
        for row in range(len(value)):
            begin, length = int(value.start[row]), int(value.length[row])
            # int64 whatever the source (a fresh tokenization, or the cache's Arrow columns)
            digest.update(np.asarray(value.values[value.chunk[row]][begin:begin + length],
                                     dtype=np.int64).tobytes())
    elif value is None or isinstance(value, (bool, int, float, str)):
        digest.update(repr(value).encode())
    elif isinstance(value, (list, tuple)):
        try:
            digest.update(json.dumps(value).encode())
        except TypeError:
            digest.update(f"[{len(value)}".encode())
            for item in value:
                _update(digest, item)
    elif isinstance(value, dict):
        for name in sorted(value):
            digest.update(str(name).encode())
            _update(digest, value[name])
    elif isinstance(value, np.ndarray):
        digest.update(f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
    elif hasattr(value, "__dict__") and not callable(value):
        digest.update(type(value).__qualname__.encode())
        _update(digest, vars(value))
    else:
        raise _Unhashable(type(value).__qualname__)


def baseline_evaluation(engine: Engine) -> dict[str, float]:
    """The untrained model's validation figures: read from the cache when every rank has them
    there (the log says so), else evaluated by all ranks and cached."""
    key = baseline_key(engine)
    if key is None:
        return engine.evaluate()
    path = Path(engine.config.data.cache_dir) / "baseline" / f"{key}.json"
    stored = BaselineEvaluation.read(path)
    (everywhere,) = allreduce([float(stored is not None)], engine.placement, op="min")
    if everywhere and stored is not None:
        log.info("baseline evaluation: cached (%s..., computed in %.1f s; %s)", key[:12],
                 stored.seconds, path)
        return stored.figures
    began = time.perf_counter()
    figures = engine.evaluate()
    record = BaselineEvaluation(key=key, figures=figures, seconds=time.perf_counter() - began,
                                samples=len(engine.data.val))
    if figures:
        with file_lock(path.with_suffix(".lock")):
            write_text(path, json.dumps(record.to_json(), indent=1))
        log.info("baseline evaluation: computed in %.1f s, cached as %s (%s...)", record.seconds,
                 path, key[:12])
    return figures
