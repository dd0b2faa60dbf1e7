"""Frozen base weights mapped read-only from the model's safetensors files.

Every rank of a node maps the same file copy-on-write (MAP_PRIVATE), so the pages live once in the
page cache instead of once per rank. Frozen weights are never written, so no page is ever copied.
Written by hand because safetensors' own loaders copy each tensor into private memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("cpudist")

SAFETENSORS_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """(tensor table, byte offset where the data section starts)."""
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def mapped_tensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a view into one copy-on-write mapping of it."""
    header, data_start = read_header(file)
    whole = torch.from_file(str(file), shared=False, size=file.stat().st_size, dtype=torch.uint8)
    tensors = {}
    for name, meta in header.items():
        dtype = SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            continue
        start, end = meta["data_offsets"]
        raw = whole[data_start + start : data_start + end]
        tensors[name] = raw.view(dtype).view(meta["shape"])
    return tensors


def converted_dir(model_dir: Path, dtype: torch.dtype, cache_dir: Path) -> Path:
    """The model's safetensors files with floating tensors cast to dtype, written once per node.

    Lets every rank map bf16 weights when the model ships fp32 (instead of a private bf16 copy per
    rank). Keyed by the source files' path, size and mtime; one shard at a time bounds memory.
    """
    from safetensors.torch import save_file

    from cpudist.model import file_lock

    files = sorted(Path(model_dir).glob("*.safetensors"))
    digest = hashlib.sha256(str(Path(model_dir).resolve()).encode())
    for file in files:
        digest.update(f"{file.name}:{file.stat().st_size}:{file.stat().st_mtime_ns}".encode())
    name = str(dtype).removeprefix("torch.")
    target = Path(cache_dir) / "converted" / f"{Path(model_dir).name}-{digest.hexdigest()[:12]}-{name}"
    with file_lock(target.with_name(f".{target.name}.lock")):
        if not (target / "done").exists():
            log.info("converting %s frozen weights to %s once into %s", model_dir, name, target)
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            for file in files:
                tensors = {key: tensor.to(dtype) if tensor.is_floating_point() else tensor.clone()
                           for key, tensor in mapped_tensors(file).items()}
                tmp = target / f".{file.name}.tmp"
                save_file(tensors, str(tmp), metadata={"format": "pt"})
                os.replace(tmp, target / file.name)
                del tensors
            (target / "done").write_text("")
    return target


def share_frozen_weights(model: nn.Module, model_dir: Path, cache_dir: Path | None = None
                         ) -> tuple[int, Path]:
    """Point frozen parameters at a read-only mapping of the weight files; returns (count, dir).

    When frozen parameters are in another floating dtype than the files (e.g. bf16 compute from an
    fp32 model) and cache_dir is given, a converted copy is written once under cache_dir and mapped
    instead; without cache_dir such parameters keep their private copy.
    """
    params = {name: param for name, param in model.named_parameters() if not param.requires_grad}
    source = Path(model_dir)
    files = sorted(source.glob("*.safetensors"))
    if cache_dir is not None and files:
        wanted = {p.dtype for p in params.values() if p.is_floating_point()}
        header, _ = read_header(files[0])
        on_file = {SAFETENSORS_DTYPES.get(meta["dtype"]) for meta in header.values()}
        if len(wanted) == 1 and not wanted <= on_file:
            source = converted_dir(source, wanted.pop(), cache_dir)
            files = sorted(source.glob("*.safetensors"))
    count = 0
    for file in files:
        for name, tensor in mapped_tensors(file).items():
            param = params.get(name)
            if param is None or param.dtype != tensor.dtype or param.shape != tensor.shape:
                continue
            param.data = tensor
            count += 1
    return count, source
