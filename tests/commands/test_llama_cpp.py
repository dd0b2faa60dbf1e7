"""The GGUF round trip on the real SmolLM2, checked by llama.cpp itself (llama-cpp-python):
train -> export merged f16 and q8_0, the base f16 and the LoRA alone -> llama.cpp runs each.

The reference is transformers on the model `cpudist merge` writes (fp32). f16 weights move a
token's log-prob by up to LOGPROB_TOL (measured: 0.024 nat at most on this model), so two logits
closer than twice that (a near tie) may swap: greedy tokens are compared wherever transformers'
top two logits are further apart, and free-running continuations where no near tie occurs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import (
    GEMMA_FEATURES,
    PHI3_ROPES,
    cpudist_in_process,
    tiny_overrides,
    write_jsonl,
)

pytestmark = pytest.mark.slow

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is in the dev extra")

PROMPTS = ["What is your favourite colour?", "Can you tell me about the weather?",
           "Who are you?", "What do you like to do for fun?", "Do you know any good books?"]
NEW_TOKENS = 12
VAL_ROWS = 40
LOGPROB_TOL = 0.05
NEAR_TIE = 2 * LOGPROB_TOL


def _cpudist(*args: object) -> None:
    """A cpudist command (train, export, merge), run in this process; llama.cpp loads what it
    wrote in a process of its own where the test needs one."""
    assert cpudist_in_process(list(args)) == 0


@pytest.fixture(scope="module")
def exported(smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A short fp32 run on chatterbot pairs (a held-out validation file), then every export."""
    from cpudist.data.read import read_records, resolve_data_path

    root = tmp_path_factory.mktemp("gguf")
    rows = read_records(resolve_data_path("chatterbot:english", str(root / "data-cache")))
    val_file = write_jsonl(root / "val.jsonl", rows[:VAL_ROWS])
    train_file = write_jsonl(root / "train.jsonl", rows[VAL_ROWS:])
    out = root / "run"
    # A learning rate high enough that the adapter visibly moves the model (asserted below).
    overrides = tiny_overrides(smol_dir, train_file, out, data__val_path=val_file,
                               data__max_length=96, train__max_steps=12, train__lr=4e-3,
                               lora__r=16, lora__alpha=32, train__eval_batches=1)
    _cpudist("train", *overrides)
    files = {"merged_f16": ["--adapter", out, "--type", "f16"],
             "merged_q8_0": ["--adapter", out, "--type", "q8_0"],
             "base_f16": ["--type", "f16"],
             "lora_f16": ["--adapter", out, "--lora", "--type", "f16"]}
    paths = {}
    for name, flags in files.items():
        paths[name] = root / f"{name}.gguf"
        _cpudist("export", "--base", smol_dir, *flags, "--out", paths[name])
    merged_dir = root / "merged-hf"
    _cpudist("merge", "--base", smol_dir, "--adapter", out, "--out", merged_dir)
    return {"paths": paths, "merged_hf": merged_dir, "base_hf": smol_dir, "val": val_file}


def _llama(path: Path, lora: Path | None = None) -> object:
    return llama_cpp.Llama(model_path=str(path), lora_path=str(lora) if lora else None, n_ctx=512,
                           logits_all=True, n_threads=2, verbose=False, seed=0)


def _cpp_logits(llm: object, ids: list[int]) -> np.ndarray:
    llm.eval(ids)  # type: ignore[attr-defined]
    return np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # type: ignore[attr-defined]


def _transformers_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def _logprobs(llm: object, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, from llama.cpp's logits."""
    llm.reset()  # type: ignore[attr-defined]
    llm.eval(ids)  # type: ignore[attr-defined]
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # type: ignore[attr-defined]
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return logp[np.arange(len(ids) - 1), ids[1:]]


def _greedy(llm: object, ids: list[int], n: int) -> list[int]:
    """Up to n argmax tokens, ending at the end-of-turn token as generation does."""
    out = list(ids)
    for _ in range(n):
        llm.reset()  # type: ignore[attr-defined]
        llm.eval(out)  # type: ignore[attr-defined]
        out.append(int(np.argmax(llm.scores[len(out) - 1])))  # type: ignore[attr-defined]
        if out[-1] == llm.token_eos():  # type: ignore[attr-defined]
            break
    return out[len(ids):]


@pytest.fixture(scope="module")
def reference(exported: dict) -> dict:
    """Prompts in the chat template, transformers' greedy continuation on the merged model and its
    per-token log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(exported["merged_hf"])
    model = AutoModelForCausalLM.from_pretrained(exported["merged_hf"], dtype=torch.float32).eval()
    cases = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                       do_sample=False)[0].tolist()
            logits = model(torch.tensor([generated])).logits[0, :-1].double()
        logp = torch.log_softmax(logits, -1)[torch.arange(len(generated) - 1), torch.tensor(generated[1:])]
        top2 = logits[len(ids) - 1:].topk(2, dim=-1).values
        cases.append({"prompt": prompt, "ids": ids, "continuation": generated[len(ids):],
                      "logprobs": logp.numpy(), "margins": (top2[:, 0] - top2[:, 1]).tolist()})
    return {"cases": cases, "tokenizer": tokenizer}


def test_adapter_changes_the_model_measurably(exported: dict, reference: dict) -> None:
    base = _llama(exported["paths"]["base_f16"])
    merged = _llama(exported["paths"]["merged_f16"])
    shifts, differing = [], 0
    for case in reference["cases"]:
        full = case["ids"] + case["continuation"]
        shifts.append(np.abs(_logprobs(merged, full) - _logprobs(base, full)).mean())
        differing += _greedy(base, case["ids"], NEW_TOKENS) != case["continuation"]
    # The checks below compare against the merged model: they would pass by returning the base
    # unless the adapter moves the model well beyond the f16 tolerance (0.1 nat) used there.
    assert min(shifts) > 0.3, shifts
    assert differing >= 2


def _assert_same_model(llm: object, reference: dict) -> None:
    """llama.cpp's log-probs, argmax tokens and greedy continuations equal transformers' on the
    merged model (within LOGPROB_TOL; near ties excepted, see the module docstring)."""
    compared = free_running = 0
    for case in reference["cases"]:
        full = case["ids"] + case["continuation"]
        logp = _logprobs(llm, full)
        diff = np.abs(logp - case["logprobs"])
        assert diff.max() < LOGPROB_TOL, (case["prompt"], diff.max())
        # Teacher-forced: at each continuation position, the same argmax unless near a tie.
        for i, token in enumerate(case["continuation"]):
            if case["margins"][i] >= NEAR_TIE:
                llm.reset()  # type: ignore[attr-defined]
                llm.eval(full[: len(case["ids"]) + i])  # type: ignore[attr-defined]
                assert int(np.argmax(llm.scores[len(case["ids"]) + i - 1])) == token, case  # type: ignore[attr-defined]
                compared += 1
        if min(case["margins"]) >= NEAR_TIE:
            assert _greedy(llm, case["ids"], NEW_TOKENS) == case["continuation"], case["prompt"]
            free_running += 1
    assert compared >= NEW_TOKENS and free_running >= 1, (compared, free_running)


def test_merged_f16_matches_transformers(exported: dict, reference: dict) -> None:
    merged = _llama(exported["paths"]["merged_f16"])
    for case in reference["cases"]:
        # llama.cpp's own tokenizer reads the chat-templated text into transformers' ids.
        text = reference["tokenizer"].decode(case["ids"])
        assert merged.tokenize(text.encode(), add_bos=False, special=True) == case["ids"]
    _assert_same_model(merged, reference)


def test_base_plus_lora_matches_merged(exported: dict, reference: dict) -> None:
    paired = _llama(exported["paths"]["base_f16"], lora=exported["paths"]["lora_f16"])
    _assert_same_model(paired, reference)


def test_q8_0_perplexity_within_2_percent_of_f16(exported: dict, reference: dict) -> None:
    """On the held-out split's answer tokens, the tokens cpudist's validation loss scores."""
    tokenizer = reference["tokenizer"]
    rows = [json.loads(line) for line in exported["val"].read_text().splitlines()]
    texts = [(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False),
              len(tokenizer.apply_chat_template(row["messages"][:-1], tokenize=True,
                                                add_generation_prompt=True, return_dict=False)))
             for row in rows]
    perplexity = {}
    for name in ("merged_f16", "merged_q8_0"):
        llm = _llama(exported["paths"][name])
        logp = np.concatenate([_logprobs(llm, ids)[start - 1:] for ids, start in texts])
        perplexity[name] = math.exp(-logp.mean())
    ratio = perplexity["merged_q8_0"] / perplexity["merged_f16"]
    assert abs(ratio - 1) < 0.02, perplexity


def test_chat_mode_works_from_the_file_alone(exported: dict) -> None:
    """The chat template and stop token travel in the file: llama.cpp's chat API needs no flags."""
    merged = _llama(exported["paths"]["merged_q8_0"])
    reply = merged.create_chat_completion(  # type: ignore[attr-defined]
        messages=[{"role": "user", "content": "Hello, who are you?"}], max_tokens=24, temperature=0)
    text = reply["choices"][0]["message"]["content"]
    assert text.strip() and "<|im_start|>" not in text and "<|im_end|>" not in text


def test_llama3_rope_scaling_runs_in_llama_cpp_as_in_transformers(tokenizer_dir: Path,
                                                                    tmp_path: Path) -> None:
    """A Llama 3.1-style model (rope scaling written as llama.cpp's rope_freqs tensor) gives
    llama.cpp the logits transformers computes; without the scaling they would differ."""
    from tests.commands.test_export import LLAMA31_ROPE
    from tests.helpers import make_tiny_model

    # Large initial weights make attention sharp, so a change of rotation shows in the logits.
    shape = dict(hidden_size=128, num_attention_heads=4, max_position_embeddings=131072,
                 initializer_range=0.3)
    scaled = make_tiny_model("llama", tokenizer_dir, tmp_path / "scaled", rope_parameters=LLAMA31_ROPE,
                             **shape)
    plain = make_tiny_model("llama", tokenizer_dir, tmp_path / "plain", **shape,  # same weights
                            rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    file = tmp_path / "scaled.gguf"
    _cpudist("export", "--base", scaled, "--type", "f32", "--out", file)
    ids = torch.randint(100, 40000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    cpp = _cpp_logits(_llama(file), ids)
    error = np.abs(cpp - _transformers_logits(scaled, ids)).max()
    unscaled = np.abs(cpp - _transformers_logits(plain, ids)).max()
    assert error < 0.02 * np.abs(cpp).max(), (error, np.abs(cpp).max())
    assert unscaled > 10 * error, (unscaled, error)


# Indentation, runs of spaces, newlines, digits and characters the tokenizer never saw (byte
# fallback): where SentencePiece tokenizers differ most easily.
TRICKY_TEXTS = ["    def f(x):\n        return x  # 2024", "a  b   c\n\n\td", "Ünïcödé ∑ 🦙 日本語",
                "1234567890 3.14"]


def test_mistral_with_a_sentencepiece_vocabulary_runs_in_llama_cpp_as_in_transformers(
        spm_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mistral model with a SentencePiece tokenizer (the Llama 2 / Mistral 7B kind): llama.cpp
    splits text exactly as sentencepiece does, and computes transformers' logits. With the flat
    scores llama.cpp's converter writes from tokenizer.json alone, it would split many lines
    differently."""
    import gguf
    import sentencepiece
    from transformers import AutoTokenizer

    from tests.helpers import chatterbot_lines, make_tiny_model

    base = make_tiny_model("mistral", spm_tokenizer_dir, tmp_path / "mistral", tie_word_embeddings=False)
    file = tmp_path / "mistral.gguf"
    _cpudist("export", "--base", base, "--type", "f32", "--out", file)

    llm = _llama(file)
    reference = sentencepiece.SentencePieceProcessor(
        model_file=str(spm_tokenizer_dir / "sentencepiece" / "tokenizer.model"))
    texts = [*dict.fromkeys(chatterbot_lines("english", tmp_path)),
             *chatterbot_lines("chinese", tmp_path)[:200], *TRICKY_TEXTS]

    def differ(llm: object) -> list[str]:
        return [text for text in texts
                if llm.tokenize(text.encode(), add_bos=False) != reference.encode(text)]  # type: ignore[attr-defined]

    assert not differ(llm), (len(differ(llm)), len(texts), differ(llm)[:3])
    write_scores = gguf.GGUFWriter.add_token_scores
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_scores",
                        lambda writer, scores: write_scores(writer, [-1000.0] * len(scores)))
    flat = tmp_path / "flat.gguf"
    _cpudist("export", "--base", base, "--type", "f32", "--out", flat)
    flat_differ = len(differ(_llama(flat)))
    print(f"flat scores: {flat_differ} of {len(texts)} texts split differently")
    assert flat_differ > len(texts) // 10

    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer("What is your favourite colour? Tell me why.").input_ids
    assert ids == llm.tokenize(b"What is your favourite colour? Tell me why.")  # type: ignore[attr-defined]
    expected = _transformers_logits(base, ids)
    assert np.abs(_cpp_logits(llm, ids) - expected).max() < 0.01 * np.abs(expected).max()


# How far each --type may move a tiny model's logits in llama.cpp from transformers' (fp32 weights),
# as a share of the largest logit: about twice what the Llama and the Qwen2 measured (f32 1e-4,
# f16 3e-4, bf16 2.4e-3, q8_0 8e-3, q5_1 0.045, q5_0 0.050, q4_1 0.103, q4_0 0.092). Weights
# whose rows llama.cpp read out of order would move them by about the logits' own size (0.8 for
# q4_0 with reversed rows); a Llama's Q/K rows left unpermuted by 7e-3, which the f32, f16 and
# bf16 bounds catch (this small a random model's attention is nearly uniform).
TYPE_TOLERANCES = {"f32": 1e-3, "f16": 1e-3, "bf16": 5e-3, "q8_0": 0.02, "q5_1": 0.1, "q5_0": 0.1,
                   "q4_1": 0.2, "q4_0": 0.2}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_every_weight_type_runs_in_llama_cpp_as_in_transformers(kind: str, tiny_llama: Path,
                                                                  tiny_qwen: Path, tmp_path: Path) -> None:
    """Every --type on a Llama (Q/K rows permuted for llama.cpp) and a Qwen2 (its own llama.cpp
    graph, Q/K/V biases): llama.cpp loads the file as that type (its file type, and the bits per
    weight of what it loaded) and computes transformers' logits within what the type's rounding
    changes."""
    import gguf

    from cpudist.commands.export import TYPE_NAMES

    assert set(TYPE_TOLERANCES) == set(TYPE_NAMES)
    base = tiny_llama if kind == "llama" else tiny_qwen
    ids = torch.randint(100, 40000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = _transformers_logits(base, ids)
    errors = {}
    for file_type in TYPE_NAMES:
        file = tmp_path / f"{kind}-{file_type}.gguf"
        _cpudist("export", "--base", base, "--type", file_type, "--out", file)
        llm = _llama(file)
        assert llm.metadata["general.architecture"] == kind
        wanted = gguf.GGMLQuantizationType[file_type.upper()]
        file_kind = (gguf.LlamaFileType.ALL_F32 if file_type == "f32"
                     else gguf.LlamaFileType[f"MOSTLY_{file_type.upper()}"])
        assert llm.metadata["general.file_type"] == str(int(file_kind))
        # What llama.cpp loaded, in bits per weight: the 2-D weights' type (the F32 norms and
        # biases are a few hundred of the 3.2M parameters).
        block, block_bytes = gguf.GGML_QUANT_SIZES[wanted]
        bits = 8 * llama_cpp.llama_model_size(llm.model) / llama_cpp.llama_model_n_params(llm.model)
        assert bits == pytest.approx(8 * block_bytes / block, abs=0.01), (file_type, bits)
        errors[file_type] = np.abs(_cpp_logits(llm, ids) - expected).max() / np.abs(expected).max()
    assert all(errors[file_type] < tolerance for file_type, tolerance in TYPE_TOLERANCES.items()), errors


@pytest.mark.parametrize("kind", ["mistral", "qwen3"])
def test_wide_heads_run_in_llama_cpp_as_in_transformers(kind: str, tokenizer_dir: Path,
                                                         tmp_path: Path) -> None:
    """Heads wider than hidden_size / heads (Qwen3, Mistral Nemo: head_dim stated in the config)
    give llama.cpp transformers' logits; Qwen3's per-head Q/K norms travel too."""
    from tests.helpers import make_tiny_model

    base = make_tiny_model(kind, tokenizer_dir, tmp_path / kind, head_dim=32,  # 64 / 4 heads = 16
                           initializer_range=0.2)
    file = tmp_path / f"{kind}.gguf"
    _cpudist("export", "--base", base, "--type", "f32", "--out", file)
    ids = torch.randint(100, 40000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = _transformers_logits(base, ids)
    assert np.abs(_cpp_logits(_llama(file), ids) - expected).max() < 0.01 * np.abs(expected).max()


@pytest.mark.parametrize("kind", GEMMA_FEATURES)
def test_gemma_family_runs_in_llama_cpp_as_in_transformers(kind: str, gemma_tokenizer_dir: Path,
                                                            tmp_path: Path) -> None:
    """Gemma 1/2/3 with a SentencePiece vocabulary made as theirs: llama.cpp splits text as
    sentencepiece does; norms of (1 + weight), soft-capping, sliding windows and Gemma 3's local
    rope base reach llama.cpp, which computes the logits transformers computes with the adapter
    merged, and the same with the LoRA file on the base."""
    import sentencepiece

    from tests.commands.test_export import peft_adapter
    from tests.helpers import chatterbot_lines, make_tiny_model

    base = make_tiny_model(kind, gemma_tokenizer_dir, tmp_path / kind, head_dim=32,
                           initializer_range=0.2, **GEMMA_FEATURES[kind])
    adapter, _ = peft_adapter(base, tmp_path / "adapter")
    _check_adapter_exports(base, adapter, tmp_path, length=64)
    llm = _llama(tmp_path / "base.gguf")
    reference = sentencepiece.SentencePieceProcessor(
        model_file=str(gemma_tokenizer_dir / "sentencepiece" / "tokenizer.model"))
    texts = [*dict.fromkeys(chatterbot_lines("english", tmp_path)), *TRICKY_TEXTS]
    assert not [text for text in texts  # type: ignore[attr-defined]
                if llm.tokenize(text.encode(), add_bos=False) != reference.encode(text)]
    assert llm.tokenize(b"Hi")[0] == reference.bos_id()  # type: ignore[attr-defined]


@pytest.mark.parametrize("rope", PHI3_ROPES)
def test_phi3_runs_in_llama_cpp_as_in_transformers(rope: str, spm_tokenizer_dir: Path,
                                                    tmp_path: Path) -> None:
    """Phi-3 (fused qkv_proj and gate_up_proj, a Llama 2 SentencePiece vocabulary), with an
    adapter on the fused projections, merged and as a LoRA file; LongRoPE's factors travel (the
    test fails without them or without the attention factor)."""
    from tests.commands.test_export import peft_adapter
    from tests.helpers import make_tiny_model

    # No "phi3" in the file's name (base and run directory): llama.cpp gives files so named
    # Phi-3's special tokens (<|endoftext|>), which this small vocabulary has not.
    base = make_tiny_model("phi3", spm_tokenizer_dir, tmp_path / "small", initializer_range=0.2,
                           pad_token_id=0, **PHI3_ROPES[rope])
    adapter, _ = peft_adapter(base, tmp_path / "run" / "adapter",
                               target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    _check_adapter_exports(base, adapter, tmp_path, length=48)


def test_phi4_mini_with_a_gpt4o_style_vocabulary_runs_in_llama_cpp_as_in_transformers(
        tmp_path: Path) -> None:
    """Phi-4 mini: Phi-3's layout with a quarter of each head unrotated, tied embeddings and a
    byte-level vocabulary split by GPT-4o's rule. llama.cpp splits text as the tokenizer does
    (letters by case, which Llama 3's rule would not) and computes transformers' logits, merged
    and with the LoRA file; the file reads back as a base whose tokenizer splits the same."""
    import gguf
    from transformers import AutoTokenizer

    from cpudist.config import ModelConfig
    from cpudist.model.load import resolve_model_path
    from tests.commands.test_export import peft_adapter
    from tests.helpers import chatterbot_lines, make_tiny_model, save_gpt4o_style_tokenizer

    lines = [*chatterbot_lines("english", tmp_path), *chatterbot_lines("chinese", tmp_path)]
    tokenizer_dir = save_gpt4o_style_tokenizer(tmp_path / "tokenizer", lines)
    base = make_tiny_model("phi3", tokenizer_dir, tmp_path / "small", initializer_range=0.2,
                           partial_rotary_factor=0.75, pad_token_id=0)
    adapter, _ = peft_adapter(base, tmp_path / "run" / "adapter",
                               target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    _check_adapter_exports(base, adapter, tmp_path, length=48)
    assert gguf.GGUFReader(tmp_path / "base.gguf").fields["tokenizer.ggml.pre"].contents() == "gpt-4o"

    texts = [*dict.fromkeys(lines), *TRICKY_TEXTS, "HelloWorld isn't ALLCAPSWord, a/b//c\n"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    expected = {text: tokenizer(text, add_special_tokens=False).input_ids for text in texts}
    llm = _llama(tmp_path / "base.gguf")
    assert not [text for text in texts  # type: ignore[attr-defined]
                if llm.tokenize(text.encode(), add_bos=False) != expected[text]]
    converted = resolve_model_path(ModelConfig(path=str(tmp_path / "base.gguf"),
                                               cache_dir=str(tmp_path / "cache")))
    back = AutoTokenizer.from_pretrained(converted)
    assert not [text for text in texts
                if back(text, add_special_tokens=False).input_ids != expected[text]]


def test_a_gguf_base_trains_and_its_lora_file_runs_on_that_gguf_in_llama_cpp(
        gemma_tokenizer_dir: Path, tmp_path: Path) -> None:
    """A user's own GGUF model (a Gemma 3 with its features sized to matter) as the base of
    `cpudist train`, then `cpudist export --lora`: llama.cpp runs that same file with the LoRA
    file and computes the logits transformers + PEFT compute on the converted base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers import chat_rows, make_tiny_model

    hf_dir = make_tiny_model("gemma3_text", gemma_tokenizer_dir, tmp_path / "hf", head_dim=32,
                             initializer_range=0.2, **GEMMA_FEATURES["gemma3_text"])
    users_file = tmp_path / "model-f32.gguf"
    _cpudist("export", "--base", hf_dir, "--type", "f32", "--out", users_file)
    out = tmp_path / "run"
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    _cpudist("train", *tiny_overrides(users_file, data, out, lora__alpha=64,
                                      model__cache_dir=tmp_path / "cache"))
    lora_file = tmp_path / "lora.gguf"
    _cpudist("export", "--adapter", out / "adapter", "--lora", "--type", "f32", "--out", lora_file)

    converted = Path(json.loads((out / "adapter" / "adapter_config.json").read_text())
                     ["base_model_name_or_path"])
    assert converted.parent == tmp_path / "cache" / "gguf"
    ids = torch.randint(10, 600, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32), out / "adapter").eval()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].double().numpy()
    with_lora = _cpp_logits(_llama(users_file, lora=lora_file), ids)
    error = np.abs(with_lora - expected).max()
    assert error < 0.01 * np.abs(expected).max(), (error, np.abs(expected).max())
    assert np.abs(_cpp_logits(_llama(users_file), ids) - with_lora).max() > 10 * error


@pytest.mark.parametrize("ftype", ["LLAMA_FTYPE_MOSTLY_Q4_K_M", "LLAMA_FTYPE_MOSTLY_IQ4_XS"])
def test_k_and_i_quant_gguf_files_read_back_to_the_model_llama_cpp_runs(
        ftype: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    """The kinds of file most people download (Q4_K_M, IQ4_XS: K- and I-quant blocks, Q6_K for
    some tensors), made by llama.cpp's own quantizer from a Llama (Q/K rows permuted) whose rows
    fill those 256-wide blocks: as a base, the model computes llama.cpp's logits on that file, to
    a small part of what the quantization itself changes."""
    from cpudist.config import ModelConfig
    from cpudist.model.load import resolve_model_path
    from tests.helpers import make_tiny_model

    base = make_tiny_model("llama", tokenizer_dir, tmp_path / "small", hidden_size=256,
                           intermediate_size=512, initializer_range=0.05)
    f32 = tmp_path / "small-f32.gguf"
    _cpudist("export", "--base", base, "--type", "f32", "--out", f32)
    quantized = tmp_path / "small-quantized.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(quantized).encode(), params) == 0
    converted = resolve_model_path(ModelConfig(path=str(quantized), cache_dir=str(tmp_path / "cache")))

    ids = torch.randint(100, 40000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = _cpp_logits(_llama(quantized), ids)
    error = np.abs(_transformers_logits(converted, ids) - expected).max()
    quantization = np.abs(_transformers_logits(base, ids) - expected).max()
    assert error < 0.05 * np.abs(expected).max() and error < 0.25 * quantization, (error, quantization)


def _check_adapter_exports(base: Path, adapter: Path, tmp_path: Path, length: int) -> None:
    """Export base + adapter merged, the base alone and the LoRA file (f32): llama.cpp computes
    transformers + PEFT's logits on a random text of `length` tokens with the merged file, the
    same with base + LoRA file, and the adapter moves them far more than the export's error."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    files = {"merged": ["--adapter", adapter], "base": [], "lora": ["--adapter", adapter, "--lora"]}
    for name, flags in files.items():
        _cpudist("export", "--base", base, *flags, "--type", "f32", "--out", tmp_path / f"{name}.gguf")
    ids = torch.randint(10, 600, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      adapter).eval()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].double().numpy()
    merged = _cpp_logits(_llama(tmp_path / "merged.gguf"), ids)
    error = np.abs(merged - expected).max()
    assert error < 0.01 * np.abs(expected).max(), (error, np.abs(expected).max())
    with_lora = _cpp_logits(_llama(tmp_path / "base.gguf", lora=tmp_path / "lora.gguf"), ids)
    assert np.abs(with_lora - merged).max() < 0.01 * np.abs(expected).max()
    assert np.abs(_cpp_logits(_llama(tmp_path / "base.gguf"), ids) - merged).max() > 10 * error


def test_gemma3_with_vision_trains_its_text_model_and_exports_it(gemma_tokenizer_dir: Path,
                                                                  tmp_path: Path) -> None:
    """A Gemma 3 checkpoint with a vision tower (as the 4B, 12B and 27B are): `cpudist train`
    adapts the text model's linears only, and the text model exports merged and as a LoRA file,
    which llama.cpp runs with the logits of transformers + PEFT."""
    from tests.helpers import chat_rows, make_tiny_gemma3_with_vision

    base = make_tiny_gemma3_with_vision(gemma_tokenizer_dir, tmp_path / "gemma3-vision",
                                        initializer_range=0.2, head_dim=32,
                                        query_pre_attn_scalar=32)
    out = tmp_path / "run"
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    _cpudist("train", *tiny_overrides(base, data, out, lora__alpha=64))
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert "language_model" in adapter["target_modules"]
    from safetensors import safe_open

    with safe_open(out / "adapter" / "adapter_model.safetensors", "pt") as weights:
        names = list(weights.keys())
    assert names and all("language_model" in name for name in names)
    assert len(names) == 2 * 7 * 2  # A and B of the 7 projections of each of the 2 layers
    _check_adapter_exports(base, out / "adapter", tmp_path, length=48)
