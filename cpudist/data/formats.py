"""Data formats: one function per format turns a record into a sample, registered in FORMATS.

A sample is a conversation (a list of {role, content} messages; only assistant turns carry loss)
or a plain string (every token carries loss). To add a format, write `def name(row, where)` that
returns one, raising UserError that names `where` (FILE:LINE) for a record that does not fit, and
register it in FORMATS: `data.format=name` then reads it, and the config accepts the name.
"""

from __future__ import annotations

from collections.abc import Callable
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


# data.format name -> the function that reads a record of that format.
FORMATS: dict[str, Callable[[dict[str, Any], str], Sample]] = {
    "alpaca": alpaca, "chat": chat, "text": text}


def to_sample(row: dict[str, Any], fmt: str, where: str, system: str | None) -> Sample:
    """The record as a sample of format fmt, with the system prompt first in a conversation."""
    sample = FORMATS[fmt](row, where)
    if isinstance(sample, list) and system and (not sample or sample[0]["role"] != "system"):
        sample = [{"role": "system", "content": system}, *sample]
    return sample
