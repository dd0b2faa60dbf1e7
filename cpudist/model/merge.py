"""`cpudist merge`: the adapter folded into its base, written as a plain Hugging Face model directory
that AutoModelForCausalLM loads without peft.

From a run on a quantized base (model.quantize), the adapter is folded into the dequantized base
weights, the ones it was trained against (not the original full-precision ones): the merged model
computes what training computed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cpudist.config import ModelConfig
from cpudist.errors import UserError
from cpudist.files import remove, replacing
from cpudist.model.load import load_for_inference, model_path_of_flag
from cpudist.runtime.precision import Precision

# Merged in fp32 so the folded-in update is not rounded twice; cast at the end if asked.
MERGE_PRECISION = Precision("float32", "merge computes in float32")


def merge(base: ModelConfig, adapter_dir: Path, out: str | Path, dtype: str = "float32",
          force: bool = False) -> Path:
    """Fold the adapter into its base (base.path; a quantized run's base as base.quantize,
    base.quantize_group and base.dtype say); writes a plain Hugging Face model directory."""
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not force:
        raise UserError(f"--out {out} already exists and is not empty; choose a new directory "
                        "or pass --force to replace it")
    if base.quantize != "none":
        model, tokenizer = _dequantized_base(base, adapter_dir)
    else:
        plain = ModelConfig(path=base.path, trust_remote_code=base.trust_remote_code,
                            cache_dir=base.cache_dir)
        model, tokenizer = load_for_inference(plain, model_path_of_flag(plain, "--base"),
                                              adapter_dir, MERGE_PRECISION)
    merged = model.merge_and_unload()
    if dtype == "bfloat16":
        merged = merged.to(torch.bfloat16)
    merged.config.use_cache = True  # training turned it off; generation wants it
    if target.exists() and not target.is_dir():
        remove(target)  # --force over a file: the directory takes its place
    try:
        with replacing(target) as tmp:
            merged.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    except OSError as exc:
        raise UserError(f"--out {out}: could not write the merged model ({exc.strerror}); choose a "
                        "writable directory with enough space") from exc
    return target


def write_dequantized_base(base: ModelConfig, out: Path) -> Path:
    """The base a quantized run trained against (its linears dequantized to fp32), alone, as a
    plain model directory: what a LoRA adapter of that run applies on top of."""
    model, tokenizer = _dequantized_base(base, None)
    with replacing(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


def _dequantized_base(base: ModelConfig, adapter_dir: Path | None) -> tuple[Any, Any]:
    """The quantized base the adapter was trained on (the node's cache, as training mapped it),
    its linears dequantized to fp32, with the adapter applied (when one is given)."""
    from cpudist.model.adapters import load_adapter
    from cpudist.model.quantize import dequantize_linears
    from cpudist.runtime.precision import choose_precision

    model, tokenizer = load_for_inference(base, model_path_of_flag(base, "--base"), None,
                                          choose_precision(base.dtype))
    dequantize_linears(model, torch.float32)
    model = model.float()  # embeddings, head and norms too: the merge is computed in fp32
    if adapter_dir is None:
        return model, tokenizer
    return load_adapter(model, adapter_dir, base_name=base.path), tokenizer
