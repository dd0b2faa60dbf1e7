"""GGUF files that llama.cpp loads: a base or merged model (`export_model`) and a LoRA adapter on its
own (`export_lora`), for the Llama (SmolLM2 included), Mistral, Qwen2, Qwen3, Gemma 1/2/3 and
Phi-3 architectures.

Built on the `gguf` package (writer, tensor-name map, quantizers, special-token reader). Where
llama.cpp's own converters (convert_hf_to_gguf.py and its conversion/ package, convert_lora_to_gguf.py,
as vendored in llama-cpp-python 0.3.36) make a choice, it is followed and named in a comment, so a
file written here is the file those scripts would write.

Both writers stream: every tensor is read, merged, converted and written on its own, so exporting a
7B base needs one tensor's memory, not the model's. The merge (W + s*B@A, DoRA's column norm) is
computed here in fp32 rather than through peft's merge_and_unload for the same reason; the tests
check it against peft's.

What import needs too (the architecture table, the HF config, Q/K row order, rope factors) is in
gguf_arch; the tokenizer's vocabulary is written by gguf_vocab.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cpudist.errors import UserError
from cpudist.files import replacing
from cpudist.model.gguf_arch import (
    Architecture,
    architecture_of,
    gemma_query_scalar,
    head_dim,
    llama3_rope_factors,
    read_hf_config,
    rope_parameters,
    text_model_name,
)
from cpudist.model.gguf_vocab import add_tokenizer
from cpudist.model.safetensors_io import read_header, read_tensor, weight_files

# --type -> (general.file_type, the type of every 2-D weight). Norms and biases stay F32 whatever
# the type, as llama.cpp's converter keeps every 1-D tensor in F32.
FILE_TYPES: dict[str, tuple[int, Any]] = {}
LORA_TYPES = ("f32", "f16", "bf16", "q8_0")


def _file_types() -> dict[str, tuple[int, Any]]:
    import gguf

    if not FILE_TYPES:
        q, f = gguf.GGMLQuantizationType, gguf.LlamaFileType
        FILE_TYPES.update({
            "f32": (f.ALL_F32, q.F32), "f16": (f.MOSTLY_F16, q.F16), "bf16": (f.MOSTLY_BF16, q.BF16),
            "q8_0": (f.MOSTLY_Q8_0, q.Q8_0), "q5_1": (f.MOSTLY_Q5_1, q.Q5_1),
            "q5_0": (f.MOSTLY_Q5_0, q.Q5_0), "q4_1": (f.MOSTLY_Q4_1, q.Q4_1),
            "q4_0": (f.MOSTLY_Q4_0, q.Q4_0),
        })
    return FILE_TYPES


# --------------------------------------------------------------------------- the base


@dataclass(frozen=True)
class _BaseModel:
    """A base model directory as both exporters read it: its config, llama.cpp architecture and
    tensor-name map."""

    directory: Path
    config: dict[str, Any]
    arch: Architecture
    names: Any  # gguf.TensorNameMap

    @classmethod
    def read(cls, directory: Path) -> _BaseModel:
        config = read_hf_config(directory)
        arch = architecture_of(config, directory)
        return cls(directory, config, arch, arch.tensor_names(config["num_hidden_layers"]))

    def llama_cpp_rows(self, hf_name: str, values: torch.Tensor) -> torch.Tensor:
        """A tensor's output rows in the order llama.cpp's graph reads them (Architecture's)."""
        n_head = self.config["num_attention_heads"]
        return self.arch.llama_cpp_rows(hf_name, values, n_head,
                                        self.config.get("num_key_value_heads", n_head))


def _add_hyperparameters(writer: Any, arch: Architecture, config: dict[str, Any], model_dir: Path) -> None:
    """The keys llama.cpp's TextModel.set_gguf_parameters (and LlamaModel's) write."""
    import gguf

    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        # Heads wider than hidden_size / heads (Qwen3, Mistral Nemo) need it stated.
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    kind = str(rope["rope_type"]).lower()
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind == "longrope" and arch.gguf_name == "phi3":
        pass  # the factors travel as tensors (_rope_tensors), the attention factor as a key
    elif kind not in ("default", "llama3"):  # llama3 travels as the rope_freqs tensor
        raise UserError(f"{model_dir}/config.json: rope type {kind!r} cannot be exported to GGUF "
                        "(supported: default, linear, yarn, llama3, and longrope for Phi-3)")
    if arch.writes_vocab_and_rope_dim:
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim(config))
    if arch.gemma_attention:
        _add_gemma_attention(writer, arch, config, model_dir)
    if arch.gguf_name == "phi3":
        _add_phi3_rope(writer, config, rope)


def _add_phi3_rope(writer: Any, config: dict[str, Any], rope: dict[str, Any]) -> None:
    """What llama.cpp's Phi3MiniModel writes besides the common keys: the rotated dimensions,
    the original context, and for LongRoPE the attention factor (its factors are tensors:
    _rope_tensors)."""
    fraction = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(int(fraction * config["hidden_size"])
                                    // config["num_attention_heads"])
    original = int(rope.get("original_max_position_embeddings")
                   or config.get("original_max_position_embeddings")
                   or config["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(original)
    # llama.cpp has no sliding window in its Phi-3 graph (it warns and drops one); 0 says none.
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if str(rope["rope_type"]).lower() == "longrope":
        scale = config["max_position_embeddings"] / original
        factor = rope.get("attention_factor") or (
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_rope_scaling_attn_factors(float(factor))


def _rope_tensors(arch: Architecture, config: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The rope scaling llama.cpp reads from tensors, not keys: Llama 3's per-frequency factors
    (rope_freqs, LlamaModel.generate_extra_tensors) and LongRoPE's long and short factors
    (rope_factors_long/short, Phi3MiniModel's; llama.cpp takes the long ones when its context
    exceeds the original, transformers when the text does)."""
    import gguf

    rope = rope_parameters(config)
    kind = str(rope["rope_type"]).lower()
    if arch.permute_qk and kind == "llama3":
        return [(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                 llama3_rope_factors(rope, head_dim(config)))]
    if arch.gguf_name == "phi3" and kind == "longrope":
        return [(gguf.TENSOR_NAMES[tensor] + ".weight", torch.tensor(rope[key], dtype=torch.float32))
                for tensor, key in ((gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, "long_factor"),
                                    (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, "short_factor"))]
    return []


def _add_gemma_attention(writer: Any, arch: Architecture, config: dict[str, Any],
                         model_dir: Path) -> None:
    """Gemma 2/3: soft-capping, which layers slide and how far, their rope base, as llama.cpp's
    Gemma2Model / Gemma3Model write them; the layer kinds are written per layer."""
    assumed = gemma_query_scalar(arch.gguf_name, config)
    if config.get("query_pre_attn_scalar", assumed) != assumed:
        raise UserError(f"{model_dir}/config.json: query_pre_attn_scalar "
                        f"{config['query_pre_attn_scalar']}, but llama.cpp scales this model's "
                        f"queries by 1/sqrt({assumed}); it would compute different logits")
    for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                     ("final_logit_softcapping", writer.add_final_logit_softcapping)):
        if config.get(key):
            add(float(config[key]))
    kinds = config.get("layer_types")
    sliding = ([kind == "sliding_attention" for kind in kinds] if kinds
               else [arch.gguf_name == "gemma2"])  # old configs: Gemma 2 always slides
    if any(sliding) and config.get("sliding_window"):
        writer.add_sliding_window(int(config["sliding_window"]))
        if kinds:
            writer.add_sliding_window_pattern(sliding)
        local = rope_parameters(config, "sliding_attention")
        writer.add_rope_freq_base_swa(float(config.get("rope_local_base_freq", local["rope_theta"])))


# --------------------------------------------------------------------------- the adapter


@dataclass
class AdapterWeights:
    """A PEFT LoRA adapter read as per-base-weight updates."""

    directory: Path
    config: dict[str, Any]
    # base weight name in the text model ("model.layers.0.self_attn.q_proj.weight", as
    # text_model_name gives it) -> (A, B, magnitude or None)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]

    @property
    def dora(self) -> bool:
        return bool(self.config.get("use_dora"))

    def scale(self, rank: int) -> float:
        """What peft multiplies B@A by: alpha/r, or alpha/sqrt(r) with rsLoRA."""
        alpha = float(self.config["lora_alpha"])
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    def delta(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The base weight (fp32) with this adapter folded in, as peft's merge computes it."""
        lora_a, lora_b, magnitude = self.modules[name]
        merged = weight.float() + self.scale(lora_a.shape[0]) * (lora_b.float() @ lora_a.float())
        if magnitude is not None:
            # DoRA: each output row rescaled to its learned magnitude (peft's DoraLinearLayer:
            # weight_norm over dim 1 of W + s*B@A, merged as magnitude / norm * (W + s*B@A)).
            merged = merged * (magnitude.float() / torch.linalg.norm(merged, dim=1)).unsqueeze(1)
        return merged


_PEFT_PREFIX = "base_model.model."


def read_adapter(adapter_dir: Path) -> AdapterWeights:
    """The adapter's LoRA matrices keyed by the base weight they update; one-line errors for what
    GGUF export cannot carry."""
    from safetensors.torch import load_file

    config_file = adapter_dir / "adapter_config.json"
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{config_file}: peft_type {config.get('peft_type')} is not LoRA; only LoRA "
                        "adapters export to GGUF")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise UserError(f"{config_file}: {key} is set; per-module ranks or alphas are not "
                            "supported by GGUF export")
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, kind = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
        if not module:
            raise UserError(f"{adapter_dir}/adapter_model.safetensors: tensor {key} is not a LoRA "
                            "matrix; only LoRA A/B (and DoRA magnitudes) export to GGUF")
        parts.setdefault(module, {})[kind] = value
    modules = {}
    for module, kinds in parts.items():
        if "A.weight" not in kinds or "B.weight" not in kinds:
            raise UserError(f"{adapter_dir}/adapter_model.safetensors: {module} has "
                            f"{sorted(kinds)}, not a LoRA A/B pair (embedding adapters do not export)")
        name = text_model_name(f"{module}.weight")
        if name is None:
            raise UserError(f"{adapter_dir}: it adapts {module}, outside the text model that GGUF "
                            "export writes; train with lora.target_modules in the text model")
        modules[name] = (kinds["A.weight"], kinds["B.weight"], kinds.get("magnitude_vector"))
    return AdapterWeights(adapter_dir, config, modules)


# --------------------------------------------------------------------------- writing


@dataclass
class _PlannedTensor:
    name: str  # llama.cpp's tensor name
    qtype: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]  # the tensor's fp32 values, made when its turn comes


def _encode(values: torch.Tensor, qtype: Any) -> np.ndarray:
    import gguf

    q = gguf.GGMLQuantizationType
    if qtype == q.F32:
        return values.float().contiguous().numpy()
    if qtype == q.F16:
        return values.to(torch.float16).contiguous().numpy()
    if qtype == q.BF16:  # torch rounds to nearest even, as gguf.quants.BF16 does, and faster
        raw = values.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        return raw.view(np.uint8)
    return gguf.quants.quantize(values.float().contiguous().numpy(), qtype)


def _weight_type(shape: tuple[int, ...], wanted: Any) -> Any:
    import gguf

    q = gguf.GGMLQuantizationType
    if len(shape) == 1:
        return q.F32
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    # Rows that do not split into whole blocks fall back to F16, as llama.cpp's converter does.
    return wanted if shape[-1] % block == 0 else q.F16


def _write_gguf(out: Path, arch_name: str, fill: Callable[[Any], None],
                planned: list[_PlannedTensor]) -> Path:
    """One GGUF file: keys from fill(writer), then the planned tensors streamed in order; the file
    appears at out only when complete."""
    import gguf

    target = Path(out).expanduser()
    with replacing(target) as tmp:
        writer = gguf.GGUFWriter(tmp, arch_name)
        fill(writer)
        for item in planned:
            byte_shape = gguf.quant_shape_to_byte_shape(item.shape, item.qtype)
            element = {gguf.GGMLQuantizationType.F32: np.float32,
                       gguf.GGMLQuantizationType.F16: np.float16}.get(item.qtype)
            if element is None:  # block types (and BF16) travel as their raw bytes
                writer.add_tensor_info(item.name, byte_shape, np.dtype(np.uint8),
                                       int(np.prod(byte_shape)), raw_dtype=item.qtype)
            else:
                writer.add_tensor_info(item.name, item.shape, np.dtype(element), int(np.prod(byte_shape)))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for item in planned:
            values = item.make()
            if tuple(values.shape) != item.shape:
                raise RuntimeError(f"{item.name}: made {tuple(values.shape)}, planned {item.shape}")
            writer.write_tensor_data(_encode(values, item.qtype))
        writer.close()
    return target


def _base_tensors(model_dir: Path) -> Iterator[tuple[str, Path, dict, int]]:
    files = weight_files(model_dir)
    if not files:
        raise UserError(f"{model_dir}: no .safetensors weights in it; pass a Hugging Face model "
                        "directory saved with safetensors")
    for file in files:
        header, data_start = read_header(file)
        for name, meta in header.items():
            text_name = text_model_name(name)
            if text_name is not None:
                yield text_name, file, meta, data_start


def export_model(base_dir: Path, out: Path, file_type: str = "f16",
                 adapter: AdapterWeights | None = None, name: str | None = None) -> Path:
    """The base (or base + adapter, merged) as one GGUF model file."""
    import gguf

    ftype, wanted = _file_types()[file_type]
    base = _BaseModel.read(base_dir)
    config, arch = base.config, base.arch
    pending = dict(adapter.modules) if adapter else {}
    planned = [_PlannedTensor(gguf_name, gguf.GGMLQuantizationType.F32, tuple(factors.shape),
                        lambda f=factors: f) for gguf_name, factors in _rope_tensors(arch, config)]
    for hf_name, file, meta, data_start in _base_tensors(base_dir):
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == "lm_head.weight" and arch.output_is_embedding:
            if config.get("tie_word_embeddings", True):
                continue  # a saved copy of the embedding
            raise UserError(f"{base_dir}: lm_head differs from the embedding, which llama.cpp's "
                            f"{arch.gguf_name} graph always uses as the output head")
        gguf_name = base.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UserError(f"{file}: tensor {hf_name} has no llama.cpp name for {arch.gguf_name}; "
                            "this checkpoint's layout cannot be exported")
        shape = tuple(meta["shape"])
        update = pending.pop(hf_name, None) is not None

        def make(file: Path = file, meta: dict = meta, start: int = data_start, hf_name: str = hf_name,
                 update: bool = update) -> torch.Tensor:
            values = read_tensor(file, meta, start).float()
            if update and adapter is not None:
                values = adapter.delta(hf_name, values)
            if arch.norms_plus_one and hf_name.endswith("norm.weight"):
                values = values + 1
            return base.llama_cpp_rows(hf_name, values)

        planned.append(_PlannedTensor(gguf_name, _weight_type(shape, wanted), shape, make))
    if pending:
        raise UserError(f"--adapter {adapter.directory if adapter else ''}: it updates "
                        f"{next(iter(pending))}, which the base {base_dir} does not have; pass the "
                        "base the adapter was trained on")

    def fill(writer: Any) -> None:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or (f"{base_dir.name} + {adapter.directory.parent.name} LoRA" if adapter
                                 else base_dir.name))
        _add_hyperparameters(writer, arch, config, base_dir)
        writer.add_file_type(ftype)
        if wanted not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                          gguf.GGMLQuantizationType.BF16):
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_tokenizer(writer, base_dir, config["vocab_size"])

    return _write_gguf(out, base.arch.gguf_name, fill, planned)


def export_lora(base_dir: Path, adapter: AdapterWeights, out: Path, file_type: str = "f16") -> Path:
    """The adapter alone as a GGUF LoRA file for llama.cpp's --lora (convert_lora_to_gguf.py's layout:
    general.type=adapter, adapter.type=lora, adapter.lora.alpha, tensors NAME.weight.lora_a/lora_b)."""
    import gguf

    if adapter.dora:
        raise UserError(f"--adapter {adapter.directory} is a DoRA adapter; llama.cpp's LoRA format has "
                        "no magnitude vectors: export it merged (without --lora)")
    if file_type not in LORA_TYPES:
        raise UserError(f"--type {file_type}: a LoRA GGUF is written as one of {', '.join(LORA_TYPES)}")
    _, wanted = _file_types()[file_type]
    base = _BaseModel.read(base_dir)
    shapes = {name: tuple(meta["shape"]) for name, _, meta, _ in _base_tensors(base_dir)}
    ranks = set()
    planned: list[_PlannedTensor] = []
    for hf_name, (lora_a, lora_b, _) in adapter.modules.items():
        base_shape = shapes.get(hf_name)
        if base_shape != (lora_b.shape[0], lora_a.shape[1]):
            raise UserError(f"--adapter {adapter.directory}: {hf_name} is {tuple(lora_b.shape[:1])} x "
                            f"{tuple(lora_a.shape[1:])} in the adapter but {base_shape} in the base "
                            f"{base_dir}; pass the base the adapter was trained on")
        gguf_name = base.names.get_name(hf_name, try_suffixes=(".weight",))
        if gguf_name is None or gguf_name.startswith(("token_embd", "output.")):
            raise UserError(f"--adapter {adapter.directory}: {hf_name} cannot be carried by a GGUF "
                            "LoRA file; export the merged model instead")
        ranks.add(lora_a.shape[0])
        # Only B's rows follow Q/K's rope permutation (convert_lora_to_gguf.py's LoraTorchTensor
        # permutes B and leaves A, which acts on the input side).
        b = base.llama_cpp_rows(hf_name, lora_b.float())
        for suffix, values in ((".lora_a", lora_a.float()), (".lora_b", b)):
            shape = tuple(values.shape)
            planned.append(_PlannedTensor(gguf_name + suffix, _weight_type(shape, wanted), shape,
                                    lambda v=values: v))
    if len(ranks) != 1:
        raise UserError(f"--adapter {adapter.directory}: modules of ranks {sorted(ranks)}; one "
                        "adapter.lora.alpha cannot scale them all")
    rank = ranks.pop()
    # llama.cpp scales by alpha / rank (llama_adapter_lora_weight::get_scale); the alpha written is
    # the one that gives the scale peft used (for rsLoRA alpha/sqrt(r) -> alpha*sqrt(r)/r).
    effective_alpha = adapter.scale(rank) * rank

    def fill(writer: Any) -> None:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(effective_alpha))
        writer.add_name(f"{base_dir.name} LoRA")

    return _write_gguf(out, base.arch.gguf_name, fill, planned)
