"""Quantized frozen bases (QLoRA on CPU): `model.quantize` = int8 | int4.

The frozen linear weights of the decoder are quantized once per node into a cache of safetensors
files (`quantized_dir`), which every rank maps read-only like any frozen weight: a node holds one
copy. Adapters train in full precision on top (peft's LoRA layer wraps `QuantizedLinear`).

int8: one scale per output row (symmetric, absmax / 127). int4: a scale and a zero (min) per
group of `model.quantize_group` input columns, 16 levels from min to max as llama.cpp's Q4_1
(asymmetric: on SmolLM2 it lost less than symmetric int4 or NF4 at the same group size;
docs/PERFORMANCE.md, "Quality on a quantized base"), two codes per byte: the low nibble holds
column j, the high nibble column j + in/2 of the same row, so unpacking writes two contiguous
halves. Scales and zeros are in the compute dtype.

Why not a library's kernel: at training shapes (hundreds of rows), bitsandbytes' nf4/int8 and
torchao's Int8WeightOnly ran slower than dequantizing into a buffer and calling oneDNN's GEMM, and
torch's own packed int8/int4 kernels are made for decoding one row (docs/PERFORMANCE.md, "7-8B
models and quantized bases"). Here each matmul dequantizes its weight into a scratch buffer the
process reuses (no page faults; one per role in a decoder layer, so a checkpointed layer's
backward takes the weights its recomputed forward left there: two dequantizations per weight and
step, not three) and runs oneDNN's GEMM in the compute dtype, in bf16 and in fp32 (AVX2-only
CPUs) alike. int8's row scales multiply the GEMM's output (and the output gradient), so its
weight is one cast of the codes; int4's large weights unpack in one compiled pass. Neither
library can map a per-node cache file either.

The embeddings stay in the compute dtype, mapped: a lookup touches only its rows' pages. An
untied LM head (`model.quantize_head`, on by default) is stored int8 whatever the decoder's
method (a scale per vocabulary row: the head's error goes straight into every logit, so it gets
the finer method) and is multiplied a block of HEAD_BLOCK_ROWS vocabulary rows at a time
(QuantizedHead.blocks), so no vocabulary-sized dequantized copy exists. A tied head is the
embedding and stays as it is.
"""

from __future__ import annotations

import json
import logging
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cpudist.errors import UserError
from cpudist.files import file_lock, remove, replacing
from cpudist.model.safetensors_io import (
    SAFETENSORS_DTYPES,
    Spec,
    files_fingerprint,
    read_header,
    read_tensor,
    weight_files,
    write_file,
    write_index,
)
from cpudist.runtime.process import run_apart

log = logging.getLogger("cpudist")
MANIFEST = "quantization.json"
FORMAT = 1  # of the cache files: part of their key, so a new layout is never read as an old one


# --------------------------------------------------------------------------- methods

Stored = dict[str, torch.Tensor]  # buffer name -> tensor, as in the cache and on the layer


def _int8_layout(rows: int, cols: int, group: int, dtype: torch.dtype
                 ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {"qweight": ((rows, cols), torch.int8), "scales": ((rows,), dtype)}


def _quantize_int8(weight: torch.Tensor, group: int, dtype: torch.dtype) -> Stored:
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(dtype)
    codes = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"qweight": codes, "scales": scale}


def _dequantize_int8(stored: Stored, out: torch.Tensor) -> None:
    out.copy_(stored["qweight"])
    out.mul_(stored["scales"][:, None])


def _int8_operand(stored: Stored, out: torch.Tensor) -> None:
    # The codes alone (integers up to 127: exact in bf16); the row scales multiply the GEMM's
    # output instead, a pass over tokens x out rather than over the whole weight.
    out.copy_(stored["qweight"])


def _int4_layout(rows: int, cols: int, group: int, dtype: torch.dtype
                 ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    groups = (rows, cols // group)
    return {"qweight": ((rows, cols // 2), torch.uint8), "scales": (groups, dtype),
            "zeros": (groups, dtype)}


def _quantize_int4(weight: torch.Tensor, group: int, dtype: torch.dtype) -> Stored:
    rows, cols = weight.shape
    w = weight.float().reshape(rows, cols // group, group)
    low, high = w.amin(dim=2), w.amax(dim=2)
    # Quantize against the scale and zero as they will be stored (rounded to dtype).
    scale = ((high - low) / 15).clamp(min=1e-12).to(dtype)
    zero = low.to(dtype)
    codes = torch.round((w - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    codes = codes.to(torch.uint8).reshape(rows, cols)
    half = cols // 2
    packed = (codes[:, :half] | (codes[:, half:] << 4)).contiguous()
    return {"qweight": packed, "scales": scale, "zeros": zero}


def _dequantize_int4(stored: Stored, out: torch.Tensor) -> None:
    packed, scales = stored["qweight"], stored["scales"]
    rows, half = packed.shape
    codes = _int4_codes(rows, 2 * half)
    torch.bitwise_and(packed, 15, out=codes[:, :half])
    torch.bitwise_right_shift(packed, 4, out=codes[:, half:])
    out.copy_(codes)
    grouped = out.view(rows, scales.shape[1], -1)
    grouped.mul_(scales[..., None])
    grouped.add_(stored["zeros"][..., None])


def _unpack_int4_halves(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        out: torch.Tensor) -> None:
    """The int4 weight in one pass for Inductor, for weights whose halves hold whole groups: the
    two nibbles come from one broadcast shift (a `stack` of the halves made Inductor write both
    to buffers and `cat` them first: 6x slower on a 7B MLP weight, and slower than eager).
    Computed in fp32 and rounded once, so it can differ from _dequantize_int4's two bf16
    roundings by one unit in the last place."""
    rows, half = packed.shape
    n = scales.shape[1] // 2
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device).view(1, 2, 1, 1)
    codes = (packed.view(rows, 1, n, -1) >> shifts) & 15
    out.view(rows, 2, n, -1).copy_(codes.float() * scales.view(rows, 2, n, 1).float()
                                   + zeros.view(rows, 2, n, 1).float())


# Below this many weights a compiled unpack does not repay its compile (seconds, once per shape).
COMPILED_UNPACK_MIN = 1 << 20


class _CompiledUnpack:
    """torch.compile of _unpack_int4_halves, built on first use; where Inductor cannot build (no
    C++ compiler), the eager unpack serves and the log says why, once."""

    kernel: Callable[..., None] | None = None
    problem: str | None = None

    @classmethod
    def run(cls, stored: Stored, out: torch.Tensor) -> bool:
        if cls.problem is not None:
            return False
        args = (stored["qweight"], stored["scales"], stored["zeros"], out)
        try:
            if cls.kernel is None:
                cls.kernel = torch.compile(_unpack_int4_halves, dynamic=False)
            cls.kernel(*args)
        except Exception as error:  # noqa: BLE001 - Inductor raises its own types for "cannot build"
            cls.problem = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            log.warning("int4 unpack stays eager (slower): torch.compile cannot build here: %s",
                        cls.problem)
            return False
        return True


def _int4_operand(stored: Stored, out: torch.Tensor) -> None:
    rows, half = stored["qweight"].shape
    groups = stored["scales"].shape[1]
    if (rows * half * 2 >= COMPILED_UNPACK_MIN and groups % 2 == 0
            and _CompiledUnpack.run(stored, out)):
        return
    _dequantize_int4(stored, out)


@dataclass(frozen=True)
class Method:
    """How one quantization method stores and restores a frozen linear weight."""

    describe: str
    # (rows, cols, group, scale dtype) -> {buffer name: (shape, dtype)}
    layout: Callable[[int, int, int, torch.dtype], dict[str, tuple[tuple[int, ...], torch.dtype]]]
    # (weight [out, in], group, scale dtype) -> the buffers, as layout says
    quantize: Callable[[torch.Tensor, int, torch.dtype], Stored]
    # (the buffers, out [out, in] in the compute dtype) -> out filled with the weight
    dequantize: Callable[[Stored, torch.Tensor], None]
    grouped: bool  # scales per group of input columns (else per output row)
    # What a matmul reads: (the buffers, out [out, in]) -> out filled with the weight, or with the
    # weight divided by the per-output-row scale held in the buffer `row_scale` (then the GEMM's
    # output, and the output gradient in backward, are multiplied by that scale instead).
    operand: Callable[[Stored, torch.Tensor], None]
    row_scale: str | None = None


# model.quantize value -> its method. Adding one is one entry (and its name in config.py).
METHODS: dict[str, Method] = {
    "int8": Method("int8, symmetric, a scale per output row", _int8_layout, _quantize_int8,
                   _dequantize_int8, grouped=False, operand=_int8_operand, row_scale="scales"),
    "int4": Method("int4, a scale and a zero per group of input columns", _int4_layout,
                   _quantize_int4, _dequantize_int4, grouped=True, operand=_int4_operand),
}


# --------------------------------------------------------------------------- the layer


@dataclass
class _Slot:
    buffer: torch.Tensor
    owner: weakref.ref | None = None  # the layer whose operand the buffer holds
    key: tuple[int, ...] = ()  # that layer's buffers' addresses: new buffers mean a new weight


class _Scratch:
    """The buffers the dequantized weights of a process's matmuls go into, one per slot and dtype
    and never page-faulted again. A slot is a layer's role in a stack of decoder layers
    ("model.layers.*.mlp.down_proj"; replace_linears names it), so at most one decoder layer's
    weights are alive dequantized. With activation checkpointing a layer's recomputed forward and
    its backward run back to back, so the backward finds the recompute's weights still in their
    slots and takes them: two dequantizations per frozen weight and step instead of three. The
    codes are frozen, so a weight left in its slot is still right whenever it is found there."""

    slots: dict[tuple[str, torch.dtype], _Slot] = {}
    codes: torch.Tensor | None = None

    @classmethod
    def slot(cls, name: str, numel: int, dtype: torch.dtype) -> _Slot:
        """The slot `name` for `dtype`, with room for numel values (a new, empty one if the slot
        held less)."""
        slot = cls.slots.get((name, dtype))
        if slot is None or slot.buffer.numel() < numel:
            slot = cls.slots[(name, dtype)] = _Slot(torch.empty(numel, dtype=dtype))
        return slot

    @classmethod
    def operand(cls, layer: QuantizedLinear) -> torch.Tensor:
        rows, cols, dtype = layer.out_features, layer.in_features, layer.compute_dtype
        key = tuple(getattr(layer, name).data_ptr() for name in layer.stored_names)
        slot = cls.slots.get((layer.scratch_slot, dtype))
        if slot is not None and slot.owner is not None and slot.owner() is layer \
                and slot.key == key:
            return slot.buffer[: rows * cols].view(rows, cols)
        slot = cls.slot(layer.scratch_slot, rows * cols, dtype)
        out = slot.buffer[: rows * cols].view(rows, cols)
        slot.owner = None  # not valid while it is being written
        METHODS[layer.method].operand(layer.stored(), out)
        slot.owner, slot.key = weakref.ref(layer), key
        return out


def _int4_codes(rows: int, cols: int) -> torch.Tensor:
    if _Scratch.codes is None or _Scratch.codes.numel() < rows * cols:
        _Scratch.codes = torch.empty(rows * cols, dtype=torch.uint8)
    return _Scratch.codes[: rows * cols].view(rows, cols)


class _DequantizedMatmul(torch.autograd.Function):
    """x @ W^T (+ bias) with W dequantized into its scratch slot, in forward and again in backward
    unless the slot still holds it: only the codes are kept, never a dequantized copy per layer.
    The weight is frozen, so the only gradient is the input's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        weight = _Scratch.operand(layer)
        out = x.to(weight.dtype) @ weight.t()
        scale = layer.row_scale()
        if scale is not None:
            out.mul_(scale)
        if layer.bias is not None:
            out += layer.bias
        ctx.input_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        weight = _Scratch.operand(ctx.layer)
        grad = grad.to(weight.dtype)
        scale = ctx.layer.row_scale()
        if scale is not None:
            grad = grad * scale
        return (grad @ weight).to(ctx.input_dtype), None


class QuantizedLinear(nn.Module):
    """A frozen nn.Linear whose weight is stored quantized (buffers `qweight` and `scales`, mapped
    from the node's cache) and computed in `compute_dtype`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: str, group: int,
                 compute_dtype: torch.dtype, device: torch.device | str = "meta",
                 scratch_slot: str = "") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method, self.group, self.compute_dtype = method, group, compute_dtype
        self.scratch_slot = scratch_slot
        self.stored_names = []
        for name, (shape, dtype) in METHODS[method].layout(out_features, in_features, group,
                                                          compute_dtype).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
            self.stored_names.append(name)
        self.bias: torch.Tensor | None
        if bias:
            self.register_buffer("bias", torch.empty(out_features, dtype=compute_dtype,
                                                     device=device))
        else:
            self.bias = None

    # The names peft reads the shape of a quantized layer by (as for GPTQ's QuantLinear).
    @property
    def infeatures(self) -> int:
        return self.in_features

    @property
    def outfeatures(self) -> int:
        return self.out_features

    def row_scale(self) -> torch.Tensor | None:
        name = METHODS[self.method].row_scale
        return None if name is None else getattr(self, name)

    def stored(self) -> Stored:
        return {name: getattr(self, name) for name in self.stored_names}

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a tensor of its own (for merging an adapter into it)."""
        out = torch.empty(self.out_features, self.in_features, dtype=self.compute_dtype)
        METHODS[self.method].dequantize(self.stored(), out)
        return out.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantizedMatmul.apply(x, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{METHODS[self.method].describe}, group={self.group}, compute={self.compute_dtype}")


# An untied LM head's method, and how many vocabulary rows of it are dequantized at a time: 8192
# rows of Qwen2.5-7B's head are 56 MiB in bf16, and its 512-row GEMMs (logits, then the hidden
# states' gradient) took 1.40-1.42 s a step in such blocks against 1.35-1.45 s for the whole bf16
# weight on Zen 5; smaller blocks ran slower (docs/PERFORMANCE.md, "7-8B models and quantized
# bases").
HEAD_METHOD = "int8"
HEAD_BLOCK_ROWS = 8192


class QuantizedHead(QuantizedLinear):
    """A frozen LM head stored quantized and computed a block of vocabulary rows at a time: the
    chunked loss head (cpudist.model.loss) and forward both go through `blocks`."""

    def blocks(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """(first vocabulary row, the block's operand [rows, in] in the compute dtype, its row
        scale or None) for each block; the operand lives in one scratch buffer, valid until the
        next block is asked for."""
        method, stored = METHODS[self.method], self.stored()
        rows = min(HEAD_BLOCK_ROWS, self.out_features)
        slot = _Scratch.slot("lm_head blocks", rows * self.in_features, self.compute_dtype)
        for start in range(0, self.out_features, rows):
            part = {name: tensor[start : start + rows] for name, tensor in stored.items()}
            count = part["qweight"].shape[0]
            operand = slot.buffer[: count * self.in_features].view(count, self.in_features)
            method.operand(part, operand)
            yield start, operand, None if method.row_scale is None else part[method.row_scale]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BlockedHeadMatmul.apply(x, self)


def head_logits(rows: torch.Tensor, head: QuantizedHead, out: torch.Tensor) -> torch.Tensor:
    """out [n, vocab] = rows [n, in] @ W^T (+ bias), a block of W at a time."""
    for start, operand, scale in head.blocks():
        part = out[:, start : start + operand.shape[0]]
        torch.mm(rows, operand.t(), out=part)
        if scale is not None:
            part.mul_(scale)
    if head.bias is not None:
        out.add_(head.bias)
    return out


def head_input_gradient(logit_grads: torch.Tensor, head: QuantizedHead, out: torch.Tensor
                        ) -> torch.Tensor:
    """out [n, in] = logit_grads [n, vocab] @ W, a block of W at a time, summed in fp32 (one
    rounding per block into a compute-dtype sum would add up over ~20 blocks). Scales
    logit_grads in place by the row scales: the caller's buffer is spent."""
    total = torch.zeros(out.shape, dtype=torch.float32)
    product = torch.empty(out.shape, dtype=head.compute_dtype)
    for start, operand, scale in head.blocks():
        part = logit_grads[:, start : start + operand.shape[0]]
        if scale is not None:
            part.mul_(scale)
        torch.mm(part, operand, out=product)
        total.add_(product)
    return out.copy_(total)


class _BlockedHeadMatmul(torch.autograd.Function):
    """x @ W^T (+ bias) for a QuantizedHead outside the chunked loss (full logits: generation,
    evaluation without chunks); the input's gradient only, the head is frozen."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, head: QuantizedHead) -> torch.Tensor:
        ctx.head, ctx.input_dtype = head, x.dtype
        rows = x.reshape(-1, x.shape[-1]).to(head.compute_dtype)
        out = torch.empty((rows.shape[0], head.out_features), dtype=head.compute_dtype)
        return head_logits(rows, head, out).view(*x.shape[:-1], head.out_features)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        head = ctx.head
        grads = grad.reshape(-1, head.out_features).to(head.compute_dtype, copy=True)
        out = torch.empty((grads.shape[0], head.in_features), dtype=head.compute_dtype)
        head_input_gradient(grads, head, out)
        return out.view(*grad.shape[:-1], head.in_features).to(ctx.input_dtype), None


def quantizable_head_name(model: nn.Module) -> str | None:
    """The LM head's module name when it is a weight of its own (not tied to the embedding)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    config = model.config.get_text_config()
    if head is None or getattr(config, "tie_word_embeddings", False) \
            or head.weight is embedding.weight:
        return None
    return next(name for name, module in model.named_modules() if module is head)


def replace_head(model: nn.Module, name: str, dtype: torch.dtype) -> None:
    """Swap the LM head for a QuantizedHead (HEAD_METHOD) with empty (meta) buffers."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    linear = getattr(parent, child)
    setattr(parent, child, QuantizedHead(linear.in_features, linear.out_features,
                                         linear.bias is not None, HEAD_METHOD, 0, dtype))


def frozen_linear_names(model: nn.Module) -> list[str]:
    """The decoder's nn.Linear modules (every one but the LM head): what gets quantized."""
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head]


def scratch_slot(name: str) -> str:
    """The layer's role in a stack of numbered layers ("model.layers.*.mlp.down_proj"), whose
    dequantized weight gets a scratch buffer of its own; "" (one buffer shared by all) for a
    linear outside such a stack, so the scratch never holds more than one layer's weights."""
    pattern = re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)
    return pattern if pattern != name else ""


def replace_linears(model: nn.Module, names: list[str], method: str, group: int,
                    dtype: torch.dtype) -> None:
    """Swap the named nn.Linear modules for QuantizedLinear ones with empty (meta) buffers."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        setattr(parent, child, QuantizedLinear(
            linear.in_features, linear.out_features, linear.bias is not None, method, group,
            dtype, scratch_slot=scratch_slot(name)))


def dequantize_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Replace every QuantizedLinear by an nn.Linear holding its dequantized weight (for merging
    an adapter into a quantized base); returns how many."""
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, QuantizedLinear)]
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                           dtype=dtype)
        linear.weight.data = module.dequantized(dtype)
        if module.bias is not None:
            linear.bias.data = module.bias.to(dtype)
        linear.requires_grad_(False)
        setattr(parent, child, linear)
    return len(found)


# --------------------------------------------------------------------------- the node's cache


def _check_shapes(names: list[str], shapes: dict[str, tuple[int, int]], method: str,
                  group: int) -> None:
    if not METHODS[method].grouped:
        return
    for name in names:
        _, cols = shapes[name]
        if cols % group or cols % 2:
            raise UserError(f"model.quantize={method}: {name} has {cols} input columns, not a "
                            f"multiple of model.quantize_group={group}; choose a group that "
                            "divides it (32, 64 and 128 fit most models) or use int8")


def quantized_dir(model_dir: Path, linears: list[str], method: str, group: int,
                  dtype: torch.dtype, cache_dir: Path, head: str | None = None) -> Path:
    """The model's weights with the named linears quantized (and the LM head `head`, if named,
    with HEAD_METHOD) and every other floating tensor in dtype, written once per node under
    cache_dir (one tensor at a time) and reused afterwards.

    Keyed by the files' path, size, mtime and safetensors headers (not their 15 GB of data) and by
    the method; nothing is written into the model directory.
    """
    files = weight_files(model_dir)
    if not files:
        raise UserError(f"{model_dir}: model.quantize needs safetensors weights (*.safetensors)")
    key = files_fingerprint(files, method, group, dtype, FORMAT, *([] if head is None else [head]))
    name = f"{Path(model_dir).resolve().name}-{key}-{method}-g{group}-{str(dtype).removeprefix('torch.')}"
    if head is not None:
        name += f"-head{HEAD_METHOD}"
    target = Path(cache_dir).expanduser() / "quantized" / name
    # source tensor -> (its linear, the method it is stored with)
    weights = {f"{linear}.weight": (linear, method) for linear in linears}
    if head is not None:
        weights[f"{head}.weight"] = (head, HEAD_METHOD)
    with file_lock(target.with_name(f".{target.name}.lock")):
        if (target / MANIFEST).exists():
            return target
        log.info("quantizing %s frozen linear weights (%s) once into %s", model_dir,
                 METHODS[method].describe, target)
        # In a child process: the memory the conversion used goes back to the system with it
        # (a preloaded malloc that keeps freed pages would otherwise hold it for the whole run).
        run_apart(_write_quantized, Path(model_dir), files, weights, method, group, dtype, target,
                  head)
    _remove_superseded(target)
    return target


def _remove_superseded(target: Path) -> None:
    """Remove the cache's other copies of the same model directory with the same settings: their
    key no longer matches (its weight files were rewritten, or FORMAT changed), so nothing will
    read them again, and a 7B's copy is 5-8 GB of disk."""
    mine = json.loads((target / MANIFEST).read_text())
    for other in target.parent.iterdir():
        if other == target or not (other / MANIFEST).is_file():
            continue
        try:
            theirs = json.loads((other / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        # A relative source (older manifests) may name another directory from another cwd.
        if not Path(str(theirs.get("source"))).is_absolute():
            continue
        if {k: theirs.get(k) for k in mine} != mine:
            continue
        with file_lock(other.with_name(f".{other.name}.lock")):
            log.info("removing %s: an older quantized copy of %s with the same settings", other,
                     mine["source"])
            (other / MANIFEST).unlink(missing_ok=True)  # first: a part-removed copy is never used
            remove(other)


def _write_quantized(model_dir: Path, files: list[Path], weights: dict[str, tuple[str, str]],
                     method: str, group: int, dtype: torch.dtype, target: Path,
                     head: str | None) -> None:
    headers = {file: read_header(file) for file in files}
    shapes = {weights[n][0]: tuple(meta["shape"]) for _, (header, _) in headers.items()
              for n, meta in header.items() if n in weights}
    missing = sorted({linear for linear, _ in weights.values()} - set(shapes))
    if missing:
        raise UserError(f"{model_dir}: no weight for {missing[0]} in its safetensors files; "
                        "model.quantize needs tensor names that match the model (a plain "
                        "Hugging Face checkpoint)")
    linears = sorted(linear for linear, _ in weights.values() if linear != head)
    _check_shapes(linears, shapes, method, group)
    remove(target)
    target.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for file, (header, data_start) in headers.items():
        specs: dict[str, Spec] = {}
        sources: dict[str, tuple[str, str | None]] = {}  # written -> (source, buffer name)
        for tensor_name, meta in sorted(header.items(),
                                        key=lambda item: item[1]["data_offsets"][0]):
            if tensor_name in weights:
                rows, cols = meta["shape"]
                stem = tensor_name.removesuffix(".weight")
                for buffer, (shape, buffer_dtype) in METHODS[weights[tensor_name][1]].layout(
                        rows, cols, group, dtype).items():
                    specs[f"{stem}.{buffer}"] = Spec(buffer_dtype, shape)
                    sources[f"{stem}.{buffer}"] = (tensor_name, buffer)
            else:
                stored = SAFETENSORS_DTYPES[meta["dtype"]]
                specs[tensor_name] = Spec(dtype if stored.is_floating_point else stored,
                                          tuple(meta["shape"]))
                sources[tensor_name] = (tensor_name, None)
        made: dict[str, Stored] = {}

        def make(written: str, header: dict = header, data_start: int = data_start,
                 file: Path = file, sources: dict = sources, made: dict = made
                 ) -> torch.Tensor:
            source, buffer = sources[written]
            if buffer is None:
                tensor = read_tensor(file, header[source], data_start)
                return tensor.to(dtype) if tensor.is_floating_point() else tensor
            if source not in made:  # its first buffer: quantize the weight now
                made[source] = METHODS[weights[source][1]].quantize(
                    read_tensor(file, header[source], data_start), group, dtype)
            tensor = made[source].pop(buffer)
            if not made[source]:
                del made[source]
            return tensor

        with replacing(target / file.name) as tmp:
            write_file(tmp, specs, make)
        for written, spec in specs.items():
            weight_map[written] = file.name
            total += spec.nbytes
    write_index(target, weight_map, total)
    (target / MANIFEST).write_text(json.dumps(
        {"method": method, "group": group, "dtype": str(dtype), "source": str(model_dir.resolve()),
         "linears": linears,
         "head": None if head is None else {"name": head, "method": HEAD_METHOD}},
        indent=1))
