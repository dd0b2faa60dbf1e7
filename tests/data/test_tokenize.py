"""Tokenizing: each format, prompt masking exactly where expected, truncation counted, the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cpudist.config import DataConfig
from cpudist.data.tokenize import IGNORE, build_datasets, tokenize_records
from tests.helpers import write_jsonl


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _text(tokenizer, ids: list[int]) -> str:  # noqa: ANN001
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_chat_masks_everything_but_the_answer(tokenizer) -> None:  # noqa: ANN001
    rows = [{"messages": [{"role": "user", "content": "Hi there?"},
                          {"role": "assistant", "content": "Hello, friend."}]}]
    split, stats = tokenize_records(rows, tokenizer, DataConfig(format="chat"), "mem.jsonl")
    ids, labels = split.input_ids[0], split.labels[0]
    full = tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert _text(tokenizer, ids) == full
    answer = [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE]
    assert _text(tokenizer, answer) == "Hello, friend.<|im_end|>\n"
    first = labels.index(next(lab for lab in labels if lab != IGNORE))
    # Every label is either masked or equal to its input token; masked ones form the prompt prefix.
    assert all(lab in (IGNORE, tok) for tok, lab in zip(ids, labels, strict=True))
    assert all(lab == IGNORE for lab in labels[:first])
    assert _text(tokenizer, ids[:first]).endswith("<|im_start|>assistant\n")
    assert stats.truncated == 0


def test_multi_turn_chat_and_sharegpt_agree(tokenizer) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "One."},
                {"role": "user", "content": "B?"}, {"role": "assistant", "content": "Two."}]
    sharegpt = {"conversations": [{"from": "human" if m["role"] == "user" else "gpt",
                                   "value": m["content"]} for m in messages]}
    a, _ = tokenize_records([{"messages": messages}], tokenizer, DataConfig(), "x.jsonl")
    b, _ = tokenize_records([sharegpt], tokenizer, DataConfig(), "x.jsonl")
    assert a.input_ids == b.input_ids and a.labels == b.labels
    answer = [t for t, lab in zip(a.input_ids[0], a.labels[0], strict=True) if lab != IGNORE]
    assert _text(tokenizer, answer) == "One.<|im_end|>\nTwo.<|im_end|>\n"


def test_alpaca_uses_input_and_masks_prompt(tokenizer) -> None:  # noqa: ANN001
    rows = [{"instruction": "Translate", "input": "chat", "output": "cat"}]
    split, _ = tokenize_records(rows, tokenizer, DataConfig(format="alpaca"), "x.jsonl")
    text = _text(tokenizer, split.input_ids[0])
    assert "Translate\n\nchat" in text
    answer = [t for t, lab in zip(split.input_ids[0], split.labels[0], strict=True) if lab != IGNORE]
    assert _text(tokenizer, answer) == "cat<|im_end|>\n"


def test_text_format_every_token_is_a_label(tokenizer) -> None:  # noqa: ANN001
    split, _ = tokenize_records([{"text": "plain words here"}], tokenizer, DataConfig(format="text"),
                                "x.jsonl")
    assert split.labels[0] == split.input_ids[0]
    assert split.input_ids[0][-1] == tokenizer.eos_token_id


def test_truncation_is_counted_and_empty_answers_dropped(tokenizer) -> None:  # noqa: ANN001
    long_answer = "word " * 200
    rows = [{"messages": [{"role": "user", "content": "short?"},
                          {"role": "assistant", "content": long_answer}]},
            {"messages": [{"role": "user", "content": "q " * 300},
                          {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "ok?"},
                          {"role": "assistant", "content": "yes"}]}]
    split, stats = tokenize_records(rows, tokenizer, DataConfig(max_length=64), "x.jsonl")
    assert stats.truncated == 2
    assert stats.dropped_no_labels == 1  # the prompt alone filled max_length
    assert len(split) == 2 and all(len(ids) <= 64 for ids in split.input_ids)


def test_build_caches_tokens_and_holds_out_validation(tokenizer, tmp_path: Path) -> None:  # noqa: ANN001
    rows = [{"text": f"sample number {i}"} for i in range(40)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    config = DataConfig(path=str(data), format="text", val_fraction=0.25,
                        cache_dir=str(tmp_path / "cache"))
    train, val, stats = build_datasets(config, tokenizer, seed=3)
    assert (len(train), len(val)) == (30, 10)
    (cached,) = [p for p in (tmp_path / "cache").glob("d-*") if p.is_dir()]
    stamp = (cached / "stats.json").stat().st_mtime_ns
    train2, val2, _ = build_datasets(config, tokenizer, seed=3)
    assert (cached / "stats.json").stat().st_mtime_ns == stamp  # read from cache, not re-tokenized
    assert train2.input_ids == train.input_ids and val2.input_ids == val.input_ids
    assert not set(map(tuple, train.input_ids)) & set(map(tuple, val.input_ids))


def test_cache_is_not_reused_when_the_tokenizer_tokenizes_differently(tokenizer_dir: Path,
                                                                      tmp_path: Path) -> None:
    # Same vocabulary and chat template, but a post-processor that adds a BOS token: the cached
    # token ids of the first tokenizer must not be served to the second.
    from tokenizers.processors import TemplateProcessing

    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(8)]
    config = DataConfig(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), format="chat",
                        val_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    plain = AutoTokenizer.from_pretrained(tokenizer_dir)
    with_bos = AutoTokenizer.from_pretrained(tokenizer_dir)
    bos = with_bos.convert_tokens_to_ids("<|im_start|>")
    with_bos._tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    first, _, _ = build_datasets(config, plain, seed=0)
    second, _, _ = build_datasets(config, with_bos, seed=0)
    assert len(list((tmp_path / "cache").glob("d-*/stats.json"))) == 2
    assert first.input_ids[0][0] == bos and first.input_ids[0][1] != bos
    # The chat template writes the conversation's special tokens; the tokenizer's own BOS is not
    # added on top of them (apply_chat_template(tokenize=True) does the same).
    assert second.input_ids == first.input_ids


# Chat templates of SentencePiece-tokenizer models: Mistral 7B Instruct v0.1 (answer glued to
# "[/INST]") and Llama 2 chat (answer after a space); both write the BOS themselves.
SENTENCEPIECE_TEMPLATES = {
    "mistral": "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
               "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
               "{{ message['content'] + eos_token }}{% endif %}{% endfor %}",
    "llama-2": "{% for message in messages %}{% if message['role'] == 'user' %}"
               "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
               "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
               "{% endif %}{% endfor %}",
}
TWO_TURNS = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "Paris is the capital."},
             {"role": "user", "content": "And of Spain?"}, {"role": "assistant", "content": "Madrid."}]


@pytest.mark.parametrize("template", sorted(SENTENCEPIECE_TEMPLATES))
def test_sentencepiece_chat_is_tokenized_as_generation_sees_it(spm_tokenizer_dir: Path,
                                                               template: str) -> None:
    """The ids are the whole conversation's, as apply_chat_template tokenizes it (one BOS, the
    answer split as it follows its prompt), and the labels are exactly the answers' tokens."""
    from cpudist.data.tokenize import tokenize_conversation

    tokenizer = AutoTokenizer.from_pretrained(spm_tokenizer_dir)
    tokenizer.chat_template = SENTENCEPIECE_TEMPLATES[template]
    ids, labels = tokenize_conversation(tokenizer, TWO_TURNS)
    assert ids == tokenizer.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=False)
    # Llama 2 writes a BOS before each user turn, Mistral one for the whole conversation.
    assert ids.count(tokenizer.bos_token_id) == (2 if template == "llama-2" else 1)
    answers = [token for token, label in zip(ids, labels, strict=True) if label != IGNORE]
    assert all(label in (IGNORE, token) for token, label in zip(ids, labels, strict=True))
    assert _text(tokenizer, answers) == ("Paris is the capital.</s>Madrid.</s>" if template == "mistral"
                                         else "Paris is the capital. </s> Madrid. </s>")
    # The prompt a generation starts from is the prompt training saw.
    prompt = tokenizer.apply_chat_template(TWO_TURNS[:1], tokenize=True, add_generation_prompt=True,
                                           return_dict=False)
    assert ids[:len(prompt)] == prompt and labels[len(prompt)] != IGNORE


def test_a_tokenizer_without_offsets_is_tokenized_piece_by_piece(tokenizer) -> None:  # noqa: ANN001
    """Without offsets each prompt and answer is tokenized on its own; for a byte-level BPE that
    splits at the seams anyway, the result is the whole conversation's."""
    from cpudist.data.tokenize import tokenize_conversation

    class WithoutOffsets:
        is_fast = False

        def __getattr__(self, name: str) -> object:
            return getattr(tokenizer, name)

        def __call__(self, text: str, **kwargs: object) -> object:
            assert "return_offsets_mapping" not in kwargs
            return tokenizer(text, **kwargs)

    assert tokenize_conversation(WithoutOffsets(), TWO_TURNS) == tokenize_conversation(tokenizer, TWO_TURNS)


# Qwen3's chat template (tools left out): an answer after the last user turn is rendered with its
# reasoning block, an earlier one without, so a later turn rewrites the earlier ones.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if loop.index0 > ns.last_query_index and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + message.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_template_that_rewrites_earlier_turns_trains_on_the_last_answer(tokenizer) -> None:  # noqa: ANN001
    """Qwen3 renders an answer differently once a later turn follows: such a conversation is
    tokenized as the template renders it whole, and only its last answer (the one rendered as
    generation produces it) carries loss; a one-answer conversation is as before."""
    from cpudist.data.tokenize import tokenize_conversation

    qwen3 = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    qwen3.chat_template = QWEN3_TEMPLATE
    ids, labels = tokenize_conversation(qwen3, TWO_TURNS)
    assert ids == qwen3.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=False)
    answer = [token for token, label in zip(ids, labels, strict=True) if label != IGNORE]
    assert _text(qwen3, answer) == "<think>\n\n</think>\n\nMadrid.<|im_end|>\n"
    rows = [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[:2]}]
    split, stats = tokenize_records(rows, qwen3, DataConfig(format="chat"), "x.jsonl")
    assert stats.last_answer_only == 1
    one = [token for token, label in zip(split.input_ids[1], split.labels[1], strict=True) if label != IGNORE]
    assert _text(qwen3, one) == "<think>\n\n</think>\n\nParis is the capital.<|im_end|>\n"


def test_a_conversation_the_template_refuses_is_a_one_line_error_naming_the_record(
        tokenizer) -> None:  # noqa: ANN001
    from cpudist.errors import UserError

    strict = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    strict.chat_template = (  # Mistral v0.1's check: user and assistant alternate, nothing else
        "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ message['content'] }}{% endfor %}")
    good = {"messages": TWO_TURNS[:2]}
    with_system = {"messages": [{"role": "system", "content": "Be brief."}, *TWO_TURNS[:2]]}
    with pytest.raises(UserError) as error:
        tokenize_records([good, with_system], strict, DataConfig(format="chat"), "data.jsonl")
    message = str(error.value)
    assert message.startswith("data.jsonl:2: the tokenizer's chat template refused")
    assert "Conversation roles must alternate" in message and "\n" not in message
