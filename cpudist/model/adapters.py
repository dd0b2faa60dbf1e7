"""Adapters through peft: the methods cpudist trains (a registry), and adapter directories on disk.

To add a PEFT method, write a function that turns the `lora` config section into a peft config and
register it in ADAPTER_METHODS; `method_of` says which one a config asks for.
"""

from __future__ import annotations

import logging
import re
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
                          target_modules=target_modules, task_type="CAUSAL_LM",
                          use_rslora=config.use_rslora, use_dora=config.use_dora)


# Method name -> function building its peft config from the `lora` section and the target modules.
ADAPTER_METHODS: dict[str, Callable[[LoraConfig, str | list[str]], Any]] = {"lora": _lora}


def method_of(config: LoraConfig) -> str:
    """The adapter method a config asks for (a key of ADAPTER_METHODS)."""
    return "lora"


def _linear_types() -> tuple[type[nn.Module], ...]:
    from cpudist.model.quantize import QuantizedLinear

    return (nn.Linear, QuantizedLinear)


def linear_module_names(model: nn.Module) -> list[str]:
    """Distinct leaf names of linear modules, plain or quantized (what target_modules can name)."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, _linear_types())}
    return sorted(names)


def _quantized(model: nn.Module) -> bool:
    from cpudist.model.quantize import QuantizedLinear

    return any(isinstance(module, QuantizedLinear) for module in model.modules())


def _with_quantized_layers(peft_config: Any) -> Any:
    """Let peft wrap QuantizedLinear with its own LoRA layer: it calls the base layer for the
    frozen output and adds the adapter's, which is all a quantized base needs."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    from cpudist.model.quantize import QuantizedLinear

    peft_config._register_custom_module({QuantizedLinear: LoraLinear})
    return peft_config


def _all_linear_targets(model: nn.Module, quantized: bool) -> str | list[str]:
    """What lora.target_modules=all-linear means: every linear layer of the text model but the LM
    head. peft's own all-linear knows only nn.Linear (and bitsandbytes layers), and in a model with
    a vision tower (Gemma 3 4B and up) it takes the tower's layers too, which text never trains."""
    head, decoder = model.get_output_embeddings(), model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    inside: set[str] = set()
    outside = False
    for name, module in model.named_modules():
        if isinstance(module, _linear_types()) and module is not head:
            if name.startswith(f"{prefix}."):
                inside.add(name.rsplit(".", 1)[-1])
            else:
                outside = True
    if outside:  # a regular expression peft matches against whole module names
        return rf"{re.escape(prefix)}\..*\.({'|'.join(sorted(inside))})"
    return sorted(inside) if quantized else "all-linear"


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
    targets: str | list[str] = config.target_modules
    quantized = _quantized(model)
    if quantized and config.use_dora:
        raise UserError("lora.use_dora=true needs the base weights' norms every step, which a "
                        "quantized base (model.quantize) does not keep; use model.quantize=none or "
                        "plain LoRA (lora.use_dora=false)")
    if targets == "all-linear":
        targets = _all_linear_targets(model, quantized)
    peft_config = ADAPTER_METHODS[method_of(config)](config, targets)
    if quantized:
        _with_quantized_layers(peft_config)
    peft_model = get_peft_model(model, peft_config)
    # Adapter weights and their optimizer state stay fp32 even when the frozen base is bf16.
    for param in peft_model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    if config.fast_path:
        from cpudist.model.fast_lora import install_fast_path

        install_fast_path(peft_model)
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
    from peft import PeftConfig, PeftModel

    try:
        config = PeftConfig.from_pretrained(adapter_dir)
        if _quantized(model):
            _with_quantized_layers(config)
        return PeftModel.from_pretrained(model, adapter_dir, config=config)
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--adapter {adapter_dir} does not fit the base model {base_name} ({first}); "
                        "pass the --base the adapter was trained on") from exc


def save_adapter(model: nn.Module, target: Path) -> None:
    """The adapter alone (PEFT format: adapter_config.json + adapter_model.safetensors)."""
    model.save_pretrained(target, safe_serialization=True)
