"""One render per conversation (chat_spans.py): the token ids and labels are exactly those of
rendering every prompt and prompt + answer, for templates that qualify and for those that don't."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from cpudist.data.chat_spans import MARK, template_plan
from cpudist.data.tokenize import _tokenize_conversation
from tests.data.test_tokenize import QWEN3_TEMPLATE

SYSTEM = {"role": "system", "content": "You answer briefly."}

# ChatML as many current models write it: strip signs, a BOS head, the system turn read through
# messages[0], a default system prompt on the first turn, written on several lines.
CHATML = """{{- bos_token }}
{%- for message in messages %}
    {%- if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\\nDefault.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

# A template that writes an answer differently once a later turn follows (as Qwen3 drops earlier
# reasoning), through loop.last.
SUMMARISING = ("{% for message in messages %}<|im_start|>{{ message.role }}\n"
               "{% if message.role == 'assistant' and not loop.last %}(earlier answer)"
               "{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The generation prompt depends on the messages (after the loop): not a constant tail.
LAST_ROLE = ("{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
             "<|im_end|>\n{% endfor %}{% if add_generation_prompt and messages[-1].role == 'user' %}"
             "<|im_start|>assistant\n{% endif %}")
# A header that a longer conversation gets: the head changes as later turns follow.
HEADED = ("{% if messages|length > 2 %}[multi-turn]\n{% endif %}{% for message in messages %}"
          "{{ message.role }}: {{ message.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def smol(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _with_template(smol: Any, template: str) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(smol.name_or_path)
    tokenizer.chat_template = template
    return tokenizer


def _conversations(language: str, cache: Path) -> list[list[dict[str, str]]]:
    """chatterbot's pairs as they come, and joined three by three into multi-turn
    conversations, with and without a system turn."""
    from cpudist.data.read import read_records, resolve_data_path

    pairs = [row["messages"] for row in read_records(resolve_data_path(f"chatterbot:{language}",
                                                                       str(cache)))]
    joined = [[message for pair in pairs[start:start + 3] for message in pair]
              for start in range(0, len(pairs) - 2, 3)]
    return pairs + joined + [[SYSTEM, *conversation] for conversation in joined]


def _renders(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the tokenizer's chat template renders."""
    calls = [0]
    render = tokenizer.apply_chat_template

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return render(*args, **kwargs)
    monkeypatch.setattr(tokenizer, "apply_chat_template", counted)
    return calls


@pytest.mark.parametrize("language", ["english", "chinese"])
def test_one_render_per_conversation_gives_the_exact_ids_and_labels(
        smol: Any, language: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conversations = _conversations(language, tmp_path)
    exact = [_tokenize_conversation(smol, messages, derive=False) for messages in conversations]
    calls = _renders(smol, monkeypatch)
    derived = [_tokenize_conversation(smol, messages) for messages in conversations]
    assert derived == exact
    # One render a conversation (and one more, once per template, for its generation prompt).
    assert len(conversations) <= calls[0] <= len(conversations) + 1
    assert sum(last_only for _, _, last_only in exact) == 0


@pytest.mark.parametrize("template", [CHATML, SUMMARISING, LAST_ROLE, HEADED, QWEN3_TEMPLATE],
                         ids=["chatml", "summarising", "last-role", "headed", "qwen3"])
def test_templates_that_rewrite_earlier_turns_are_rendered_prefix_by_prefix(
        smol: Any, template: str, tmp_path: Path) -> None:
    tokenizer = _with_template(smol, template)
    assert (template_plan(tokenizer) is not None) == (template is CHATML)
    conversations = _conversations("english", tmp_path)[-40:]
    conversations.append([{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."},
                          {"role": "user", "content": "Q2?"}, {"role": "assistant", "content": "B."},
                          {"role": "user", "content": "left unanswered"}])
    exact = [_tokenize_conversation(tokenizer, messages, derive=False) for messages in conversations]
    assert [_tokenize_conversation(tokenizer, messages) for messages in conversations] == exact
    if template in (SUMMARISING, HEADED):  # the rewriting is seen: only the last answer has loss
        assert all(last_only for _, _, last_only in exact[-20:])


def test_a_row_that_holds_the_marker_is_rendered_the_exact_way(
        smol: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = [{"role": "user", "content": f"odd {MARK} text"}, {"role": "assistant", "content": "A."},
                {"role": "user", "content": "Q?"}, {"role": "assistant", "content": f"B{MARK}."}]
    exact = _tokenize_conversation(smol, messages, derive=False)
    calls = _renders(smol, monkeypatch)
    assert _tokenize_conversation(smol, messages) == exact
    assert calls[0] == 1 + 4  # the marked render, then the two prompts and two answers
