"""`cpudist merge --base MODEL --adapter DIR --out DIR`: the adapter folded into its base."""

from __future__ import annotations

import argparse
from pathlib import Path

from cpudist.commands.common import (
    ModelChoice,
    add_model_arguments,
    add_quantize_arguments,
    check_choice,
    trained_model,
)
from cpudist.errors import UserError

HELP = "fold a LoRA adapter into its base model (plain Hugging Face directory)"
DESCRIPTION = ("Write base + adapter as one model directory (safetensors, config, tokenizer) that "
               "AutoModelForCausalLM.from_pretrained loads without peft.")

MERGED_DTYPES = ("float32", "bfloat16")  # of the written weights (merging runs in float32)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, adapter_required=True)
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    parser.add_argument("--dtype", choices=MERGED_DTYPES, default="float32",
                        help="dtype of the saved weights (merging is done in float32)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    add_quantize_arguments(parser)
    parser.add_argument("--run-dtype", choices=["auto", "float32", "bfloat16"],
                        help="model.dtype of a quantized run (default: the adapter's run): its "
                             "scales were stored in that dtype")


def run(args: argparse.Namespace) -> int:
    target = merge_adapter(ModelChoice.of(args), args.out, dtype=args.dtype, force=args.force,
                           run_dtype=args.run_dtype)
    print(f"merged model written to {target}")
    return 0


def merge_adapter(choice: ModelChoice, out: str | Path, *, dtype: str = "float32",
                  force: bool = False, run_dtype: str | None = None) -> Path:
    """The adapter folded into its base, written to `out` as a plain Hugging Face directory
    (weights in `dtype`); run_dtype: model.dtype of a quantized run (default: the adapter's)."""
    from cpudist.model.merge import merge
    from cpudist.runtime.process import quiet_libraries

    quiet_libraries()
    from cpudist.model.adapters import check_mergeable, resolve_adapter

    if choice.adapter is None:
        raise UserError("merge needs an adapter: pass --adapter DIR (OUTPUT/adapter of a run)")
    check_choice("dtype", dtype, MERGED_DTYPES)
    check_mergeable(resolve_adapter(str(choice.adapter)), "cpudist merge")  # before slow checks
    chosen = trained_model(choice, run_dtype)
    assert chosen.adapter is not None
    return merge(chosen.model, chosen.adapter, out, dtype, force)
