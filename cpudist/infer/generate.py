"""Generation: `cpudist generate`, and the held-out questions a run answers before and after
training. Prompts are rendered exactly as training renders a user turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cpudist.data.formats import to_sample
from cpudist.data.tokenize import IGNORE, tokenize_conversation
from cpudist.infer.session import Session


def prompt_ids(tokenizer: Any, prompt: str, system: str | None) -> list[int]:
    """The prompt exactly as training renders a user turn (chat template, or the alpaca layout)."""
    # An empty answer makes tokenize_conversation render the prompt with its generation prefix.
    messages = to_sample({"messages": [{"role": "user", "content": prompt},
                                       {"role": "assistant", "content": ""}]},
                         "chat", "prompt", system)
    assert isinstance(messages, list)
    ids, labels = tokenize_conversation(tokenizer, messages)
    first = next((i for i, label in enumerate(labels) if label != IGNORE), len(ids))
    return ids[:first]


@torch.no_grad()
def generate(session: Session, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             stream: bool = False) -> str:
    """The model's continuation of token ids (greedy, or sampled above temperature 0), decoded."""
    from transformers import TextStreamer

    model, tokenizer = session.model, session.tokenizer
    inputs = torch.tensor([ids])
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature}
    was_training = model.training
    model.eval()
    with session.precision.autocast():
        out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                             max_new_tokens=max_new_tokens, use_cache=True,
                             pad_token_id=session.pad_id, streamer=streamer, **sampling)
    model.train(was_training)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).strip()


def answer_prompts(session: Session, prompts: Sequence[list[int]], max_new_tokens: int) -> list[str]:
    """Greedy answers to prompts given as token ids."""
    return [generate(session, ids, max_new_tokens) for ids in prompts]
