"""`cpudist generate --base MODEL [--adapter DIR] PROMPT`: an answer, streamed."""

from __future__ import annotations

import argparse
import sys

from cpudist.commands.common import (
    ModelChoice,
    add_model_arguments,
    add_quantize_arguments,
    check_positive,
    positive_int,
    trained_model,
)
from cpudist.errors import UserError

HELP = "answer a prompt with a base model (and adapter), streaming tokens"
DESCRIPTION = ("Greedy (or sampled) generation; the prompt is rendered with the tokenizer's chat "
               "template the way training renders a user turn.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_quantize_arguments(parser)
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--system", help="system message (default: data.system_prompt of the "
                                         "adapter's run)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default); above 0 samples")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"],
                        help="model.dtype (default: the adapter's run, else auto)")


def run(args: argparse.Namespace) -> int:
    generate_answer(ModelChoice.of(args), args.prompt, system=args.system,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    dtype=args.dtype, stream=True)
    sys.stdout.flush()
    return 0


def generate_answer(choice: ModelChoice, prompt: str, *, system: str | None = None,
                    max_new_tokens: int = 128, temperature: float = 0.0,
                    dtype: str | None = None, stream: bool = False) -> str:
    """The answer of base (+ adapter) to a user message, rendered as training renders a user turn
    (stream: printed to stdout token by token as well)."""
    from cpudist.config import Config, DistConfig
    from cpudist.infer.generate import generate, prompt_ids
    from cpudist.infer.session import check_generative_model, open_session
    from cpudist.runtime.process import start_process

    check_positive("max_new_tokens", max_new_tokens)
    if not isinstance(temperature, int | float) or temperature < 0:
        raise UserError(f"temperature={temperature!r}: give 0 (greedy) or more")
    chosen = trained_model(choice, dtype, {"data.system_prompt": system})
    check_generative_model(chosen.model, chosen.adapter, "cpudist generate")
    with start_process(DistConfig()) as process:
        session = open_session(Config(model=chosen.model), process, chosen.adapter)
        ids = prompt_ids(session.tokenizer, prompt, chosen.settings["data.system_prompt"])
        return generate(session, ids, max_new_tokens, temperature, stream=stream)
