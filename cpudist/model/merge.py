"""`cpudist merge`: the adapter folded into its base, written as a plain Hugging Face model directory
that AutoModelForCausalLM loads without peft."""

from __future__ import annotations

from pathlib import Path

import torch

from cpudist.config import ModelConfig
from cpudist.errors import UserError
from cpudist.files import remove, replacing
from cpudist.model.adapters import resolve_adapter
from cpudist.model.load import load_for_inference
from cpudist.runtime.precision import Precision

# Merged in fp32 so the folded-in update is not rounded twice; cast at the end if asked.
MERGE_PRECISION = Precision("float32", "merge computes in float32")


def merge(base: str, adapter: str, out: str, dtype: str = "float32", force: bool = False,
          trust_remote_code: bool = False) -> Path:
    """Fold the adapter into the base weights; writes a plain Hugging Face model directory."""
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not force:
        raise UserError(f"--out {out} already exists and is not empty; choose a new directory "
                        "or pass --force to replace it")
    adapter_dir = resolve_adapter(adapter)
    config = ModelConfig(path=base, trust_remote_code=trust_remote_code)
    model, tokenizer, _ = load_for_inference(config, adapter_dir, MERGE_PRECISION)
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
