"""The base's tokenizer as llama.cpp's vocabulary in a GGUF file (`add_tokenizer`): tokens and
their types, SentencePiece scores or the byte-level BPE's pre-tokenizer, special tokens and the
chat template, as llama.cpp's converter (LlamaModel.set_vocab, _set_vocab_gpt2) writes them.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path
from typing import Any

from cpudist.errors import UserError

# llama.cpp names the BPE pre-tokenizer by a hash of how the tokenizer splits a check text
# (get_vocab_base_pre in llama.cpp's conversion/base.py, which is generated; these are its entries
# for the supported families). The text and the hashes are llama.cpp's, copied verbatim.
_CHECK_TEXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis '
    'concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 '
    'កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български '
    '\'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? '
    '\'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
_PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5/2/2.5
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM/SmolLM2
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}
# The hash also changes with the vocabulary (a tokenizer of the same family with added or resized
# tokens): then the splitting rule itself names the pre-tokenizer, since that rule is all that
# llama.cpp's pre-tokenizer type selects. Regexes as tokenizers' Split pre-tokenizer holds them.
_SPLIT_RULES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    # GPT-4o's o200k rule (Phi-4 mini, Llama 4): letters split by case, "/" kept with punctuation.
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "gpt-4o",
}


def _pre_tokenizer_by_rule(spec: dict[str, Any]) -> str | None:
    rule = spec.get("pre_tokenizer") or {}
    steps = rule.get("pretokenizers", [rule])
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex"):
        return "gpt-2"
    split = steps[0] if steps and steps[0].get("type") == "Split" else {}
    return _SPLIT_RULES.get((split.get("pattern") or {}).get("Regex", ""))


def add_tokenizer(writer: Any, model_dir: Path, vocab_size: int) -> None:
    """The base's vocabulary, special tokens and chat template, so llama.cpp's chat mode needs no
    extra flags. tokenizer.json decides the kind, as in llama.cpp's LlamaModel.set_vocab: a BPE
    with byte fallback is a SentencePiece vocabulary (Llama 2, Mistral, and what transformers makes
    of such a GGUF), anything else a GPT-2-style byte-level BPE (Llama 3, Qwen2/3,
    SmolLM)."""
    import gguf
    from transformers import AutoTokenizer

    if not (model_dir / "tokenizer.json").is_file():
        raise UserError(f"{model_dir}: no tokenizer.json; GGUF export needs the base's fast "
                        "tokenizer beside its weights (save it with transformers' save_pretrained)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    sentencepiece = spec["model"].get("type") == "BPE" and bool(spec["model"].get("byte_fallback"))
    if sentencepiece:
        _add_sentencepiece_vocab(writer, tokenizer, spec, vocab_size)
    else:
        _add_gpt2_vocab(writer, tokenizer, spec, model_dir, vocab_size)
    # llama.cpp's converters load merges for the GPT-2 kind only; its SentencePiece tokenizer ranks
    # by the scores written above.
    special = gguf.SpecialVocab(model_dir, load_merges=not sentencepiece, n_vocab=vocab_size)
    # Tokenizers saved by transformers 5 keep add_bos_token in the post-processor, not in
    # tokenizer_config.json where SpecialVocab looks: say what the tokenizer really does.
    probe = tokenizer("a").input_ids
    special.add_special_token.setdefault("bos", bool(probe) and probe[0] == tokenizer.bos_token_id
                                         and tokenizer.bos_token_id is not None)
    special.add_to_gguf(writer, quiet=True)


def _gpt2_pre_tokenizer(tokenizer: Any, spec: dict[str, Any], model_dir: Path) -> str:
    digest = sha256(str(tokenizer.encode(_CHECK_TEXT)).encode()).hexdigest()
    pre = _PRE_TOKENIZERS.get(digest) or _pre_tokenizer_by_rule(spec)
    if pre is None:
        raise UserError(f"{model_dir}/tokenizer.json: its pre-tokenizer is not one llama.cpp knows for "
                        f"the supported families (check hash {digest[:16]}); byte-level BPE export "
                        "works for Llama 3, Qwen2/3, SmolLM and GPT-4o-style (Phi-4 mini) tokenizers")
    return pre


def _token_table(tokenizer: Any, vocab_size: int, sentencepiece: bool) -> tuple[list[str], list[int]]:
    """Tokens and llama.cpp token types for every id below vocab_size (llama.cpp's get_vocab_base
    and _create_vocab_sentencepiece): ids the tokenizer lacks are unused [PADn] pieces; a
    SentencePiece vocabulary also types its unknown piece and its <0xNN> byte pieces."""
    import gguf

    reverse = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for index in range(vocab_size):
        token = reverse.get(index)
        tokens.append(f"[PAD{index}]" if token is None else token)
        if token is None:
            types.append(gguf.TokenType.UNUSED)
        elif sentencepiece and index == tokenizer.unk_token_id:
            types.append(gguf.TokenType.UNKNOWN)
        elif index in added:
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        elif sentencepiece and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _add_gpt2_vocab(writer: Any, tokenizer: Any, spec: dict[str, Any], model_dir: Path,
                    vocab_size: int) -> None:
    """llama.cpp's _set_vocab_gpt2: tokens, types and the pre-tokenizer; merges come with
    SpecialVocab."""
    pre = _gpt2_pre_tokenizer(tokenizer, spec, model_dir)
    tokens, types = _token_table(tokenizer, vocab_size, sentencepiece=False)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def adds_space_prefix(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer puts "▁" before the text: a Metaspace pre-tokenizer (transformers'
    current Llama converter) or a Prepend normalizer (the legacy one of Llama 2 and Mistral 7B)."""
    def steps(part: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
        return [] if not part else part.get(key) or [part]

    for step in steps(spec.get("pre_tokenizer"), "pretokenizers"):
        if step.get("type") == "Metaspace":
            return step.get("prepend_scheme", "always") != "never" and step.get("add_prefix_space", True)
    return any(step.get("type") == "Prepend" for step in steps(spec.get("normalizer"), "normalizers"))


def _add_sentencepiece_vocab(writer: Any, tokenizer: Any, spec: dict[str, Any], vocab_size: int) -> None:
    """llama.cpp's SentencePiece ("llama") vocabulary from tokenizer.json.

    llama.cpp's tokenizer joins the adjacent pair whose joined piece scores highest; the BPE of
    tokenizer.json applies the merge of lowest rank. Scoring each piece minus the rank of the first
    merge that makes it orders both alike, so llama.cpp splits text as sentencepiece does. (llama.cpp's
    converter reads sentencepiece's scores from tokenizer.model where there is one, and without one
    scores every piece -1000, which splits differently; tokenizer.json is always there.)"""
    merges = spec["model"].get("merges") or []
    rank: dict[str, int] = {}
    for index, merge in enumerate(merges):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        rank.setdefault(left + right, index)
    tokens, types = _token_table(tokenizer, vocab_size, sentencepiece=True)
    # Pieces no merge makes (single characters, bytes, specials) never win a join: they sort last.
    scores = [-float(rank.get(token, len(merges) + index)) for index, token in enumerate(tokens)]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(adds_space_prefix(spec))
