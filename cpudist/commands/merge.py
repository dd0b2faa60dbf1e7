"""`cpudist merge --base MODEL --adapter DIR --out DIR`: the adapter folded into its base."""

from __future__ import annotations

import argparse

from cpudist.commands.common import add_model_arguments, add_quantize_arguments, trained_model

HELP = "fold a LoRA adapter into its base model (plain Hugging Face directory)"
DESCRIPTION = ("Write base + adapter as one model directory (safetensors, config, tokenizer) that "
               "AutoModelForCausalLM.from_pretrained loads without peft.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, adapter_required=True)
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype of the saved weights (merging is done in float32)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    add_quantize_arguments(parser)
    parser.add_argument("--run-dtype", choices=["auto", "float32", "bfloat16"],
                        help="model.dtype of a quantized run (default: the adapter's run): its "
                             "scales were stored in that dtype")


def run(args: argparse.Namespace) -> int:
    from cpudist.model.merge import merge
    from cpudist.runtime.process import quiet_libraries

    quiet_libraries()
    from cpudist.model.adapters import check_mergeable, resolve_adapter

    check_mergeable(resolve_adapter(args.adapter), "cpudist merge")  # before the slow checks
    chosen = trained_model(args, args.run_dtype)
    assert chosen.adapter is not None  # --adapter is required
    target = merge(chosen.model, chosen.adapter, args.out, args.dtype, args.force)
    print(f"merged model written to {target}")
    return 0
