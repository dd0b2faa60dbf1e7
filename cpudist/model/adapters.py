"""Adapters through peft: the methods cpudist trains (a registry), and adapter directories on disk.

To add a PEFT method, write a function that turns the config (its own section of it) and the
resolved target modules into a peft config, register it in ADAPTER_METHODS under the name
`peft.method` takes (and add that name to PeftSection.method in config.py). PEFT builds, names,
saves and reloads every adapter; cpudist only chooses its settings.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from cpudist.config import Config
from cpudist.errors import UserError

log = logging.getLogger("cpudist")

# peft's task types: what the adapted model computes (and which PEFT model class wraps it).
CAUSAL_LM, SEQ_CLS = "CAUSAL_LM", "SEQ_CLS"


def _lora(config: Config, targets: str | list[str], task: str) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    lora = config.lora
    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=targets, task_type=task, use_rslora=lora.use_rslora,
                          use_dora=lora.use_dora)


def _ia3(config: Config, targets: str | list[str], task: str) -> Any:
    from peft import IA3Config

    ia3 = config.ia3
    # PEFT knows which of an architecture's modules IA3 scales, and which of them are MLP inputs.
    chosen = {} if ia3.target_modules == "auto" else {"target_modules": ia3.target_modules}
    if ia3.feedforward_modules != "auto":
        chosen["feedforward_modules"] = ia3.feedforward_modules
    return IA3Config(task_type=task, **chosen)


def _prompt_tuning(config: Config, targets: str | list[str], task: str) -> Any:
    from peft import PromptTuningConfig

    prompt = config.prompt
    text = {} if prompt.init_text is None else {
        "prompt_tuning_init": "TEXT", "prompt_tuning_init_text": prompt.init_text,
        "tokenizer_name_or_path": config.model.path}
    return PromptTuningConfig(task_type=task, num_virtual_tokens=prompt.virtual_tokens, **text)


def _p_tuning(config: Config, targets: str | list[str], task: str) -> Any:
    from peft import PromptEncoderConfig

    prompt = config.prompt
    return PromptEncoderConfig(task_type=task, num_virtual_tokens=prompt.virtual_tokens,
                               encoder_reparameterization_type=prompt.encoder.upper(),
                               encoder_hidden_size=prompt.encoder_hidden_size)


def _prefix_tuning(config: Config, targets: str | list[str], task: str) -> Any:
    from peft import PrefixTuningConfig

    prompt = config.prompt
    return PrefixTuningConfig(task_type=task, num_virtual_tokens=prompt.virtual_tokens,
                              prefix_projection=prompt.prefix_projection)


@dataclass(frozen=True)
class Method:
    """A PEFT method: how its peft config is made, and what it can be used for."""

    build: Callable[[Config, str | list[str], str], Any]
    prompt_learning: bool = False  # virtual tokens, not weights of the base: cannot be merged
    mergeable: bool = True
    section: str = ""  # the config section of its settings


# peft.method name -> the method.
ADAPTER_METHODS: dict[str, Method] = {
    "lora": Method(_lora, section="lora"),
    "ia3": Method(_ia3, section="ia3"),
    "prompt_tuning": Method(_prompt_tuning, prompt_learning=True, mergeable=False,
                            section="prompt"),
    "p_tuning": Method(_p_tuning, prompt_learning=True, mergeable=False, section="prompt"),
    "prefix_tuning": Method(_prefix_tuning, prompt_learning=True, mergeable=False,
                            section="prompt"),
}


# peft.method that trains every weight of the model itself, with no adapter (not a PEFT method).
FULL = "full"


def is_full(config: Config) -> bool:
    """Whether the run trains every weight (peft.method=full) rather than an adapter."""
    return config.peft.method == FULL


def method_of(config: Config) -> str:
    """The adapter method a config asks for (a key of ADAPTER_METHODS)."""
    return config.peft.method


def saved_method(adapter_dir: Path) -> str:
    """The method of a saved adapter, as the names of ADAPTER_METHODS (from its peft_type)."""
    import json

    peft_type = str(json.loads((adapter_dir / "adapter_config.json").read_text())
                    .get("peft_type", "LORA")).lower()
    return {"p_tuning": "p_tuning", "prompt_tuning": "prompt_tuning",
            "prefix_tuning": "prefix_tuning", "ia3": "ia3"}.get(peft_type, "lora")


def saved_task(adapter_dir: Path) -> str:
    """What a saved adapter's model computes: CAUSAL_LM or SEQ_CLS (its peft task_type)."""
    import json

    return str(json.loads((adapter_dir / "adapter_config.json").read_text()).get("task_type")
               or CAUSAL_LM)


def check_generative(adapter_dir: Path | None, what: str) -> None:
    """A one-line error when the adapter is a classifier: `what` (a command) needs text out."""
    if adapter_dir is not None and saved_task(adapter_dir) == SEQ_CLS:
        raise UserError(f"{what}: {adapter_dir} is a classifier (its head scores labels; it writes "
                        f"no text); run it with `cpudist predict --adapter {adapter_dir} --data "
                        "FILE` or `cpudist eval`")


def check_mergeable(adapter_dir: Path, what: str) -> str:
    """The saved adapter's method; a one-line error when it cannot be folded into its base
    (`what`: the command that wants to, for the message)."""
    check_generative(adapter_dir, what)
    name = saved_method(adapter_dir)
    if not ADAPTER_METHODS[name].mergeable:
        raise UserError(f"{what}: {adapter_dir} is a {name} adapter, whose virtual tokens are not "
                        "weights of the base, so there is nothing to fold into it; run base + "
                        "adapter with `cpudist generate`/`eval`, or with peft "
                        "(PeftModel.from_pretrained)")
    return name


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


# The classification heads transformers puts on a backbone; trained in full beside the adapter
# (PEFT's modules_to_save) and saved with it.
CLASSIFIER_HEADS = ("score", "classifier")


def _lora_targets(model: nn.Module, config: Config, quantized: bool, task: str) -> str | list[str]:
    """lora.target_modules checked against the model, with all-linear resolved."""
    lora = config.lora
    available = linear_module_names(model)
    if isinstance(lora.target_modules, list):
        missing = [name for name in lora.target_modules if name not in available]
        if missing:
            raise UserError(
                f"lora.target_modules: {', '.join(missing)} not in this model; its Linear modules "
                f"are: {', '.join(available)} (or use 'all-linear')")
        return lora.target_modules
    if task == SEQ_CLS:  # every linear of the backbone; the head trains in full
        return [name for name in available if name not in CLASSIFIER_HEADS]
    return _all_linear_targets(model, quantized)


def apply_adapter(model: nn.Module, config: Config, task: str = CAUSAL_LM) -> nn.Module:
    """The frozen base wrapped with a fresh, trainable adapter of peft.method (fp32 weights);
    with task SEQ_CLS the classification head trains too."""
    from peft import get_peft_model

    name = method_of(config)
    method = ADAPTER_METHODS[name]
    quantized = _quantized(model)
    if quantized and name == "ia3":
        raise UserError("peft.method=ia3 scales the outputs of nn.Linear layers, and a quantized "
                        "base (model.quantize) has none; use peft.method=lora, a prompt-learning "
                        "method, or model.quantize=none")
    if quantized and name == "lora" and config.lora.use_dora:
        raise UserError("lora.use_dora=true needs the base weights' norms every step, which a "
                        "quantized base (model.quantize) does not keep; use model.quantize=none or "
                        "plain LoRA (lora.use_dora=false)")
    _warn_unused_sections(config, method)
    targets = _lora_targets(model, config, quantized, task) if name == "lora" else []
    peft_config = method.build(config, targets, task)
    if quantized and name == "lora":
        _with_quantized_layers(peft_config)
    peft_model = get_peft_model(model, peft_config)
    # Adapter weights and their optimizer state stay fp32 even when the frozen base is bf16.
    for param in peft_model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    if name == "lora" and config.lora.fast_path:
        from cpudist.model.fast_lora import install_fast_path

        install_fast_path(peft_model)
    return peft_model


def _warn_unused_sections(config: Config, method: Method) -> None:
    """Settings given for a method the run does not use would silently do nothing: say so."""
    for section in {m.section for m in ADAPTER_METHODS.values()} - {method.section}:
        given = getattr(config, section).model_fields_set
        if given:
            log.warning("%s set but peft.method=%s does not use them",
                        ", ".join(f"{section}.{key}" for key in sorted(given)), method_of(config))


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
    if (folder / "model" / "config.json").is_file():
        raise UserError(f"--adapter {path}: a run of peft.method=full, which trains no adapter; "
                        f"its model is a plain model directory: pass --base {folder / 'model'}")
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
