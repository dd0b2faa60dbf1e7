"""Frozen base weights mapped read-only from the model's safetensors files.

Every rank of a node maps the same file copy-on-write (MAP_PRIVATE), so the pages live once in the
page cache instead of once per rank. Frozen weights are never written, so no page is ever copied.
The files are read and written with cpudist.model.safetensors_io (mappings, one tensor at a time).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cpudist.files import file_lock, remove, replacing
from cpudist.model.safetensors_io import (
    SAFETENSORS_DTYPES,
    ByteProgress,
    Spec,
    files_fingerprint,
    mapped_tensors,
    read_header,
    read_tensor,
    weight_files,
    write_file,
)
from cpudist.runtime.process import run_apart

log = logging.getLogger("cpudist")

def _convert_file(source: Path, target: Path, dtype: torch.dtype, progress: ByteProgress) -> None:
    """source's tensors, floating ones cast to dtype, written as target one tensor at a time
    (progress counts the source's bytes read)."""
    header, data_start = read_header(source)
    order = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    specs = {}
    for name, meta in order:
        stored = SAFETENSORS_DTYPES[meta["dtype"]]
        specs[name] = Spec(dtype if stored.is_floating_point else stored, tuple(meta["shape"]))

    def make(name: str) -> torch.Tensor:
        tensor = read_tensor(source, header[name], data_start)
        begin, end = header[name]["data_offsets"]
        progress.add(end - begin)
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    write_file(target, specs, make)


def converted_dir(model_dir: Path, dtype: torch.dtype, cache_dir: Path) -> Path:
    """The model's safetensors files with floating tensors cast to dtype, written once per node.

    Lets every rank map bf16 weights when the model ships fp32 (instead of a private bf16 copy per
    rank). Keyed by the source files' path, size and mtime; one tensor at a time bounds memory.
    """
    files = weight_files(model_dir)
    name = str(dtype).removeprefix("torch.")
    key = files_fingerprint(files, name)
    target = Path(cache_dir) / "converted" / f"{Path(model_dir).resolve().name}-{key}-{name}"
    with file_lock(target.with_name(f".{target.name}.lock")):
        if not (target / "done").exists():
            log.info("converting %s frozen weights to %s once into %s", model_dir, name, target)
            # In a child process, so that its memory is given back when it ends.
            run_apart(_convert_files, Path(model_dir), files, dtype, target)
    return target


def _convert_files(model_dir: Path, files: list[Path], dtype: torch.dtype, target: Path) -> None:
    remove(target)
    target.mkdir(parents=True)
    progress = ByteProgress(f"converting {model_dir.name}", sum(f.stat().st_size for f in files))
    for file in files:
        with replacing(target / file.name) as tmp:
            _convert_file(file, tmp, dtype, progress)
    progress.finish()
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        (target / index.name).write_text(index.read_text())
    (target / "done").write_text("")


def mapped_source(model_dir: Path, dtype: torch.dtype, cache_dir: Path) -> Path:
    """A directory whose safetensors files hold every floating tensor in dtype: the model's own,
    or a copy converted once under cache_dir."""
    files = weight_files(model_dir)
    on_file = {SAFETENSORS_DTYPES.get(meta["dtype"]) for file in files
               for meta in read_header(file)[0].values()}
    if {d for d in on_file if d is not None and d.is_floating_point} <= {dtype}:
        return Path(model_dir)
    return converted_dir(Path(model_dir), dtype, cache_dir)


def build_on_mapping(source: Path, hf_config: Any, dtype: torch.dtype,
                     prepare: Callable[[nn.Module], None] | None = None,
                     auto_class: Any = None, **from_config: Any) -> nn.Module | None:
    """The model (of transformers' auto_class, default a causal LM) built without weights
    (prepare(model) may swap modules first), then every parameter and buffer the files hold
    pointed at their mapping in source. None when the files' tensor names do not cover the model
    exactly."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    # Parameters on the meta device (no memory); buffers such as rotary inv_freq are computed as usual.
    with init_empty_weights(include_buffers=False):
        model = (auto_class or AutoModelForCausalLM).from_config(hf_config, dtype=dtype,
                                                                 **from_config)
    if prepare is not None:
        prepare(model)
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(source):
        tensors.update(mapped_tensors(file))
    result = model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()  # tied heads point at the newly assigned embedding
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if result.unexpected_keys or left:
        log.debug("weights not mappable as is (unexpected %s, missing %s)",
                  result.unexpected_keys[:3], left[:3])
        return None
    return model


def build_mapped(model_dir: Path, hf_config: Any, dtype: torch.dtype, cache_dir: Path,
                 **from_config: Any) -> tuple[nn.Module, Path] | None:
    """The model built without weights, then every parameter pointed at the mapped files.

    from_pretrained would first fill a private copy of all weights while it maps the files (the
    run's peak RSS; docs/PERFORMANCE.md, "Frozen weights: mapped and shared per node"); here the
    only memory is the mapping, touched as layers run. Returns None when the files'
    tensor names do not cover the model exactly (renamed or fused checkpoints, quantized models):
    the caller then loads normally.
    """
    if not weight_files(model_dir) or getattr(hf_config, "quantization_config", None) is not None:
        return None
    source = mapped_source(model_dir, dtype, cache_dir)
    model = build_on_mapping(source, hf_config, dtype, **from_config)
    return None if model is None else (model, source)


def share_frozen_weights(model: nn.Module, model_dir: Path, cache_dir: Path | None = None
                         ) -> tuple[int, Path]:
    """Point frozen parameters at a read-only mapping of the weight files; returns (count, dir).

    When frozen parameters are in another floating dtype than the files (e.g. bf16 compute from an
    fp32 model) and cache_dir is given, a converted copy is written once under cache_dir and mapped
    instead; without cache_dir such parameters keep their private copy.
    """
    params = {name: param for name, param in model.named_parameters() if not param.requires_grad}
    source = Path(model_dir)
    wanted = {p.dtype for p in params.values() if p.is_floating_point()}
    if cache_dir is not None and len(wanted) == 1:
        source = mapped_source(source, wanted.pop(), cache_dir)
    count = 0
    for file in weight_files(source):
        for name, tensor in mapped_tensors(file).items():
            param = params.get(name)
            if param is None or param.dtype != tensor.dtype or param.shape != tensor.shape:
                continue
            param.data = tensor
            count += 1
    return count, source
