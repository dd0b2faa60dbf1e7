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
from typing import Any

import torch
from torch import nn

from cpudist.files import file_lock, replacing

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


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in SAFETENSORS_DTYPES.items() if value == dtype)


def _convert_file(source: Path, target: Path, dtype: torch.dtype) -> None:
    """Write source's tensors, floating ones cast to dtype, as a safetensors file, one tensor at a
    time. Written by hand because safetensors' save_file wants every tensor in memory at once (a
    private copy of the whole model); the source is read with plain reads, not mapped, so its pages
    never count in this process's RSS either."""
    header, data_start = read_header(source)
    layout: dict[str, dict] = {}
    offset = 0
    for name, meta in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        stored = SAFETENSORS_DTYPES[meta["dtype"]]
        out_dtype = dtype if stored.is_floating_point else stored
        size = torch.Size(meta["shape"]).numel() * torch.empty((), dtype=out_dtype).element_size()
        layout[name] = {"dtype": _torch_dtype_name(out_dtype), "shape": meta["shape"],
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps({"__metadata__": {"format": "pt"}, **layout}).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned, as safetensors writes
    with open(source, "rb") as src, open(target, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for name in layout:
            meta = header[name]
            start, end = meta["data_offsets"]
            raw = torch.empty(end - start, dtype=torch.uint8)
            src.seek(data_start + start)
            src.readinto(memoryview(raw.numpy()))
            tensor = raw.view(SAFETENSORS_DTYPES[meta["dtype"]])
            if tensor.is_floating_point():
                tensor = tensor.to(dtype)
            out.write(memoryview(tensor.contiguous().view(torch.uint8).numpy()))
        out.flush()
        os.fsync(out.fileno())


def converted_dir(model_dir: Path, dtype: torch.dtype, cache_dir: Path) -> Path:
    """The model's safetensors files with floating tensors cast to dtype, written once per node.

    Lets every rank map bf16 weights when the model ships fp32 (instead of a private bf16 copy per
    rank). Keyed by the source files' path, size and mtime; one tensor at a time bounds memory.
    """
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
                with replacing(target / file.name) as tmp:
                    _convert_file(file, tmp, dtype)
            (target / "done").write_text("")
    return target


def mapped_source(model_dir: Path, dtype: torch.dtype, cache_dir: Path) -> Path:
    """A directory whose safetensors files hold every floating tensor in dtype: the model's own,
    or a copy converted once under cache_dir."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    on_file = {SAFETENSORS_DTYPES.get(meta["dtype"]) for file in files
               for meta in read_header(file)[0].values()}
    if {d for d in on_file if d is not None and d.is_floating_point} <= {dtype}:
        return Path(model_dir)
    return converted_dir(Path(model_dir), dtype, cache_dir)


def build_mapped(model_dir: Path, hf_config: Any, dtype: torch.dtype, cache_dir: Path,
                 **from_config: Any) -> tuple[nn.Module, Path] | None:
    """The model built without weights, then every parameter pointed at the mapped files.

    from_pretrained would first fill a private copy of all weights while it maps the files (with an
    fp32 file and bf16 compute: 2 GB of file pages + 1 GB private for Qwen2.5-0.5B, the run's peak
    RSS); here the only memory is the mapping, touched as layers run. Returns None when the files'
    tensor names do not cover the model exactly (renamed or fused checkpoints, quantized models):
    the caller then loads normally.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files or getattr(hf_config, "quantization_config", None) is not None:
        return None
    source = mapped_source(model_dir, dtype, cache_dir)
    # Parameters on the meta device (no memory); buffers such as rotary inv_freq are computed as usual.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **from_config)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(mapped_tensors(file))
    result = model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()  # tied heads point at the newly assigned embedding
    left = [name for name, param in model.named_parameters() if param.is_meta]
    if result.unexpected_keys or left:
        log.debug("weights not mappable as is (unexpected %s, missing %s): normal load",
                  result.unexpected_keys[:3], left[:3])
        return None
    return model, source


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
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in mapped_tensors(file).items():
            param = params.get(name)
            if param is None or param.dtype != tensor.dtype or param.shape != tensor.shape:
                continue
            param.data = tensor
            count += 1
    return count, source
