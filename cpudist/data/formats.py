"""Data formats: one function per format turns a record into a sample, registered in FORMATS.

For supervised fine-tuning a sample is a conversation (a list of {role, content} messages; only
assistant turns carry loss) or a plain string (every token carries loss); a classification record
is a LabelledText; the preference format gives a PreferencePair (a prompt, a chosen and a rejected
answer) for train.objective=dpo or orpo. To add a format, write `def name(row, where)` that
returns one, raising UserError that names `where` (FILE:LINE) for a record that does not fit,
register it in FORMATS (`data.format=name` then reads it, and the config accepts the name) and,
when it is not an SFT format, name the objectives that read it in FORMAT_OBJECTIVES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpudist.errors import UserError

Messages = list[dict[str, str]]
Sample = Messages | str


def alpaca(row: dict[str, Any], where: str) -> Messages:
    """instruction (+ optional input) -> output."""
    missing = [key for key in ("instruction", "output") if key not in row]
    if missing:
        raise UserError(f"{where}: data.format=alpaca needs fields instruction and output "
                        f"(input optional); missing {', '.join(missing)}")
    prompt = str(row["instruction"])
    if row.get("input"):
        prompt += "\n\n" + str(row["input"])
    return [{"role": "user", "content": prompt},
            {"role": "assistant", "content": str(row["output"])}]


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "model": "assistant"}


def chat(row: dict[str, Any], where: str) -> Messages:
    """'messages' (role/content), or ShareGPT 'conversations' (from/value)."""
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise UserError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    if "conversations" in row:
        turns = row["conversations"]
        try:
            return [{"role": SHAREGPT_ROLES[t["from"]], "content": str(t["value"])} for t in turns]
        except (KeyError, TypeError):
            raise UserError(f"{where}: 'conversations' must be a list of {{from, value}} objects "
                            f"with from in {sorted(SHAREGPT_ROLES)}") from None
    raise UserError(f"{where}: data.format=chat needs a 'messages' (or ShareGPT 'conversations') "
                    f"field; found {sorted(row)}")


def text(row: dict[str, Any], where: str) -> str:
    """'text': plain text, every token a label."""
    if "text" not in row:
        raise UserError(f"{where}: data.format=text needs a 'text' field; found {sorted(row)}")
    return str(row["text"])


@dataclass(frozen=True)
class LabelledText:
    """A classification record: a text (and optionally a second one, such as a question and its
    context), and its label names (one, or several for multi-label rows)."""

    text: str
    text_pair: str | None
    labels: tuple[str, ...]
    multi_label: bool


def classification(row: dict[str, Any], where: str) -> LabelledText:
    """'text' (and optional 'text_pair') with 'label' (one name) or 'labels' (a list of names)."""
    if "text" not in row:
        raise UserError(f"{where}: data.format=classification needs a 'text' field; found "
                        f"{sorted(row)}")
    if "labels" in row:
        labels = row["labels"]
        if not isinstance(labels, list) or not all(isinstance(x, (str, int)) for x in labels):
            raise UserError(f"{where}: 'labels' must be a list of label names")
        if not labels:
            raise UserError(f"{where}: 'labels' is empty; a multi-label row needs at least one "
                            "label (leave the row out if none applies)")
        names, multi = tuple(str(x) for x in labels), True
    elif "label" in row and isinstance(row["label"], (str, int)) and not isinstance(row["label"], bool):
        names, multi = (str(row["label"]),), False
    else:
        raise UserError(f"{where}: data.format=classification needs a 'label' (a name) or "
                        f"'labels' (a list of names) field; found {sorted(row)}")
    pair = row.get("text_pair")
    return LabelledText(str(row["text"]), None if pair is None else str(pair), names, multi)


@dataclass(frozen=True)
class PreferencePair:
    """A prompt and two answers to it, the chosen one better (train.objective=dpo or orpo).
    A conversation's prompt is rendered with the chat template; a plain string is plain text."""

    prompt: Messages | str
    chosen: str
    rejected: str


def _answer(value: Any, key: str, where: str) -> str:
    """An answer given as a string, or as TRL writes it: a list of one assistant message."""
    if isinstance(value, str):
        return value
    if (isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)
            and value[0].get("role") == "assistant" and "content" in value[0]):
        return str(value[0]["content"])
    raise UserError(f"{where}: '{key}' must be a string or a list of one assistant message "
                    "[{\"role\": \"assistant\", \"content\": ...}]")


def preference(row: dict[str, Any], where: str) -> PreferencePair:
    """'prompt' (a string, or chat messages), 'chosen' and 'rejected' (strings, or a list of one
    assistant message each): a pair for train.objective=dpo or orpo."""
    missing = [key for key in ("prompt", "chosen", "rejected") if row.get(key) is None]
    if missing:
        raise UserError(f"{where}: data.format=preference needs fields prompt, chosen and rejected; "
                        f"missing {', '.join(missing)}")
    chosen = _answer(row["chosen"], "chosen", where)
    rejected = _answer(row["rejected"], "rejected", where)
    prompt = row["prompt"]
    if isinstance(prompt, list):
        prompt = chat({"messages": prompt}, where)
    elif not isinstance(prompt, str):
        raise UserError(f"{where}: 'prompt' must be a string or a list of {{role, content}} messages")
    elif not isinstance(row["chosen"], str):  # answers as messages: the prompt is a user turn
        prompt = [{"role": "user", "content": prompt}]
    return PreferencePair(prompt, chosen, rejected)


# data.format name -> the function that reads a record of that format.
FORMATS: dict[str, Callable[[dict[str, Any], str], Any]] = {
    "alpaca": alpaca, "chat": chat, "text": text, "classification": classification,
    "preference": preference}

# data.format name -> the objectives that read it (train.objective=auto takes the first);
# a format not named here is read by sft.
FORMAT_OBJECTIVES: dict[str, tuple[str, ...]] = {"classification": ("classification",),
                                                 "preference": ("dpo", "orpo")}


def objectives_of(fmt: str) -> tuple[str, ...]:
    """The objectives that train on records of data.format=fmt, the one auto picks first."""
    return FORMAT_OBJECTIVES.get(fmt, ("sft",))


def to_sample(row: dict[str, Any], fmt: str, where: str, system: str | None
              ) -> Sample | PreferencePair:
    """The record as a sample of format fmt, with the system prompt first in a conversation."""
    sample = FORMATS[fmt](row, where)
    if isinstance(sample, list) and system and (not sample or sample[0]["role"] != "system"):
        sample = [{"role": "system", "content": system}, *sample]
    return sample
