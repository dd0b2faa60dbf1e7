"""Scoring a task (cpudist.data.tasks) with a session's model: `cpudist eval --task FILE`.

Multiple choice is scored as lm-evaluation-harness's `multiple_choice` output type: each choice's
summed log-likelihood given the prompt; acc takes the highest, acc_norm the highest per UTF-8 byte
of the choice (so long answers are not penalised for their length). QA items are answered greedily
(a short max_new_tokens) and scored by exact match of the first line after SQuAD's normalisation.

JSONL tasks render the question as a user turn with the tokenizer's chat template, and a choice as
the assistant's answer, exactly as training renders a conversation; harness YAML tasks keep the
harness's plain layout (prompt text, target_delimiter, choice).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from cpudist.data.formats import to_sample
from cpudist.data.tasks import Task, TaskItem
from cpudist.data.tokenize import IGNORE, tokenize_conversation
from cpudist.infer.generate import generate, prompt_ids
from cpudist.infer.session import Session

# (input ids [rows, T], attention mask [rows, T]) -> logits [rows, T, vocab]
LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def continuation_logprobs(logits_fn: LogitsFn, context: list[int], continuations: list[list[int]],
                          pad_id: int) -> list[float]:
    """Sum of log p(continuation tokens | context) for each continuation, in one padded batch
    (right padding: positions and the causal mask of the real tokens are unchanged)."""
    rows = [context + c for c in continuations]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    logprobs = torch.log_softmax(logits_fn(ids, mask).float(), dim=-1)
    sums = []
    for i, continuation in enumerate(continuations):
        # The token at position p is predicted by the logits at p - 1.
        positions = torch.arange(len(context) - 1, len(context) - 1 + len(continuation))
        sums.append(float(logprobs[i, positions, torch.tensor(continuation)].sum()))
    return sums


def multiple_choice_scores(logprobs: list[float], choices: list[str], gold: int
                           ) -> dict[str, float]:
    """acc and acc_norm (log-likelihood per UTF-8 byte of the choice) of one item: 1.0 or 0.0."""
    best = max(range(len(choices)), key=lambda i: logprobs[i])
    best_norm = max(range(len(choices)),
                    key=lambda i: logprobs[i] / max(len(choices[i].encode("utf-8")), 1))
    return {"acc": float(best == gold), "acc_norm": float(best_norm == gold)}


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(generated: str, answers: list[str]) -> float:
    """1.0 when the first non-empty line of the generation equals an accepted answer (both
    normalised), else 0.0."""
    first = next((line for line in generated.splitlines() if line.strip()), "")
    return float(normalize_answer(first) in {normalize_answer(a) for a in answers})


# --------------------------------------------------------------------------- with a model


def _chat_pair(tokenizer: Any, question: str, answer: str, system: str | None
               ) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a user turn and its answer, as training renders them."""
    messages = to_sample({"messages": [{"role": "user", "content": question},
                                       {"role": "assistant", "content": answer}]},
                         "chat", "task", system)
    assert isinstance(messages, list)
    ids, labels = tokenize_conversation(tokenizer, messages)
    labelled = [i for i, label in enumerate(labels) if label != IGNORE]
    return ids[: labelled[0]], ids[labelled[0] : labelled[-1] + 1]


def _plain_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's encoding: trailing spaces of the context move to the continuation, and the
    continuation's tokens are those of the whole text past the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    start = tokenizer(context, add_special_tokens=False)["input_ids"]
    if not start:  # nothing to condition on: the harness starts from the end-of-text token
        return [tokenizer.eos_token_id], whole
    return start, whole[len(start):]


def _logits_fn(session: Session) -> LogitsFn:
    def logits(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with session.precision.autocast():
            return session.model(input_ids=ids, attention_mask=mask).logits

    return logits


def _score_item(session: Session, task: Task, item: TaskItem, system: str | None,
                max_new_tokens: int) -> dict[str, float]:
    tokenizer = session.tokenizer
    if task.kind == "multiple_choice":
        if task.harness:
            pairs = [_plain_pair(tokenizer, item.question, task.delimiter + c)
                     for c in item.choices]
        else:
            pairs = [_chat_pair(tokenizer, item.question, c, system) for c in item.choices]
        context = pairs[0][0]
        # The chat template renders the prompt the same whatever the answer; check, not assume.
        assert all(p[0] == context for p in pairs), item.where
        logprobs = continuation_logprobs(_logits_fn(session), context, [p[1] for p in pairs],
                                         session.pad_id)
        return multiple_choice_scores(logprobs, item.choices, item.gold)
    ids = (tokenizer(item.question, add_special_tokens=False)["input_ids"] if task.harness
           else prompt_ids(tokenizer, item.question, system))
    return {"exact_match": exact_match(generate(session, ids, max_new_tokens), item.answers)}


@contextmanager
def base_only(session: Session) -> Iterator[None]:
    """The session's model computing as its base alone (peft's adapters disabled)."""
    with session.model.disable_adapter():
        yield


def evaluate_task(session: Session, task: Task, system: str | None = None,
                  max_new_tokens: int = 32) -> dict[str, Any]:
    """The task's metrics (mean over items) for the base alone and, when the session holds an
    adapter, for base + adapter: {"base": {...}, "adapter": {...}}."""
    model = session.model
    model.eval()
    has_adapter = hasattr(model, "disable_adapter")
    result: dict[str, Any] = {}
    for label, context in (("base", base_only(session) if has_adapter else nullcontext()),
                           ("adapter", nullcontext() if has_adapter else None)):
        if context is None:
            continue
        with context:
            scores = [_score_item(session, task, item, system, max_new_tokens)
                      for item in task.items]
        result[label] = {metric: sum(s[metric] for s in scores) / len(scores)
                         for metric in scores[0]}
    return result
