"""Preference pairs tokenized: a prompt and two answers, cached like SFT's rows (load_columns).

A conversation's prompt is rendered with the chat template and each answer as the assistant turn
after it, the whole tokenized at once (as SFT does): the answer's tokens are those of its span, its
end-of-turn included. A plain-string prompt is plain text, and each answer gets the end-of-sequence
token (as TRL does for its standard format). Only answer tokens carry loss.

Truncation keeps the prompt's end and the answers' starts (TRL's max_prompt_length did this): when
prompt + longer answer exceed data.max_length, the prompt keeps its last tokens, at most what the
longer answer leaves, but never fewer than half of max_length (or all of it, when shorter); the
answers keep their first tokens up to max_length. A prompt that alone fills max_length is dropped
(as TRL drops it), as is a pair whose answers are identical (it teaches nothing); both are counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpudist.config import DataConfig
from cpudist.data.formats import Messages, PreferencePair, to_sample
from cpudist.data.tokenize import ALPACA_TEMPLATE, IGNORE, label_spans, load_columns, render_chat
from cpudist.errors import UserError


@dataclass
class PreferenceSplit:
    """Pairs as token ids: the prompt, and each answer's tokens after it. `reference` holds the
    reference model's log-probabilities of chosen and rejected per pair, once computed."""

    prompt: list[list[int]]
    chosen: list[list[int]]
    rejected: list[list[int]]
    reference: list[tuple[float, float]] | None = field(default=None)

    def __len__(self) -> int:
        return len(self.prompt)

    def lengths(self) -> list[int]:
        """Tokens a pair puts through the model: both sequences."""
        return [2 * len(p) + len(c) + len(r)
                for p, c, r in zip(self.prompt, self.chosen, self.rejected, strict=True)]

    def subset(self, indices: list[int]) -> PreferenceSplit:
        reference = None if self.reference is None else [self.reference[i] for i in indices]
        return PreferenceSplit([self.prompt[i] for i in indices], [self.chosen[i] for i in indices],
                               [self.rejected[i] for i in indices], reference)


def tokenize_pair(tokenizer: Any, pair: PreferencePair) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of a pair, untruncated."""
    prompt, chosen = _prompt_answer(tokenizer, pair.prompt, pair.chosen)
    prompt_r, rejected = _prompt_answer(tokenizer, pair.prompt, pair.rejected)
    # A token that merges across the prompt's end differs between the two: the shorter common
    # prompt is the prompt, the rest belongs to the answers (TRL's common prefix rule).
    common = next((i for i, (a, b) in enumerate(zip(prompt, prompt_r, strict=False)) if a != b),
                  min(len(prompt), len(prompt_r)))
    return prompt[:common], prompt[common:] + chosen, prompt_r[common:] + rejected


def _prompt_answer(tokenizer: Any, prompt: Messages | str, answer: str) -> tuple[list[int], list[int]]:
    """The prompt followed by one answer, tokenized whole: (ids before the answer, answer ids)."""
    if isinstance(prompt, str):
        ids, labels = label_spans(tokenizer, prompt + answer, [(len(prompt), len(prompt + answer))],
                                  add_special_tokens=True)
        ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
    elif tokenizer.chat_template is None:
        text = ALPACA_TEMPLATE.format(instruction="\n\n".join(m["content"] for m in prompt))
        ids, labels = label_spans(tokenizer, text + answer, [(len(text), len(text + answer))],
                                  add_special_tokens=True)
        ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
    else:
        before = render_chat(tokenizer, prompt, generation_prompt=True)
        after = render_chat(tokenizer, [*prompt, {"role": "assistant", "content": answer}],
                            generation_prompt=False)
        if not after.startswith(before):
            raise UserError("the tokenizer's chat template does not render the answer after the "
                            "prompt; give the prompt as a plain string or use a standard template")
        ids, labels = label_spans(tokenizer, after, [(len(before), len(after))],
                                  add_special_tokens=False)
    cut = next((i for i, label in enumerate(labels) if label != IGNORE), len(ids))
    return ids[:cut], ids[cut:]


def truncate_pair(prompt: list[int], chosen: list[int], rejected: list[int], max_length: int
                  ) -> tuple[list[int], list[int], list[int]]:
    """The pair within max_length per sequence: the prompt's end, the answers' starts (see the
    module docstring)."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= max_length:
        return prompt, chosen, rejected
    keep = min(len(prompt), max(max_length - longest, max_length // 2))
    prompt = prompt[len(prompt) - keep :]
    room = max_length - len(prompt)
    return prompt, chosen[:room], rejected[:room]


def pair_columns(rows: list[tuple[str, Any]], tokenizer: Any, config: DataConfig
                 ) -> tuple[dict[str, list[Any]], dict[str, int]]:
    """load_columns' row tokenizer for preference pairs: columns prompt, chosen, rejected."""
    columns: dict[str, list[Any]] = {"prompt": [], "chosen": [], "rejected": []}
    stats = {"samples": len(rows), "truncated": 0, "dropped_long_prompt": 0,
             "dropped_identical": 0}
    for where, row in rows:
        if not isinstance(row, dict):
            raise UserError(f"{where}: each record must be an object")
        pair = to_sample(row, config.format, where, None)
        if not isinstance(pair, PreferencePair):
            raise UserError(f"{where}: train.objective=dpo and orpo need data.format=preference "
                            "(prompt, chosen, rejected)")
        if config.system_prompt and isinstance(pair.prompt, list) and (
                not pair.prompt or pair.prompt[0]["role"] != "system"):
            pair = PreferencePair([{"role": "system", "content": config.system_prompt}, *pair.prompt],
                                  pair.chosen, pair.rejected)
        try:
            prompt, chosen, rejected = tokenize_pair(tokenizer, pair)
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
        if len(prompt) >= config.max_length:
            stats["dropped_long_prompt"] += 1
            continue
        cut = truncate_pair(prompt, chosen, rejected, config.max_length)
        stats["truncated"] += cut != (prompt, chosen, rejected)
        if cut[1] == cut[2]:
            stats["dropped_identical"] += 1
            continue
        for key, ids in zip(("prompt", "chosen", "rejected"), cut, strict=True):
            columns[key].append(ids)
    return columns, stats


def _no_pairs(stats: dict[str, int], source: str, max_length: int) -> str:
    return (f"{source}: no usable pair ({stats['dropped_long_prompt']} prompts fill "
            f"data.max_length={max_length}, {stats['dropped_identical']} pairs "
            "have identical answers); raise data.max_length or fix the data")


def load_pairs(paths: Path | list[Path], tokenizer: Any, config: DataConfig
               ) -> tuple[PreferenceSplit, dict]:
    """Preference files tokenized (cached per node, as SFT's rows)."""
    first = paths if isinstance(paths, Path) else paths[0]
    table, stats = load_columns(paths, tokenizer, config, "preference", pair_columns,
                                lambda counts: _no_pairs(counts, str(first), config.max_length))
    return PreferenceSplit(table["prompt"].to_pylist(), table["chosen"].to_pylist(),
                           table["rejected"].to_pylist()), stats
