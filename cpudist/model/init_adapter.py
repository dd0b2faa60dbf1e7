"""model.init_adapter: training that starts from a saved adapter instead of a fresh one.

The usual pipeline is SFT, then DPO on top of the SFT adapter. The run builds its adapter from the
lora section as always (so every method, the fast path and the checkpoints work unchanged) and then
copies the saved adapter's weights into it; the lora section must describe the saved adapter, which
is checked here against its adapter_config.json. The base is checked as every --adapter is
(cpudist.model.provenance.check_base).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

from cpudist.config import LoraConfig
from cpudist.errors import UserError

log = logging.getLogger("cpudist")


def resolve_init_adapter(path: str) -> Path:
    """The adapter directory model.init_adapter names (OUTPUT/ and checkpoints point at adapter/)."""
    from cpudist.model.adapters import resolve_adapter

    try:
        return resolve_adapter(path)
    except UserError as exc:
        raise UserError(str(exc).replace("--adapter", "model.init_adapter")) from None


def _check_settings(adapter_dir: Path, lora: LoraConfig) -> None:
    """The lora section must be the saved adapter's: r, alpha and the scaling rule decide what its
    weights mean."""
    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    wanted = {"r": lora.r, "lora_alpha": lora.alpha, "use_rslora": lora.use_rslora,
              "use_dora": lora.use_dora}
    names = {"r": "lora.r", "lora_alpha": "lora.alpha", "use_rslora": "lora.use_rslora",
             "use_dora": "lora.use_dora"}
    differ = [f"{names[key]}={saved.get(key)!r} (the run has {value!r})"
              for key, value in wanted.items() if saved.get(key, value) != value]
    if differ:
        raise UserError(f"model.init_adapter={adapter_dir}: the adapter was trained with "
                        f"{', '.join(differ)}; set the lora section as the adapter has it")


def init_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The saved adapter's weights (PEFT's names, without the adapter name)."""
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


def apply_init_adapter(model: nn.Module, adapter_dir: Path, lora: LoraConfig, model_dir: Path
                       ) -> None:
    """Copy the saved adapter's weights into the model's fresh adapter (same names and shapes),
    after checking its base and settings."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from cpudist.model.provenance import check_base

    try:
        check_base(adapter_dir, model_dir)
    except UserError as exc:
        raise UserError(str(exc).replace("--adapter", "model.init_adapter")
                        .replace("--base", "model.path")) from None
    _check_settings(adapter_dir, lora)
    saved = init_tensors(adapter_dir)
    own = get_peft_model_state_dict(model)
    missing = sorted(set(own) - set(saved))
    wrong = [name for name in own if name in saved and saved[name].shape != own[name].shape]
    if missing or wrong:
        first = (missing or wrong)[0]
        raise UserError(f"model.init_adapter={adapter_dir} does not fit this run's adapter "
                        f"({len(missing)} weights missing, {len(wrong)} of another shape, e.g. "
                        f"{first}); set lora.target_modules as the adapter was trained")
    set_peft_model_state_dict(model, {name: saved[name] for name in own})
    log.info("adapter: starts from %s (%d tensors)", adapter_dir, len(own))


def adapter_digest(adapter_dir: Path) -> str:
    """A digest of a saved adapter's weights and settings (what a cached reference depends on)."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(adapter_dir / name, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]
