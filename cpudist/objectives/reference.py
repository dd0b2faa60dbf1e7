"""DPO's reference log-probabilities: which model gives them, and computing them once.

The reference is the policy's own model with the adapter disabled (a fresh adapter: the base), or,
when the run starts from a saved adapter (model.init_adapter), the base with that adapter's weights
swapped in for the pass (the trained weights are put back after it). No second model is loaded.

preference.reference=precomputed computes every pair's reference once, before training, every rank
a strided share, and caches it beside the tokenized data (data.cache_dir/reference/), keyed by the
base's fingerprint, its quantization and compute dtype, the start adapter, and the pairs' token
ids: a resumed run, a run on another world size and later runs on the same data read it back, so
they use the same numbers. per_step runs a gradient-free forward of the reference in each step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from cpudist.data.preference import PreferenceSplit
from cpudist.files import file_lock, replacing
from cpudist.model.init_adapter import adapter_digest, init_tensors, resolve_init_adapter
from cpudist.runtime.comm import all_gather, allreduce

if TYPE_CHECKING:
    from cpudist.objectives.preference import PairLoss
    from cpudist.train.engine import Engine

log = logging.getLogger("cpudist")


class Reference:
    """The reference model, made active for a gradient-free pass: `with reference.active(): ...`."""

    def __init__(self, model: nn.Module, init_dir: Path | None) -> None:
        self.model = model
        self.init = init_tensors(init_dir) if init_dir is not None else None

    def describe(self) -> str:
        return ("the base with the adapter disabled" if self.init is None else
                "the base + the start adapter (model.init_adapter), frozen")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        was_training = self.model.training
        self.model.eval()  # no dropout in the reference
        try:
            if self.init is None:
                with self.model.disable_adapter():
                    yield
            else:
                trained = {k: v.detach().clone()
                           for k, v in get_peft_model_state_dict(self.model).items()}
                set_peft_model_state_dict(self.model, self.init)
                try:
                    yield
                finally:
                    set_peft_model_state_dict(self.model, trained)
        finally:
            self.model.train(was_training)


def reference_mode(engine: Engine, pairs: int) -> tuple[str, str]:
    """(precomputed or per_step, why) for preference.reference."""
    setting = engine.config.preference.reference
    if setting != "auto":
        return setting, f"preference.reference={setting}"
    seen = engine.total_steps * engine.global_batch
    if seen >= pairs:
        return "precomputed", (f"auto: the run trains on {seen} pairs, every one of the {pairs} "
                               "at least once, so one pass before training costs less than one "
                               "per step")
    return "per_step", (f"auto: the run trains on {seen} of {pairs} pairs; precomputing all of "
                        "them would cost more than a reference forward per step")


def prepare_reference(engine: Engine) -> str:
    """Set up DPO's reference for the run: per step (the loss module computes it), or precomputed
    into the training and validation splits (cached). Returns which, in a few words."""
    config, loss = engine.config, engine.loss
    init = resolve_init_adapter(config.model.init_adapter) if config.model.init_adapter else None
    source = Reference(engine.model, init)
    train: PreferenceSplit = engine.data.train
    mode, why = reference_mode(engine, len(train))
    log.info("DPO reference: %s, %s (%s)", source.describe(),
             "precomputed once" if mode == "precomputed" else "computed at every step", why)
    if mode == "per_step":
        loss.reference_source = source
        return "DPO reference: a forward at every step"
    model_key = _model_key(engine, init)
    cached = []
    for name, split in (("training", train), ("validation", engine.data.val)):
        if len(split):
            split.reference, from_cache = cached_reference(engine, loss, source, split, model_key,
                                                           name)
            cached.append(from_cache)
    return ("DPO reference: precomputed, " + ("read from the cache" if all(cached) else
                                              f"one pass over {len(train)} pairs"))


def _model_key(engine: Engine, init: Path | None) -> str:
    from cpudist.model.provenance import base_fingerprint

    model = engine.config.model
    return json.dumps([base_fingerprint(engine.session.model_dir), model.quantize,
                       model.quantize_group, model.quantize_head,
                       engine.session.precision.compute,
                       model.attn_implementation, adapter_digest(init) if init else "fresh"])


def _pairs_digest(model_key: str, split: PreferenceSplit) -> str:
    digest = hashlib.sha256(model_key.encode())
    for column in (split.prompt, split.chosen, split.rejected):
        digest.update(json.dumps(column).encode())
    return digest.hexdigest()[:24]


def cached_reference(engine: Engine, loss: PairLoss, source: Reference, split: PreferenceSplit,
                     model_key: str, name: str) -> tuple[list[tuple[float, float]], bool]:
    """(the split's reference log-probabilities (chosen, rejected) per pair, whether they were read
    from the cache): read when every rank has them there, else computed by all ranks together
    and cached."""
    from safetensors.torch import load_file, save_file

    placement = engine.placement
    path = Path(engine.config.data.cache_dir) / "reference" / f"{_pairs_digest(model_key, split)}.safetensors"
    (everywhere,) = allreduce([float(path.is_file())], placement, op="min")
    if everywhere:
        stored = load_file(str(path))
        log.info("DPO reference of the %s pairs: read from %s", name, path)
        return list(zip(stored["chosen"].tolist(), stored["rejected"].tolist(), strict=True)), True
    started = time.perf_counter()
    merged: dict[int, tuple[float, float]] = {}
    for share in all_gather(_compute_share(engine, loss, source, split), placement):
        merged.update(share)
    values = torch.tensor([merged[i] for i in range(len(split))], dtype=torch.float32)
    with file_lock(path.with_suffix(".lock")):
        if not path.is_file():
            with replacing(path) as tmp:
                save_file({"chosen": values[:, 0].contiguous(), "rejected": values[:, 1].contiguous()},
                          str(tmp))
    log.info("DPO reference of the %d %s pairs: computed in %.1f s, cached in %s", len(split), name,
             time.perf_counter() - started, path)
    return [(float(c), float(r)) for c, r in values.tolist()], False


@torch.no_grad()
def _compute_share(engine: Engine, loss: PairLoss, source: Reference, split: PreferenceSplit
                   ) -> dict[int, tuple[float, float]]:
    """This rank's strided share of the pairs' reference log-probabilities, shortest first."""
    from cpudist.objectives.preference import collate_pairs

    placement, session = engine.placement, engine.session
    lengths = split.lengths()
    mine = sorted(range(placement.rank, len(split), placement.world_size), key=lengths.__getitem__)
    size = engine.config.train.batch_size
    found: dict[int, tuple[float, float]] = {}
    with source.active():
        for start in range(0, len(mine), size):
            indices = mine[start : start + size]
            batch = collate_pairs(split, indices, session.pad_id)
            with session.precision.autocast():
                logps, _ = loss.row_logps(batch.input_ids, batch.attention_mask, batch.labels)
            values = logps.float().tolist()
            for k, index in enumerate(indices):
                found[index] = (values[k], values[len(indices) + k])
    return found
