"""Any GGUF file of a supported architecture (Llama, SmolLM2, Mistral, Qwen2/3, Gemma 2/3,
Phi-3) as a base: `model.path=X.gguf` is converted once into the model cache as a plain Hugging
Face directory of bf16 safetensors.

The conversion streams: the GGUF file is mapped (gguf.GGUFReader), and each tensor is dequantized
(a slice of rows at a time), un-permuted and written on its own, so a 9B GGUF converts in the
memory of one bf16 tensor, not of the model in fp32 (transformers' own GGUF loader builds the
whole model in fp32 first). Config and tokenizer come from transformers' GGUF readers, which read
metadata only; what those leave at their defaults for Gemma 2/3 and Phi-3 is read from the file.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cpudist.errors import UserError
from cpudist.files import file_lock, replacing
from cpudist.model.gguf_arch import (
    ARCHITECTURES,
    Architecture,
    gemma_query_scalar,
    head_dim,
    llama3_rope_parameters,
)
from cpudist.model.safetensors_io import ByteProgress, Spec, write_file, write_index

log = logging.getLogger(__name__)

SHARD_BYTES = 2 << 30


def _key(fields: dict[str, Any], arch_name: str, key: str, default: Any = None) -> Any:
    """The value of a key of this architecture (gguf.Keys' "{arch}." form), or default."""
    field = fields.get(key.format(arch=arch_name))
    return field.contents() if field is not None else default


@dataclass(frozen=True)
class _GemmaDefaults:
    """What llama.cpp assumes where a Gemma 2/3 file leaves a key out (models/gemma2.cpp,
    gemma3.cpp, llama-hparams.h); llama.cpp's own converter writes none of the layer kinds."""

    window: int  # 0: no sliding layers
    full_every: int  # every n-th layer attends to the whole context
    attn_softcap: float | None
    final_softcap: float | None
    sliding_rope_base: float | None  # None: the full layers' base


_GEMMA_DEFAULTS = {"gemma2": _GemmaDefaults(4096, 2, 50.0, 30.0, None),
                   "gemma3": _GemmaDefaults(0, 6, None, None, 10000.0)}


def _gemma_attention(config: Any, fields: dict[str, Any], arch_name: str, file: Path) -> None:
    """Soft-capping, which layers slide and how far, their rope bases and the query scale, from a
    Gemma 2/3 file's keys (the inverse of what gguf_export writes for them); transformers' GGUF
    reader leaves them at its own defaults, and the model would compute other logits."""
    import gguf

    read = functools.partial(_key, fields, arch_name)
    defaults = _GEMMA_DEFAULTS[arch_name]
    n_layer = config.num_hidden_layers
    window = int(read(gguf.Keys.Attention.SLIDING_WINDOW, defaults.window))
    pattern = read(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN, defaults.full_every)
    if isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern]
    else:  # llama_hparams::set_swa_pattern
        sliding = [pattern == 0 or layer % pattern < pattern - 1 for layer in range(n_layer)]
    if window:
        config.sliding_window = window
    else:  # transformers still wants a window (its mask builder), which no layer then uses
        sliding = [False] * n_layer
    config.layer_types = ["sliding_attention" if flag else "full_attention" for flag in sliding]
    if arch_name == "gemma2":
        config.attn_logit_softcapping = float(read(gguf.Keys.LLM.ATTN_LOGIT_SOFTCAPPING,
                                                   defaults.attn_softcap))
    config.final_logit_softcapping = read(gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING,
                                          defaults.final_softcap) or None
    config.query_pre_attn_scalar = gemma_query_scalar(arch_name, config.to_dict())

    full_base = float(read(gguf.Keys.Rope.FREQ_BASE, 10000.0))
    sliding_base = float(read(gguf.Keys.Rope.FREQ_BASE_SWA, defaults.sliding_rope_base or full_base))
    full = {"rope_type": "default", "rope_theta": full_base}
    if str(read(gguf.Keys.Rope.SCALING_TYPE, "none")) == "linear":
        full = {**full, "rope_type": "linear", "factor": float(read(gguf.Keys.Rope.SCALING_FACTOR))}
    if arch_name == "gemma3":
        config.rope_parameters = {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": sliding_base}}
    elif sliding_base != full_base or full["rope_type"] != "default":
        # transformers' Gemma 2 has one rope for both kinds of layer, unscaled.
        raise UserError(f"model.path={file}: a Gemma 2 with rope scaling or a separate sliding rope "
                        "base has no transformers equivalent; use its Hugging Face directory")
    else:
        config.rope_parameters = full


def _phi3_rope(config: Any, fields: dict[str, Any], by_gguf: dict[str, Any]) -> None:
    """Phi-3's rotated share of each head, original context, sliding window and LongRoPE factors
    (tensors in the file), which transformers' GGUF reader leaves at its defaults (the inverse of
    what gguf_export writes for Phi-3)."""
    import gguf

    read = functools.partial(_key, fields, "phi3")
    head_width = config.hidden_size // config.num_attention_heads
    fraction = int(read(gguf.Keys.Rope.DIMENSION_COUNT, head_width)) / head_width
    original = int(read(gguf.Keys.Rope.SCALING_ORIG_CTX_LEN, config.max_position_embeddings))
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(read(gguf.Keys.Rope.FREQ_BASE, 10000.0)),
                            "partial_rotary_factor": fraction}
    long_name, short_name = (gguf.TENSOR_NAMES[tensor] + ".weight" for tensor in
                             (gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT))
    if long_name in by_gguf:
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    **{key: np.array(by_gguf[name].data, dtype=np.float32).flatten().tolist()
                       for key, name in (("long_factor", long_name), ("short_factor", short_name))})
        if (factor := read(gguf.Keys.Rope.SCALING_ATTN_FACTOR)) is not None:
            rope["attention_factor"] = float(factor)
    config.rope_parameters = rope
    config.partial_rotary_factor = fraction
    config.original_max_position_embeddings = original
    # llama.cpp's converter writes the model's window, its graph drops it; transformers applies it.
    config.sliding_window = int(read(gguf.Keys.Attention.SLIDING_WINDOW, 0)) or None


# Elements dequantized per step: gguf's dequantize makes several fp32 temporaries the size of its
# input, which for a whole 256k-row embedding (Gemma) would take gigabytes at once.
_DEQUANTIZE_ELEMENTS = 1 << 24


def _dequantized(tensor: Any, shift: float = 0.0) -> torch.Tensor:
    """A GGUF tensor in bf16 (in the file's numpy layout), dequantized a slice of rows at a time,
    plus shift (added in fp32)."""
    import gguf

    data = tensor.data
    rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
    # tensor.shape is GGML's, innermost first: its first entry is the row length once dequantized.
    out = torch.empty((rows.shape[0], int(tensor.shape[0])), dtype=torch.bfloat16)
    step = max(1, _DEQUANTIZE_ELEMENTS // out.shape[1])
    for start in range(0, rows.shape[0], step):
        # A copy: the reader maps the file read-only, and F32/F16 tensors come back as views of it.
        part = np.array(gguf.quants.dequantize(rows[start:start + step], tensor.tensor_type),
                        dtype=np.float32)
        out[start:start + part.shape[0]] = torch.from_numpy(part) + shift
    return out


def _reader(file: Path) -> Any:
    import gguf

    try:
        with open(file, "rb") as handle:
            magic = handle.read(4)
        if magic != b"GGUF":
            raise ValueError(f"starts with {magic!r}, not the GGUF magic")
        return gguf.GGUFReader(file)
    except (OSError, ValueError, IndexError, KeyError) as exc:
        raise UserError(f"model.path={file}: not a readable GGUF file ({str(exc)[:160]}); it may be "
                        "truncated or not GGUF: copy or download it again") from None


def gguf_cache_dir(file: Path, cache_dir: Path) -> Path:
    """Where a GGUF file converts to: keyed by its name, size and modification time."""
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir / "gguf" / f"{file.stem}-{key}"


def convert_gguf(file: Path, cache_dir: Path) -> Path:
    """The GGUF file as a Hugging Face model directory in the cache (converted once per node)."""
    target = gguf_cache_dir(file, cache_dir)
    with file_lock(target.parent / f".{target.name}.lock"):
        if not (target / "config.json").exists():
            _convert(file, target)
    return target


def gguf_config(file: Path) -> Any:
    """The Hugging Face config a GGUF file converts to, from its metadata alone (what `cpudist
    plan` needs before any conversion)."""
    reader = _reader(file)
    return _converted_config(reader, {t.name: t for t in reader.tensors}, file)[0]


def _converted_config(reader: Any, by_gguf: dict[str, Any], file: Path) -> tuple[Any, Architecture]:
    """The file's Hugging Face config and architecture: transformers' GGUF reader, then what it
    leaves out or at its defaults, read from the file (by_gguf: its tensors by name)."""
    from transformers import AutoConfig

    arch_field = reader.fields.get("general.architecture")
    arch_name = arch_field.contents() if arch_field is not None else "(none)"
    importable = [a for a in ARCHITECTURES.values() if a.importable]
    arch = next((a for a in importable if a.gguf_name == arch_name), None)
    if arch is None:
        raise UserError(f"model.path={file}: GGUF architecture {arch_name!r} is not supported as a "
                        f"base; supported: {', '.join(dict.fromkeys(a.gguf_name for a in importable))}. "
                        "Use the model's Hugging Face directory instead")
    try:
        config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"model.path={file}: transformers cannot read its metadata "
                        f"({str(exc).splitlines()[0][:160]})") from None
    config.tie_word_embeddings = "output.weight" not in by_gguf
    # transformers' GGUF reader leaves head_dim at hidden_size / heads for some architectures
    # (Qwen3); the file states it where it differs.
    if (key_length := reader.fields.get(f"{arch_name}.attention.key_length")) is not None:
        config.head_dim = int(key_length.contents())
    if "rope_freqs.weight" in by_gguf:
        factors = torch.from_numpy(np.array(by_gguf["rope_freqs.weight"].data, dtype=np.float32))
        rope = dict(config.rope_parameters or {})
        config.rope_parameters = {**rope, **llama3_rope_parameters(
            factors.flatten(), float(rope.get("rope_theta", 10000.0)), head_dim(config.to_dict()), file)}
    if arch_name in _GEMMA_DEFAULTS:
        _gemma_attention(config, reader.fields, arch_name, file)
    elif arch_name == "phi3":
        _phi3_rope(config, reader.fields, by_gguf)
    # Gemma 3 files keep only the rows of real tokens (llama.cpp's converter drops the padding).
    config.vocab_size = int(by_gguf["token_embd.weight"].shape[-1])
    config.architectures = [arch.hf_name]
    for key in ("quantization_config", "_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.dtype = torch.bfloat16
    return config, arch


def _convert(file: Path, target: Path) -> None:
    from transformers import AutoTokenizer

    reader = _reader(file)
    by_gguf = {t.name: t for t in reader.tensors}
    config, arch = _converted_config(reader, by_gguf, file)
    log.info("converting %s into %s (one time, tensor by tensor to bf16)", file, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"model.path={file}: transformers cannot read its tokenizer "
                        f"({str(exc).splitlines()[0][:160]})") from None
    sources = _sources(config, arch, by_gguf, file)
    n_head, n_head_kv = config.num_attention_heads, config.num_key_value_heads

    def make(hf_name: str) -> torch.Tensor:
        tensor, shape = sources[hf_name]
        # llama.cpp's Gemma norms scale by weight, transformers' by 1 + weight.
        shift = -1.0 if arch.norms_plus_one and hf_name.endswith("norm.weight") else 0.0
        return arch.hf_rows(hf_name, _dequantized(tensor, shift).reshape(shape), n_head, n_head_kv)

    specs = {name: Spec(torch.bfloat16, shape) for name, (_, shape) in sources.items()}
    progress = ByteProgress(f"converting {file.name}", sum(spec.nbytes for spec in specs.values()))

    def made(hf_name: str) -> torch.Tensor:
        tensor = make(hf_name)
        progress.add(specs[hf_name].nbytes)
        return tensor

    with replacing(target) as tmp:
        tmp.mkdir(parents=True)
        _write_shards(tmp, specs, made)
        progress.finish()
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def _sources(config: Any, arch: Architecture, by_gguf: dict[str, Any],
             file: Path) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """Each weight of the model this config makes: the GGUF tensor it is read from and its
    Hugging Face shape (the inverse of the names export writes)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in
                  AutoModelForCausalLM.from_config(config).state_dict().items()}
    tensor_map = arch.tensor_names(config.num_hidden_layers)
    sources = {}
    for hf_name, shape in shapes.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in by_gguf:
            raise UserError(f"model.path={file}: tensor {gguf_name} ({hf_name}) is missing; the file "
                            "is incomplete or not a causal LM of this architecture")
        sources[hf_name] = (by_gguf[gguf_name], shape)
    return sources


def _write_shards(directory: Path, specs: dict[str, Spec],
                  make: Callable[[str], torch.Tensor]) -> None:
    """The weights as safetensors files of up to SHARD_BYTES each (an index beside them when
    there are several), each tensor made by make(name) when its turn comes."""
    shards: list[dict[str, Spec]] = [{}]
    size = 0
    for name, spec in specs.items():
        if shards[-1] and size + spec.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = spec
        size += spec.nbytes
    weight_map = {}
    for index, shard_specs in enumerate(shards):
        shard = (f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                 else "model.safetensors")
        write_file(directory / shard, shard_specs, make)
        weight_map.update(dict.fromkeys(shard_specs, shard))
    if len(shards) > 1:
        write_index(directory, weight_map, sum(spec.nbytes for spec in specs.values()))
