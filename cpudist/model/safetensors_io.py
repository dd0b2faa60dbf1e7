"""Safetensors files read as mappings and written one tensor at a time.

Written by hand, following the format's spec (8-byte little-endian header length, a JSON table of
dtype / shape / data_offsets, then the data), because the safetensors library's loaders copy
every tensor into private memory and its save_file wants every tensor in memory at once: a 7B
model is 15 GB either way. Here a file is mapped copy-on-write (the pages of a frozen weight live
once per node, shared by its ranks) and written from a function that makes each tensor when its
turn comes, so the memory of a conversion is one tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from cpudist.errors import UserError

SAFETENSORS_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
INDEX = "model.safetensors.index.json"
PROGRESS_EVERY_S = 10.0  # a conversion of more than this long logs how far it is


class ByteProgress:
    """A conversion's megabytes done, with a rate and an ETA, in a log line at most every
    PROGRESS_EVERY_S (a 7B model converts for minutes; a small one logs its last line only)."""

    def __init__(self, what: str, total_bytes: int) -> None:
        from cpudist.report.console import RowProgress

        self.done = 0
        self.progress = RowProgress(what, total_bytes >> 20, PROGRESS_EVERY_S, unit="MB")

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        self.progress.update(self.done >> 20)

    def finish(self) -> None:
        self.progress.finish(self.done >> 20)


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in SAFETENSORS_DTYPES.items() if value == dtype)


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """(tensor table, byte offset where the data section starts); a damaged or cut file is a
    UserError naming it."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if length <= 0 or 8 + length > size:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{file}: not a readable safetensors file ({exc}); copy the model "
                        "directory again") from None
    header.pop("__metadata__", None)
    data_start = 8 + length
    end = max((meta["data_offsets"][1] for meta in header.values()), default=0)
    if data_start + end > size:
        raise UserError(f"{file}: truncated ({size} bytes, its header describes "
                        f"{data_start + end}); copy the model directory again")
    return header, data_start


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory (the index's shards when there is an index)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise UserError(f"{index}: not a safetensors index ({exc})") from None
        missing = [name for name in shards if not (model_dir / name).is_file()]
        if missing:
            raise UserError(f"{index} names shards that are not there: {', '.join(missing[:3])}; "
                            "copy the whole model directory")
        return [model_dir / name for name in shards]
    return sorted(model_dir.glob("*.safetensors"))


def files_fingerprint(files: Iterable[Path], *extra: object) -> str:
    """A key for files that does not read their data: path, size, mtime and header of each."""
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        digest.update(json.dumps(read_header(file)[0], sort_keys=True).encode())
    digest.update(json.dumps([str(e) for e in extra]).encode())
    return digest.hexdigest()[:12]


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


def read_tensor(file: Path, meta: dict, data_start: int) -> torch.Tensor:
    """One tensor read with plain reads (not mapped: its pages never count in this process's RSS
    beyond the copy returned)."""
    start, end = meta["data_offsets"]
    raw = torch.empty(end - start, dtype=torch.uint8)
    with open(file, "rb") as handle:
        handle.seek(data_start + start)
        handle.readinto(memoryview(raw.numpy()))
    return raw.view(SAFETENSORS_DTYPES[meta["dtype"]]).view(meta["shape"])


@dataclass(frozen=True)
class Spec:
    """What a tensor of a file to write will be."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def write_file(target: Path, specs: dict[str, Spec], make: Callable[[str], torch.Tensor],
               metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of the tensors in specs, in that order, each made by make(name) just
    before it is written (it must have the spec's dtype and shape)."""
    layout: dict[str, dict] = {}
    offset = 0
    for name, spec in specs.items():
        layout[name] = {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                        "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    encoded = json.dumps({"__metadata__": {"format": "pt", **(metadata or {})}, **layout}).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned, as safetensors writes
    with open(target, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for name, spec in specs.items():
            tensor = make(name)
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{name}: made {tensor.dtype} {tuple(tensor.shape)}, expected "
                                 f"{spec.dtype} {spec.shape}")
            out.write(memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy()))
        out.flush()
        os.fsync(out.fileno())


def write_index(directory: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    """model.safetensors.index.json: which shard holds each tensor (as from_pretrained reads it)."""
    (directory / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=1))
