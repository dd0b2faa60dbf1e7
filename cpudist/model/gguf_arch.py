"""What both GGUF directions know of an architecture: which Hugging Face classes map onto which
llama.cpp graphs (ARCHITECTURES), a Hugging Face model's config as export reads it, and the
transforms that export applies and import undoes (Q/K row order, Llama 3's rope factors, Gemma's
query scale). gguf_export writes GGUF files with them, gguf_import reads GGUF files back.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cpudist.errors import UserError


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face architecture maps onto a llama.cpp one."""

    hf_name: str
    gguf_name: str
    # llama.cpp's Llama graph applies rope to interleaved pairs, HF to halves: Q and K rows are
    # permuted on the way in (LlamaModel.permute in llama.cpp's conversion/llama.py).
    permute_qk: bool
    # llama.cpp's LlamaModel writes vocab_size and rope.dimension_count; Qwen2Model does not.
    writes_vocab_and_rope_dim: bool
    # Gemma's RMS norms scale by (1 + weight), llama.cpp's by weight: +1 on the way out.
    norms_plus_one: bool = False
    # llama.cpp's Gemma and Gemma 2 graphs read token_embd as the output head: no lm_head travels.
    output_is_embedding: bool = False
    # Whether a GGUF file of this llama.cpp architecture converts back to this class
    # (gguf_import): one class per llama.cpp name; transformers reads no Gemma 1 GGUF metadata.
    importable: bool = True

    @property
    def gemma_attention(self) -> bool:
        """Gemma 2/3: soft caps, sliding layers and a query scale that llama.cpp fixes by size."""
        return self.gguf_name in _LAYERS_OF_27B

    def tensor_names(self, n_layer: int) -> Any:
        """gguf's map of this architecture's Hugging Face tensor names to llama.cpp's."""
        import gguf

        return gguf.get_tensor_name_map(gguf.MODEL_ARCH[self.gguf_name.upper()], n_layer)

    def llama_cpp_rows(self, hf_name: str, values: torch.Tensor, n_head: int,
                       n_head_kv: int) -> torch.Tensor:
        """The output rows of a Q or K projection's tensor (weight, bias, or a LoRA B) in the order
        llama.cpp's graph reads them; every other tensor as it is."""
        heads = self._reordered_heads(hf_name, n_head, n_head_kv)
        return values if heads is None else permute_qk(values, heads, heads)

    def hf_rows(self, hf_name: str, values: torch.Tensor, n_head: int,
                n_head_kv: int) -> torch.Tensor:
        """The inverse of llama_cpp_rows: a tensor read from a GGUF file in Hugging Face's order."""
        heads = self._reordered_heads(hf_name, n_head, n_head_kv)
        return values if heads is None else unpermute_qk(values, heads, heads)

    def _reordered_heads(self, hf_name: str, n_head: int, n_head_kv: int) -> int | None:
        """How many heads the rows of this tensor hold if llama.cpp orders them differently."""
        if not self.permute_qk:
            return None
        module = hf_name.rsplit(".", 1)[0]
        if module.endswith("q_proj"):
            return n_head
        if module.endswith("k_proj"):
            return n_head_kv
        return None


_GEMMA = dict(norms_plus_one=True)
ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("LlamaForCausalLM", "llama", True, True),
    "Qwen2ForCausalLM": Architecture("Qwen2ForCausalLM", "qwen2", False, False),
    # llama.cpp converts Mistral as a Llama (conversion/llama.py registers both). Its Llama graph
    # has no sliding window: v0.1's 4096-token window is dropped there too (v0.2 on have none).
    "MistralForCausalLM": Architecture("MistralForCausalLM", "llama", True, True),
    # Qwen2's layout plus RMS norms of Q and K per head (attn_q_norm / attn_k_norm).
    "Qwen3ForCausalLM": Architecture("Qwen3ForCausalLM", "qwen3", False, False),
    "GemmaForCausalLM": Architecture("GemmaForCausalLM", "gemma", False, False,
                                     output_is_embedding=True, importable=False, **_GEMMA),
    # Gemma 2: soft-capped attention and output logits, sliding-window layers, post-norms.
    "Gemma2ForCausalLM": Architecture("Gemma2ForCausalLM", "gemma2", False, False,
                                      output_is_embedding=True, **_GEMMA),
    # Gemma 3 (text): Q/K norms, sliding-window layers with their own rope base.
    "Gemma3ForCausalLM": Architecture("Gemma3ForCausalLM", "gemma3", False, False, **_GEMMA),
    # Gemma 3 4B/12B/27B: the same text model beside a vision tower; its text model is written,
    # as llama.cpp's converter writes it (the vision part is its separate mmproj file).
    # A gemma3 GGUF holds the text model only, so it reads back as Gemma3ForCausalLM.
    "Gemma3ForConditionalGeneration": Architecture("Gemma3ForConditionalGeneration", "gemma3",
                                                   False, False, importable=False, **_GEMMA),
    # Phi-3 / Phi-3.5 mini and medium: fused qkv_proj and gate_up_proj, LongRoPE for 128k.
    "Phi3ForCausalLM": Architecture("Phi3ForCausalLM", "phi3", False, False),
}

# --------------------------------------------------------------------------- a model's config

# Where multimodal checkpoints keep their text model: on disk "language_model.model.*" (the
# released files), in transformers 5's modules and so in PEFT's adapters "model.language_model.*".
_TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
_NOT_TEXT_MODEL = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


def text_model_name(name: str) -> str | None:
    """A tensor's name in the text-only model (model.layers..., lm_head...), or None for a part of
    a multimodal checkpoint that is not the text model."""
    if name.startswith(_NOT_TEXT_MODEL):
        return None
    for prefix, replacement in _TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return replacement + name.removeprefix(prefix)
    return name


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """A Hugging Face model directory's config.json; of a multimodal checkpoint, its text model's."""
    file = model_dir / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{file}: not a readable model config ({exc}); pass a Hugging Face model "
                        "directory as --base") from None
    if "text_config" in config:
        # A multimodal checkpoint: the text model's settings, with the defaults the released
        # files leave out (transformers' config class fills them).
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(model_dir).get_text_config().to_dict()
        config = {**text, "architectures": config.get("architectures"),
                  "tie_word_embeddings": config.get("tie_word_embeddings",
                                                    text.get("tie_word_embeddings", True))}
    return config


def architecture_of(config: dict[str, Any], model_dir: Path) -> Architecture:
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise UserError(f"{model_dir}/config.json: architecture {', '.join(names) or '(none)'} cannot be "
                    f"exported to GGUF; supported: {', '.join(ARCHITECTURES)}")


def rope_parameters(config: dict[str, Any], layer_kind: str = "full_attention") -> dict[str, Any]:
    """The rope settings of one kind of layer, rope_theta and rope_type always present."""
    # transformers 5 writes rope_parameters; older configs have rope_theta / rope_scaling.
    params = dict(config.get("rope_parameters") or {})
    if layer_kind in params:  # one set per kind of layer (Gemma 3)
        params = dict(params[layer_kind])
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if config.get("rope_scaling"):
        params.update(config["rope_scaling"])
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


# --------------------------------------------------------------------------- Q/K row order


def permute_qk(weight: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: rows of each head from HF's half-split rope order to the
    interleaved order llama.cpp's Llama graph expects."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def unpermute_qk(weight: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """The inverse of permute_qk."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


# --------------------------------------------------------------------------- Llama 3 rope scaling


def llama3_rope_factors(params: dict[str, Any], dim: int) -> torch.Tensor:
    """rope_freqs.weight for rope_type llama3 (LlamaModel.generate_extra_tensors in llama.cpp)."""
    freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = params.get("factor", 8.0)
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_context = params.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


# What Llama 3.x releases (and their fine-tunes) use for the four numbers of their rope scaling;
# the neighbours cover variants. llama.cpp stores only the per-dimension factors they produce.
_LLAMA3_CONTEXTS = (8192, 4096, 2048, 16384, 32768, 65536, 131072)
_LLAMA3_FREQ_FACTORS = ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (0.5, 4.0), (2.0, 4.0), (2.0, 8.0))


def llama3_rope_parameters(factors: torch.Tensor, rope_theta: float, dim: int,
                           file: Path) -> dict[str, Any]:
    """rope_type llama3 parameters that reproduce a GGUF's rope_freqs tensor (llama.cpp writes the
    factors, not the factor / low / high / original-context numbers transformers needs). Only a
    set that gives back the file's factors is accepted, so the model computes the same rotations."""
    factor = float(factors.max())
    for context in _LLAMA3_CONTEXTS:
        for low, high in _LLAMA3_FREQ_FACTORS:
            params = {"rope_type": "llama3", "rope_theta": rope_theta, "factor": factor,
                      "low_freq_factor": low, "high_freq_factor": high,
                      "original_max_position_embeddings": context}
            candidate = llama3_rope_factors(params, dim)
            if candidate.shape == factors.shape and torch.allclose(candidate, factors, rtol=1e-5,
                                                                   atol=1e-6):
                return params
    raise UserError(f"model.path={file}: its rope_freqs tensor matches no Llama 3-style rope "
                    "scaling cpudist knows; use the Hugging Face directory of this model")


# --------------------------------------------------------------------------- Gemma 2/3

# llama.cpp sizes Gemma 2/3 by their layer count and scales queries by 1/sqrt(hidden / heads) for
# the 27B (46 and 62 layers), by 1/sqrt(head_dim) otherwise (llama.cpp's models/gemma2.cpp,
# gemma3.cpp); transformers reads query_pre_attn_scalar.
_LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}


def gemma_query_scalar(gguf_name: str, config: dict[str, Any]) -> int:
    """The query_pre_attn_scalar llama.cpp assumes for a Gemma 2/3 of this size."""
    big = config["num_hidden_layers"] == _LAYERS_OF_27B[gguf_name]
    return config["hidden_size"] // config["num_attention_heads"] if big else head_dim(config)
