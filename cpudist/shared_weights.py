"""Frozen base weights mapped read-only from the model's safetensors files.

Every rank of a node maps the same file copy-on-write (MAP_PRIVATE), so the pages live once in the
page cache instead of once per rank. Frozen weights are never written, so no page is ever copied.
Written by hand because safetensors' own loaders copy each tensor into private memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

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


def share_frozen_weights(model: nn.Module, model_dir: Path) -> int:
    """Point frozen parameters whose dtype and shape match the file at the mapping; returns count.

    Parameters in another dtype than the file (e.g. bf16 compute from an fp32 file) keep their
    private copy.
    """
    params = {name: param for name, param in model.named_parameters() if not param.requires_grad}
    count = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, tensor in mapped_tensors(file).items():
            param = params.get(name)
            if param is None or param.dtype != tensor.dtype or param.shape != tensor.shape:
                continue
            param.data = tensor
            count += 1
    return count
