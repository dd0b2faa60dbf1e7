"""Rank-0 checkpoints: atomic, resumable, keep-last-K; safetensors for tensors, JSON for the rest.

Layout of OUTPUT/checkpoints/step-N/:
  adapter/                 PEFT adapter (adapter_config.json + adapter_model.safetensors)
  trainable.safetensors    every trainable parameter as the model names it: what resume loads (a
                           P-tuning adapter/ holds the encoder's output, not the encoder)
  model/                   instead of both, with peft.method=full: the whole model as a Hugging
                           Face directory (config, fp32 safetensors split at output.max_shard_mb,
                           tokenizer), which is also what resume loads
  optimizer.safetensors    AdamW moments per trainable parameter (keyed by parameter name; with
                           train.zero gathered from every rank's shard, so any world size resumes)
  rng.safetensors          torch RNG state of every rank
  state.json               step, epoch, position in the epoch, world size, optimizer hyperparameters,
                           scheduler state, python RNG of every rank, counters
  config.yaml              the resolved config of the run
  manifest.json            size and SHA-256 of every other file (cpudist.train.checkpoint_files)
A checkpoint is written into a hidden temporary directory and renamed into place, so a crash
during a save leaves the previous checkpoint as it was; leftovers are removed on resume. Resume
checks the manifest: a damaged newest checkpoint is moved aside and the previous one used, which
is why train.keep_last is at least 2.

`save`/`load_resume`/`apply` connect a checkpoint with an engine: every rank's RNG is gathered for rank 0 to
write, and rank 0 alone reads a checkpoint and sends it to the others (no shared filesystem needed).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cpudist.errors import UserError
from cpudist.files import fsync_dir, fsync_tree, remove, replacing
from cpudist.model.adapters import is_full
from cpudist.model.provenance import write_provenance
from cpudist.runtime.comm import agreed, all_gather, broadcast, rank0_only
from cpudist.train.checkpoint_files import check_given, checkpoint_dirs, resume_auto, write_manifest

if TYPE_CHECKING:
    from cpudist.runtime.cluster import Placement
    from cpudist.train.engine import Engine

log = logging.getLogger("cpudist")


@dataclass
class TrainState:
    """Counters that, with the weights and RNG, determine what happens next."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0
    world_size: int = 1
    global_batch: int = 0  # rows per optimizer step over all ranks (0: a checkpoint from before)
    bad_steps_total: int = 0
    bad_steps_in_a_row: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0  # training wall time before this process started
    extra: dict[str, Any] = field(default_factory=dict)

    def position(self, steps_per_epoch: int) -> tuple[int, int]:
        """(epoch, step in the epoch) of the next step, moving on to the next epoch at the end
        of one."""
        if self.step_in_epoch >= steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return self.epoch, self.step_in_epoch


def rng_state() -> dict[str, Any]:
    """This process's RNG: torch (tensor) and python (JSON-able)."""
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split optimizer state into tensors (keyed by parameter name) and JSON-able settings."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{names[index]}::{key}"] = tensor.contiguous()
    return tensors, {"param_groups": state["param_groups"]}


def load_optimizer(optimizer: torch.optim.Optimizer, names: list[str],
                   tensors: dict[str, torch.Tensor], settings: dict[str, Any]) -> None:
    index_of = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, _, slot = key.rpartition("::")
        if name not in index_of:
            raise UserError(f"checkpoint optimizer state names parameter {name!r} which this model "
                            "does not have; resume with the same model and lora settings")
        state.setdefault(index_of[name], {})[slot] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": settings["param_groups"]})


@dataclass(frozen=True)
class FullModel:
    """How a peft.method=full run saves its model: beside it the tokenizer, split in files of at
    most max_shard_mb."""

    tokenizer: Any
    max_shard_mb: int


def save_full_model(model: Any, tokenizer: Any, target: Path, max_shard_mb: int) -> None:
    """A plain Hugging Face model directory (config, safetensors shards, tokenizer) that
    from_pretrained loads; the weights as trained (fp32 master weights)."""
    model.save_pretrained(target, safe_serialization=True, max_shard_size=f"{max_shard_mb}MB")
    tokenizer.save_pretrained(target)


def read_full_model(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved model directory's safetensors files, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _save_adapter_files(model: Any, tmp: Path, annotate: Callable[[Path], None] | None) -> None:
    model.save_pretrained(tmp / "adapter", safe_serialization=True)
    if annotate is not None:
        annotate(tmp / "adapter")
    save_file({name: param.detach().contiguous() for name, param
               in model.named_parameters() if param.requires_grad},
              str(tmp / "trainable.safetensors"))


def save_checkpoint(root: Path, model: Any, optimizer: torch.optim.Optimizer,
                    param_names: list[str], scheduler: Any, state: TrainState,
                    rng_states: list[dict[str, Any]], config_yaml: str, keep_last: int,
                    annotate: Callable[[Path], None] | None = None,
                    full: FullModel | None = None) -> Path:
    """Write OUTPUT/checkpoints/step-N atomically (rank 0 only); returns its path. annotate(dir)
    adds files to the saved adapter directory (its base record and model card); full: the run
    trains the whole model, saved as model/ instead of an adapter."""
    for name, param in model.named_parameters():
        if param.requires_grad and not torch.isfinite(param).all():
            raise RuntimeError(f"refusing to save a checkpoint: trainable weight {name} is not "
                               "finite")
    final = root / f"step-{state.step}"
    try:
        with replacing(final) as tmp:
            tmp.mkdir()
            if full is not None:
                save_full_model(model, full.tokenizer, tmp / "model", full.max_shard_mb)
            else:
                _save_adapter_files(model, tmp, annotate)
            tensors, settings = optimizer_tensors(optimizer, param_names)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            save_file({f"rank{r}": s["torch"] for r, s in enumerate(rng_states)},
                      str(tmp / "rng.safetensors"))
            payload = {
                "train": asdict(state),
                "optimizer": settings,
                "scheduler": scheduler.state_dict(),
                "python_rng": [s["python"] for s in rng_states],
                "format": 1,
            }
            (tmp / "config.yaml").write_text(config_yaml)
            # state.json last: its presence marks a complete checkpoint.
            (tmp / "state.json").write_text(json.dumps(payload, indent=1))
            write_manifest(tmp)  # last: it covers every file above
            fsync_tree(tmp)
        fsync_dir(root)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
        previous = checkpoint_dirs(root)
        kept = f"; the previous checkpoint {previous[-1]} is intact" if previous else ""
        reason = getattr(exc, "strerror", None) or str(exc)
        raise UserError(f"could not write checkpoint {final}: {reason}{kept}. Free "
                        "disk space or fix permissions, then resume with train.resume=auto") from exc
    for old in checkpoint_dirs(root)[:-keep_last]:
        remove(old)
    return final


@dataclass
class LoadedCheckpoint:
    path: Path
    state: TrainState
    adapter_tensors: dict[str, torch.Tensor]  # PEFT's saved adapter (users' format)
    trainable_tensors: dict[str, torch.Tensor] | None  # the parameters themselves (None: older)
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer_settings: dict[str, Any]
    scheduler_state: dict[str, Any]
    rng_states: list[dict[str, Any]]


def find_resume(resume: str | None, root: Path) -> Path | None:
    """The checkpoint to continue from for train.resume (None = start fresh)."""
    if resume is None:
        return None
    if resume == "auto":
        return resume_auto(root)
    path = Path(resume)
    if not (path / "state.json").is_file() or not ((path / "adapter").is_dir()
                                                   or (path / "model").is_dir()):
        raise UserError(f"train.resume={resume!r} is not a cpudist checkpoint (expected a "
                        "checkpoints/step-N directory with state.json and adapter/ or model/); use "
                        "train.resume=auto to pick the newest one")
    check_given(path)
    return path


def _saved_state(path: Path, payload: dict[str, Any] | None = None) -> TrainState:
    """The counters of a checkpoint (from its state.json, or the payload already read from it),
    with its global batch (derived from its config.yaml for checkpoints written before state.json
    recorded it)."""
    import yaml

    try:
        payload = payload or json.loads((path / "state.json").read_text())
        state = TrainState(**payload["train"])
        if not state.global_batch:
            train = (yaml.safe_load((path / "config.yaml").read_text()) or {})["train"]
            state.global_batch = train["batch_size"] * train["grad_accum"] * state.world_size
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"checkpoint {path} is unreadable ({exc}); resume from an older one with "
                        "train.resume=PATH") from exc
    return state


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    try:
        payload = json.loads((path / "state.json").read_text())
        optimizer = load_file(str(path / "optimizer.safetensors"))
        rng = load_file(str(path / "rng.safetensors"))
        trainable_file = path / "trainable.safetensors"
        adapter: dict[str, torch.Tensor] = {}
        if (path / "model").is_dir():  # peft.method=full
            trainable: dict[str, torch.Tensor] | None = read_full_model(path / "model")
        else:
            # Straight from safetensors: peft's loader would fall back to unpickling
            # adapter_model.bin.
            adapter = load_file(str(path / "adapter" / "adapter_model.safetensors"))
            trainable = load_file(str(trainable_file)) if trainable_file.is_file() else None
    except (OSError, ValueError, SafetensorError) as exc:
        raise UserError(f"checkpoint {path} is unreadable ({exc}); resume from an older one with "
                        "train.resume=PATH") from exc
    train = _saved_state(path, payload)
    rng_states = [{"torch": rng[f"rank{r}"], "python": py}
                  for r, py in enumerate(payload["python_rng"])]
    return LoadedCheckpoint(path, train, adapter, trainable, optimizer, payload["optimizer"],
                            payload["scheduler"], rng_states)


# --------------------------------------------------------------------------- with an engine


def save(engine: Engine, state: TrainState, out: Path) -> None:
    """Checkpoint the engine's adapter, optimizer, schedule and every rank's RNG (rank 0 writes)."""
    rng_states = all_gather(rng_state(), engine.placement)
    consolidate = getattr(engine.optimizer, "consolidate_state_dict", None)
    if consolidate is not None:  # ZeroRedundancyOptimizer: every rank sends its shard to rank 0
        consolidate(to=0)
    config = engine.config
    full = (FullModel(engine.session.tokenizer, config.output.max_shard_mb)
            if is_full(config) else None)

    def write() -> None:
        path = save_checkpoint(out / "checkpoints", engine.model, engine.optimizer,
                               engine.param_names, engine.scheduler, state, rng_states,
                               config.to_yaml(), config.train.keep_last,
                               lambda adapter: write_provenance(adapter, engine.base_record,
                                                                {"steps": state.step}), full)
        log.info("checkpoint: %s", path)

    rank0_only(engine.placement, write)


def load_resume(resume: str | None, out: Path, placement: Placement) -> LoadedCheckpoint | None:
    """The checkpoint train.resume continues from (the newest intact one for auto), read once by
    rank 0 and sent to every rank (no shared filesystem needed); None when there is none."""
    if resume is None:
        return None

    def read() -> LoadedCheckpoint | None:
        found = find_resume(resume, out / "checkpoints")
        return load_checkpoint(found) if found else None

    # broadcast pickles, but only between this job's own processes.
    return broadcast(rank0_only(placement, read), placement)


def load_trainable(model: Any, loaded: LoadedCheckpoint) -> None:
    """The checkpoint's trainable parameters into the model (PEFT's saved adapter for a
    checkpoint that has no trainable.safetensors)."""
    from peft import set_peft_model_state_dict

    if loaded.trainable_tensors is None:
        set_peft_model_state_dict(model, loaded.adapter_tensors)
        return
    wanted = {name for name, param in model.named_parameters() if param.requires_grad}
    if set(loaded.trainable_tensors) != wanted:
        extra = sorted(set(loaded.trainable_tensors) ^ wanted)[:3]
        raise UserError(f"checkpoint {loaded.path} holds other trainable parameters than this run "
                        f"trains ({', '.join(extra)}, ...); resume with the same model, method "
                        "and its settings")
    model.load_state_dict(loaded.trainable_tensors, strict=False)


def apply(engine: Engine, loaded: LoadedCheckpoint) -> TrainState:
    """Continue from a loaded checkpoint: adapter, optimizer, schedule and this rank's RNG. A
    checkpoint that does not fit this run stops every rank together."""
    placement = engine.placement

    def load() -> TrainState:
        saved = loaded.state
        if saved.global_batch != engine.global_batch:
            raise UserError(
                f"checkpoint {loaded.path} trained with a global batch of {saved.global_batch} "
                f"rows and this run's is {engine.global_batch}; resume with the same "
                "train.global_batch (or the same batch_size x grad_accum x ranks)")
        load_trainable(engine.model, loaded)
        load_optimizer(engine.optimizer, engine.param_names, loaded.optimizer_tensors,
                       loaded.optimizer_settings)
        engine.scheduler.load_state_dict(loaded.scheduler_state)
        # The data order and the position in it depend only on the global batch. A rank that
        # did not exist when the checkpoint was written starts from rank 0's random state.
        ranks = len(loaded.rng_states)
        set_rng_state(loaded.rng_states[placement.rank if placement.rank < ranks else 0])
        return replace(saved, world_size=placement.world_size)

    state = agreed(placement, load)
    log.info("resumed from %s at step %d", loaded.path, state.step)
    return state
