"""cpudist export: the GGUF files it writes hold what the model computes (merge checked against
peft's, layout against the gguf reader), and bad input gets one-line errors."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from cpudist.cli import main
from cpudist.model.gguf_arch import permute_qk
from cpudist.model.gguf_export import read_adapter
from tests.helpers import GEMMA_FEATURES, PHI3_ROPES


def peft_adapter(base: Path, out: Path, **lora: object) -> tuple[Path, dict[str, torch.Tensor]]:
    """A saved adapter with random (non-zero) B, and the merged weights peft computes for it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = lora.pop("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                          "up_proj", "down_proj"])
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                        **lora)  # type: ignore[arg-type]
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out, safe_serialization=True)
    merged = peft_model.merge_and_unload()
    return out, {name: value.detach().clone() for name, value in merged.state_dict().items()}


@pytest.mark.parametrize("method", [{}, {"use_rslora": True}, {"use_dora": True}],
                         ids=["lora", "rslora", "dora"])
def test_streamed_merge_equals_peft_merge(tiny_llama: Path, tmp_path: Path, method: dict) -> None:
    from safetensors.torch import load_file

    adapter_dir, expected = peft_adapter(tiny_llama, tmp_path / "adapter", **method)
    adapter = read_adapter(adapter_dir)
    base = load_file(tiny_llama / "model.safetensors")
    assert len(adapter.modules) == 2 * 7
    for name in adapter.modules:
        merged = adapter.delta(name, base[name])
        assert not torch.allclose(merged, base[name].float(), atol=1e-4), name  # the update is there
        torch.testing.assert_close(merged, expected[name], rtol=1e-5, atol=1e-6)


def _read(file: Path) -> dict[str, torch.Tensor]:
    reader = gguf.GGUFReader(file)
    out = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        out[tensor.name] = torch.from_numpy(values.copy()).float().reshape(
            tuple(reversed(tensor.shape.tolist())))
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen"])
def test_exported_tensors_are_the_merged_weights_in_llama_cpp_layout(
        kind: str, tiny_llama: Path, tiny_qwen: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    base_dir = tiny_llama if kind == "llama" else tiny_qwen
    adapter_dir, merged = peft_adapter(base_dir, tmp_path / "adapter")
    out = tmp_path / "merged.gguf"
    assert main(["export", "--base", str(base_dir), "--adapter", str(adapter_dir),
                 "--out", str(out), "--type", "f32"]) == 0
    written = _read(out)
    base = load_file(base_dir / "model.safetensors")
    assert len(written) == len(base)  # tied head: no output.weight, as llama.cpp's converter does
    q = written["blk.1.attn_q.weight"]
    k = written["blk.0.attn_k.weight"]
    if kind == "llama":  # rope rows permuted the way llama.cpp's Llama graph reads them
        torch.testing.assert_close(q, permute_qk(merged["model.layers.1.self_attn.q_proj.weight"], 4, 4))
        torch.testing.assert_close(k, permute_qk(merged["model.layers.0.self_attn.k_proj.weight"], 4, 2))
        assert not torch.allclose(q, merged["model.layers.1.self_attn.q_proj.weight"])
    else:  # Qwen2: no permutation, biases carried
        torch.testing.assert_close(q, merged["model.layers.1.self_attn.q_proj.weight"])
        torch.testing.assert_close(written["blk.0.attn_q.bias"], base["model.layers.0.self_attn.q_proj.bias"])
    down = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(written["blk.1.ffn_down.weight"], merged[down])
    torch.testing.assert_close(written["token_embd.weight"], base["model.embed_tokens.weight"])
    fields = gguf.GGUFReader(out).fields
    assert fields["general.architecture"].contents() == ("llama" if kind == "llama" else "qwen2")
    # SmolLM2's vocabulary in both; transformers gives the Qwen2 class its own split rule.
    assert fields["tokenizer.ggml.pre"].contents() == ("smollm" if kind == "llama" else "qwen2")
    assert "{% for message in messages %}" in fields["tokenizer.chat_template"].contents()


def test_lora_file_carries_the_scale_peft_uses(tiny_llama: Path, tmp_path: Path) -> None:
    adapter_dir, _ = peft_adapter(tiny_llama, tmp_path / "adapter", use_rslora=True)
    out = tmp_path / "lora.gguf"
    assert main(["export", "--base", str(tiny_llama), "--adapter", str(adapter_dir), "--lora",
                 "--out", str(out), "--type", "f32"]) == 0
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    # llama.cpp scales by alpha/rank; rsLoRA's alpha/sqrt(r) = 8/2 needs alpha 16 at rank 4.
    assert reader.fields["adapter.lora.alpha"].contents() == pytest.approx(16.0)
    written = _read(out)
    adapter = read_adapter(adapter_dir)
    lora_a, lora_b, _ = adapter.modules["model.layers.0.self_attn.k_proj.weight"]
    torch.testing.assert_close(written["blk.0.attn_k.weight.lora_a"], lora_a)
    torch.testing.assert_close(written["blk.0.attn_k.weight.lora_b"], permute_qk(lora_b, 4, 2))
    assert len(written) == 2 * 14


def test_bad_input_gets_one_line_errors(tiny_llama: Path, tiny_qwen: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import shutil

    def error(argv: list[str]) -> str:
        assert main(argv) != 0
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, errors
        return errors[0]

    dora_dir, _ = peft_adapter(tiny_llama, tmp_path / "dora", use_dora=True)
    assert "DoRA" in error(["export", "--base", str(tiny_llama), "--adapter", str(dora_dir), "--lora",
                            "--out", str(tmp_path / "x.gguf")])
    # An architecture llama.cpp export does not cover.
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (other / "config.json").write_text(json.dumps(config))
    assert "GPTNeoXForCausalLM cannot be exported" in error(
        ["export", "--base", str(other), "--out", str(tmp_path / "y.gguf")])
    # An adapter trained on another base (the Qwen's projections have biases, the same shapes:
    # make the shapes differ with a wider Llama).
    lora_dir, _ = peft_adapter(tiny_llama, tmp_path / "lora")
    wide = tmp_path / "wide"
    shutil.copytree(tiny_llama, wide)
    from safetensors.torch import load_file, save_file

    weights = load_file(wide / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(96, 64)
    save_file(weights, wide / "model.safetensors", metadata={"format": "pt"})
    assert "pass the base the adapter was trained on" in error(
        ["export", "--base", str(wide), "--adapter", str(lora_dir), "--lora",
         "--out", str(tmp_path / "z.gguf")])
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "z.gguf").exists()
    # An existing file is not replaced without --force.
    (tmp_path / "keep.gguf").write_text("mine")
    assert "--force" in error(["export", "--base", str(tiny_llama), "--out", str(tmp_path / "keep.gguf")])
    assert (tmp_path / "keep.gguf").read_text() == "mine"


def test_any_gguf_is_a_base_converted_tensor_by_tensor(
        tiny_qwen: Path, tiny_llama: Path, tiny_qwen3: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our own GGUF of each architecture reads back to the original weights (bf16 rounding), wide
    heads (head_dim above hidden_size / heads) included, and the real llama.cpp-written SmolLM2
    Q4_1 file reads back to what transformers' loader makes."""
    from safetensors.torch import load_file

    from cpudist.config import ModelConfig
    from cpudist.model import safetensors_io
    from cpudist.model.load import resolve_model_path
    for base_dir in (tiny_llama, tiny_qwen, tiny_qwen3):
        file = tmp_path / f"{base_dir.name}.gguf"
        assert main(["export", "--base", str(base_dir), "--out", str(file), "--type", "f32"]) == 0
        monkeypatch.setattr(safetensors_io, "PROGRESS_EVERY_S", 0.0)  # a line per tensor
        with caplog.at_level(logging.INFO, logger="cpudist"):
            converted = resolve_model_path(ModelConfig(path=str(file), cache_dir=str(tmp_path / "cache")))
        # How far it is, as it goes (here a line per tensor), then how long it took.
        assert re.search(rf"converting {file.name}: \d+ of ~\d+ MB, \d+ MB/s, eta", caplog.text)
        assert re.search(rf"converting {file.name}: \d+ MB in [\d.]+ s", caplog.text)
        caplog.clear()
        assert converted.parent == tmp_path / "cache" / "gguf"
        original, back = load_file(base_dir / "model.safetensors"), load_file(converted / "model.safetensors")
        assert set(back) == set(original)
        for name, value in original.items():
            assert back[name].dtype == torch.bfloat16
            torch.testing.assert_close(back[name].float(), value.to(torch.bfloat16).float(), msg=name)
        # Converted once: a second resolve reuses the directory.
        mtime = (converted / "model.safetensors").stat().st_mtime_ns
        assert resolve_model_path(ModelConfig(path=str(file), cache_dir=str(tmp_path / "cache"))) == converted
        assert (converted / "model.safetensors").stat().st_mtime_ns == mtime


def _vocabulary(file: Path) -> dict[str, object]:
    fields = gguf.GGUFReader(file).fields
    return {key: fields[key].contents() for key in fields if key.startswith("tokenizer.ggml.")}


def test_sentencepiece_vocabulary_goes_to_gguf_and_back(spm_tokenizer_dir: Path, tmp_path: Path) -> None:
    """A Mistral base with a SentencePiece tokenizer is written as llama.cpp's "llama" vocabulary
    (scores ranking pieces as the merges do, byte and control tokens typed); read back as a base
    and exported again, it gives the same vocabulary and splits text as the original."""
    from transformers import AutoTokenizer

    from cpudist.config import ModelConfig
    from cpudist.model.load import resolve_model_path
    from tests.helpers import make_tiny_model

    base = make_tiny_model("mistral", spm_tokenizer_dir, tmp_path / "mistral")
    file = tmp_path / "mistral.gguf"
    assert main(["export", "--base", str(base), "--out", str(file), "--type", "f32"]) == 0
    assert gguf.GGUFReader(file).fields["general.architecture"].contents() == "llama"
    vocabulary = _vocabulary(file)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokens, scores, types = (vocabulary[f"tokenizer.ggml.{key}"]
                             for key in ("tokens", "scores", "token_type"))
    assert vocabulary["tokenizer.ggml.model"] == "llama" and vocabulary["tokenizer.ggml.add_space_prefix"]
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"]
    assert types[:4] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
                         gguf.TokenType.BYTE]
    # The first merge's piece outranks every later one.
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    first, last = ("".join(spec["model"]["merges"][i]) for i in (0, -1))
    assert scores[tokens.index(first)] > scores[tokens.index(last)]

    converted = resolve_model_path(ModelConfig(path=str(file), cache_dir=str(tmp_path / "cache")))
    text = "What is your favourite colour? 42 日本"
    assert AutoTokenizer.from_pretrained(converted)(text).input_ids == tokenizer(text).input_ids
    again = tmp_path / "again.gguf"
    assert main(["export", "--base", str(converted), "--out", str(again), "--type", "f32"]) == 0
    assert _vocabulary(again) == vocabulary


@pytest.mark.parametrize(("spec", "expected"), [
    ({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}}, True),
    ({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never"}}, False),
    ({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "add_prefix_space": False}}, False),
    # Llama 2's and Mistral 7B v0.1's tokenizer.json: the "▁" comes from the normalizer.
    ({"pre_tokenizer": None, "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}}, True),
    ({"pre_tokenizer": None, "normalizer": None}, False),
], ids=["metaspace-first", "metaspace-never", "metaspace-old-key", "legacy-prepend", "none"])
def test_space_prefix_is_read_from_either_llama_tokenizer_layout(spec: dict, expected: bool) -> None:
    from cpudist.model.gguf_vocab import adds_space_prefix

    assert adds_space_prefix(spec) is expected


LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama3_rope_scaling_goes_to_gguf_and_back(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Llama 3.1-style rope scaling travels in GGUF as llama.cpp writes it (the rope_freqs tensor
    alone); a base read back from that file rotates exactly as the original model does."""
    from transformers import AutoModelForCausalLM

    from cpudist.config import ModelConfig
    from cpudist.model.load import resolve_model_path
    from tests.helpers import make_tiny_model

    # head_dim 32: 16 rotary frequencies, some below, some inside, some above the scaled band.
    original = make_tiny_model("llama", tokenizer_dir, tmp_path / "llama31", hidden_size=128,
                               num_attention_heads=4, max_position_embeddings=131072,
                               rope_parameters=LLAMA31_ROPE)
    file = tmp_path / "llama31.gguf"
    assert main(["export", "--base", str(original), "--out", str(file), "--type", "f32"]) == 0
    converted = resolve_model_path(ModelConfig(path=str(file), cache_dir=str(tmp_path / "cache")))
    config = json.loads((converted / "config.json").read_text())
    assert {k: config["rope_parameters"][k] for k in LLAMA31_ROPE} == LLAMA31_ROPE

    def inv_freq(model_dir: Path) -> torch.Tensor:
        return AutoModelForCausalLM.from_pretrained(model_dir).model.rotary_emb.inv_freq

    scaled = inv_freq(original)
    torch.testing.assert_close(inv_freq(converted), scaled, rtol=0, atol=0)
    default = make_tiny_model("llama", tokenizer_dir, tmp_path / "plain", hidden_size=128,
                              num_attention_heads=4, rope_parameters={"rope_type": "default",
                                                                      "rope_theta": 500000.0})
    assert not torch.equal(inv_freq(default), scaled)  # the scaling changes some frequencies


def test_rope_freqs_that_match_no_llama3_scaling_are_refused(tmp_path: Path) -> None:
    from cpudist.errors import UserError
    from cpudist.model.gguf_arch import llama3_rope_factors, llama3_rope_parameters

    for params in (LLAMA31_ROPE, {**LLAMA31_ROPE, "factor": 32.0}):  # Llama 3.1, Llama 3.2
        factors = llama3_rope_factors(params, 128)
        assert llama3_rope_parameters(factors, 500000.0, 128, tmp_path / "m.gguf") == params
    odd = llama3_rope_factors(LLAMA31_ROPE, 128)
    odd[40] *= 1.5
    with pytest.raises(UserError, match="m.gguf: its rope_freqs tensor matches no Llama 3"):
        llama3_rope_parameters(odd, 500000.0, 128, tmp_path / "m.gguf")


def test_llama_cpp_written_gguf_reads_back_like_transformers(smol_dir: Path, tmp_path: Path) -> None:
    import importlib.util

    from safetensors.torch import load_file

    from cpudist.config import ModelConfig
    from cpudist.model.load import BUILTIN_MODELS, resolve_model_path

    package, name = BUILTIN_MODELS["smollm2-135m-instruct"]
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations
    file = Path(next(iter(spec.submodule_search_locations))) / name
    converted = resolve_model_path(ModelConfig(path=str(file), cache_dir=str(tmp_path / "cache")))
    ours = load_file(converted / "model.safetensors")
    reference = load_file(smol_dir / "model.safetensors")  # transformers' fp32 conversion
    assert set(ours) == set(reference)
    for key in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        torch.testing.assert_close(ours[key].float(), reference[key].to(torch.bfloat16).float(), msg=key)


def test_bad_gguf_files_get_one_line_errors(tiny_llama: Path, tmp_path: Path) -> None:
    from cpudist.config import ModelConfig
    from cpudist.errors import UserError
    from cpudist.model.load import resolve_model_path

    good = tmp_path / "good.gguf"
    assert main(["export", "--base", str(tiny_llama), "--out", str(good), "--type", "q8_0"]) == 0
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    text = tmp_path / "text.gguf"
    text.write_text("not a model\n")
    for bad, words in ((cut, "truncated or not GGUF"), (text, "not the GGUF magic")):
        with pytest.raises(UserError) as caught:
            resolve_model_path(ModelConfig(path=str(bad), cache_dir=str(tmp_path / "cache")))
        assert words in str(caught.value) and "\n" not in str(caught.value)
    assert not list((tmp_path / "cache" / "gguf").glob("[!.]*"))  # nothing half-converted left


def test_gemma_exports_that_llama_cpp_would_compute_differently_are_refused(
        tiny_gemma: Path, tiny_gemma2: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import shutil

    from cpudist.config import ModelConfig
    from cpudist.errors import UserError
    from cpudist.model.load import resolve_model_path

    # llama.cpp fixes the query scale by model size; a config that says otherwise is refused.
    other = tmp_path / "gemma2-scaled"
    shutil.copytree(tiny_gemma2, other)
    config = json.loads((other / "config.json").read_text())
    config["query_pre_attn_scalar"] = 256
    (other / "config.json").write_text(json.dumps(config))
    assert main(["export", "--base", str(other), "--out", str(tmp_path / "x.gguf")]) != 0
    assert "query_pre_attn_scalar 256" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
    # A Gemma 2 file whose sliding layers turn at their own rope base: transformers' Gemma 2
    # has one rope for both kinds of layer.
    plain = tmp_path / "gemma2.gguf"
    assert main(["export", "--base", str(tiny_gemma2), "--out", str(plain), "--type", "f32"]) == 0
    swa_base = gguf.Keys.Rope.FREQ_BASE_SWA.format(arch="gemma2")
    other_base = _rewritten(plain, tmp_path / "gemma2-swa-base.gguf", (swa_base,), {swa_base: 5e4})
    with pytest.raises(UserError, match="swa-base.gguf: a Gemma 2 with rope scaling or a separate"):
        resolve_model_path(ModelConfig(path=str(other_base), cache_dir=str(tmp_path / "cache")))
    # Gemma 1 GGUF files do not convert back: transformers reads none of their metadata.
    file = tmp_path / "gemma.gguf"
    assert main(["export", "--base", str(tiny_gemma), "--out", str(file), "--type", "f32"]) == 0
    with pytest.raises(UserError, match="'gemma' is not supported as a base; supported: .*gemma2"):
        resolve_model_path(ModelConfig(path=str(file), cache_dir=str(tmp_path / "cache")))


def _rewritten(source: Path, target: Path, dropped: tuple[str, ...] = (),
               added: dict[str, float] | None = None) -> Path:
    """A copy of an f32 GGUF file without some of its keys, with some float keys added."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in dropped:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, value in (added or {}).items():
        writer.add_key_value(key, value, gguf.GGUFValueType.FLOAT32)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


# GGUF bases, each with its own features sized to change the logits of a 64-token text:
# kind -> (model type, tokenizer fixture, config, llama.cpp keys dropped from the file).
_GGUF_BASES: dict[str, tuple[str, str, dict[str, object], tuple[str, ...]]] = {
    "gemma2": ("gemma2", "gemma_tokenizer_dir", GEMMA_FEATURES["gemma2"], ()),
    "gemma3": ("gemma3_text", "gemma_tokenizer_dir", GEMMA_FEATURES["gemma3_text"], ()),
    # As llama.cpp's own converter writes the releases: no layer kinds and no sliding rope base,
    # so llama.cpp's defaults (every other layer slides in Gemma 2, five in six in Gemma 3, whose
    # sliding layers turn at 10000).
    "gemma2-as-released": ("gemma2", "gemma_tokenizer_dir", GEMMA_FEATURES["gemma2"],
                           (gguf.Keys.Attention.SLIDING_WINDOW_PATTERN, gguf.Keys.Rope.FREQ_BASE_SWA)),
    "gemma3-as-released": ("gemma3_text", "gemma_tokenizer_dir", {
        **{key: value for key, value in GEMMA_FEATURES["gemma3_text"].items()
           if key not in ("layer_types", "rope_parameters")}, "num_hidden_layers": 6},
        (gguf.Keys.Attention.SLIDING_WINDOW_PATTERN, gguf.Keys.Rope.FREQ_BASE_SWA)),
    # No sliding layers: the file has no window, and no layer slides.
    "gemma3-no-sliding": ("gemma3_text", "gemma_tokenizer_dir", {
        **GEMMA_FEATURES["gemma3_text"], "layer_types": ["full_attention"] * 4}, ()),
    # Half of each head rotated, a 16-token window (Phi-3 mini 4k has 2047).
    "phi3": ("phi3", "spm_tokenizer_dir", dict(partial_rotary_factor=0.5, sliding_window=16), ()),
    "phi3-longrope": ("phi3", "spm_tokenizer_dir", PHI3_ROPES["longrope"], ()),
    "phi3-longrope-attention-factor": ("phi3", "spm_tokenizer_dir", {
        **PHI3_ROPES["longrope"], "rope_parameters": {
            **PHI3_ROPES["longrope"]["rope_parameters"], "attention_factor": 1.5}}, ()),  # type: ignore[dict-item]
}


@pytest.mark.parametrize("case", _GGUF_BASES)
def test_gguf_bases_compute_the_original_logits(case: str, request: pytest.FixtureRequest,
                                                tmp_path: Path) -> None:
    """A Gemma 2/3 or Phi-3 GGUF reads back to a model that computes the original's logits (its
    weights rounded to bf16): Gemma's soft caps, which layers slide and how far, both rope bases,
    the full layers' linear rope scaling, norms of (1 + weight) and query scale; Phi-3's partial
    rotation, window and LongRoPE; also from a file with only the keys llama.cpp's converter
    writes. transformers' GGUF reader alone computes other logits, and splits text the same."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cpudist.config import ModelConfig
    from cpudist.model.load import resolve_model_path
    from tests.helpers import chatterbot_lines, make_tiny_model

    kind, tokenizer_fixture, features, dropped = _GGUF_BASES[case]
    extra = {"head_dim": 32} if kind.startswith("gemma") else {"pad_token_id": 0}
    base = make_tiny_model(kind, request.getfixturevalue(tokenizer_fixture), tmp_path / "base",
                           initializer_range=0.2, **extra, **features)
    file = tmp_path / "model.gguf"
    assert main(["export", "--base", str(base), "--out", str(file), "--type", "f32"]) == 0
    if dropped:
        arch = gguf.GGUFReader(file).fields["general.architecture"].contents()
        file = _rewritten(file, tmp_path / "released.gguf",
                          tuple(key.format(arch=arch) for key in dropped))
    converted = resolve_model_path(ModelConfig(path=str(file), cache_dir=str(tmp_path / "cache")))

    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(0))
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for param in original.parameters():
        param.data = param.data.to(torch.bfloat16).float()
    expected = original(ids).logits.detach()
    back = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert type(back) is type(original)
    torch.testing.assert_close(back(ids).logits.detach(), expected, rtol=1e-4, atol=1e-4)
    readers_own = AutoModelForCausalLM.from_pretrained(
        converted, config=AutoConfig.from_pretrained(file.parent, gguf_file=file.name),
        dtype=torch.float32)
    assert (readers_own(ids).logits.detach() - expected).abs().max() > 0.1

    tokenizer, tokenizer_back = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(converted)
    assert not [line for line in chatterbot_lines("english", tmp_path)
                if tokenizer(line).input_ids != tokenizer_back(line).input_ids]
