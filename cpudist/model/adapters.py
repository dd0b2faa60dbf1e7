"""Adapters through peft: the methods cpudist trains (a registry), and adapter directories on disk.

To add a PEFT method, write a function that turns the `lora` config section into a peft config and
register it in ADAPTER_METHODS; `method_of` says which one a config asks for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from cpudist.config import LoraConfig
from cpudist.errors import UserError

log = logging.getLogger("cpudist")


def _lora(config: LoraConfig, target_modules: str | list[str]) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                          target_modules=target_modules, task_type="CAUSAL_LM")


# Method name -> function building its peft config from the `lora` section and the target modules.
ADAPTER_METHODS: dict[str, Callable[[LoraConfig, str | list[str]], Any]] = {"lora": _lora}


def method_of(config: LoraConfig) -> str:
    """The adapter method a config asks for (a key of ADAPTER_METHODS)."""
    return "lora"


def linear_module_names(model: nn.Module) -> list[str]:
    """Distinct leaf names of nn.Linear modules (what target_modules can name)."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, nn.Linear)}
    return sorted(names)


def apply_adapter(model: nn.Module, config: LoraConfig) -> nn.Module:
    """The frozen base wrapped with a fresh, trainable adapter (fp32 weights)."""
    from peft import get_peft_model

    if isinstance(config.target_modules, list):
        available = linear_module_names(model)
        missing = [name for name in config.target_modules if name not in available]
        if missing:
            raise UserError(
                f"lora.target_modules: {', '.join(missing)} not in this model; its Linear modules "
                f"are: {', '.join(available)} (or use 'all-linear')"
            )
    peft_config = ADAPTER_METHODS[method_of(config)](config, config.target_modules)
    peft_model = get_peft_model(model, peft_config)
    # Adapter weights and their optimizer state stay fp32 even when the frozen base is bf16.
    for param in peft_model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return peft_model


def enable_activation_checkpointing(model: nn.Module) -> None:
    # Non-reentrant: works with frozen inputs and DDP without enable_input_require_grads.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5 name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


# --------------------------------------------------------------------------- saved adapters


def resolve_adapter(path: str) -> Path:
    """A PEFT adapter directory; OUTPUT/ and OUTPUT/checkpoints/step-N/ point at their adapter/."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"--adapter {path}: directory not found; pass OUTPUT/adapter of a "
                        "cpudist train run (or one of its checkpoints/step-N)")
    for candidate in (folder, folder / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            # peft would fall back to unpickling adapter_model.bin; only safetensors is read here.
            if not (candidate / "adapter_model.safetensors").is_file():
                raise UserError(f"--adapter {candidate}: no adapter_model.safetensors in it (pickled "
                                "adapter_model.bin files are not loaded); re-save the adapter with "
                                "save_pretrained(DIR, safe_serialization=True)")
            return candidate
    raise UserError(f"--adapter {path}: no adapter_config.json in it (nor in {folder / 'adapter'}); "
                    "pass OUTPUT/adapter of a cpudist train run")


def load_adapter(model: nn.Module, adapter_dir: Path, base_name: str) -> nn.Module:
    """The base with a saved adapter applied (peft), or a one-line error when they do not fit."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, adapter_dir)
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--adapter {adapter_dir} does not fit the base model {base_name} ({first}); "
                        "pass the --base the adapter was trained on") from exc


def save_adapter(model: nn.Module, target: Path) -> None:
    """The adapter alone (PEFT format: adapter_config.json + adapter_model.safetensors)."""
    model.save_pretrained(target, safe_serialization=True)
