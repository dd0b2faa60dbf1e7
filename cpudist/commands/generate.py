"""`cpudist generate --base MODEL [--adapter DIR] PROMPT`: an answer, streamed."""

from __future__ import annotations

import argparse
import sys

from cpudist.commands.common import (
    add_model_arguments,
    add_quantize_arguments,
    positive_int,
    trained_model,
)

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
    from cpudist.config import Config, DistConfig
    from cpudist.infer.generate import generate, prompt_ids
    from cpudist.infer.session import open_session
    from cpudist.model.adapters import check_generative
    from cpudist.runtime.process import start_process

    chosen = trained_model(args, args.dtype, {"data.system_prompt": args.system})
    check_generative(chosen.adapter, "cpudist generate")
    with start_process(DistConfig()) as process:
        session = open_session(Config(model=chosen.model), process, chosen.adapter)
        ids = prompt_ids(session.tokenizer, args.prompt, chosen.settings["data.system_prompt"])
        generate(session, ids, args.max_new_tokens, args.temperature, stream=True)
    sys.stdout.flush()
    return 0
