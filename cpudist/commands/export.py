"""`cpudist export --base MODEL [--adapter DIR] --out FILE.gguf`: GGUF files for llama.cpp."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from cpudist.commands.common import (
    ModelChoice,
    TrainedModel,
    add_model_arguments,
    add_quantize_arguments,
    check_choice,
    trained_model,
)

if TYPE_CHECKING:
    from cpudist.records import ExportedGGUF

HELP = "write a GGUF file for llama.cpp / Ollama: merged model, base alone, or LoRA adapter alone"
DESCRIPTION = (
    "Without --adapter: the base alone. With --adapter: base and adapter merged into one model, or "
    "with --lora the adapter alone as a GGUF LoRA file that llama.cpp applies on top of the base's "
    "GGUF (`llama-cli -m base.gguf --lora adapter.gguf`). Architectures: Llama (SmolLM2), Mistral, "
    "Qwen2/3, Gemma 1/2/3 (the text model of Gemma 3 with vision), Phi-3 and Phi-4 mini.")


# The GGUF weight types written (cpudist.model.gguf_export.FILE_TYPES maps them to gguf's; listed
# here so `export --help` does not import torch).
TYPE_NAMES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--out", required=True, metavar="FILE", help="GGUF file to write")
    parser.add_argument("--type", choices=TYPE_NAMES, default="f16",
                        help="type of the 2-D weights (norms stay f32); --lora takes f32, f16, bf16 "
                             "or q8_0 (default: f16)")
    parser.add_argument("--lora", action="store_true",
                        help="write the adapter alone (a GGUF LoRA file), not merged")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    add_quantize_arguments(parser)
    parser.add_argument("--run-dtype", choices=["auto", "float32", "bfloat16"],
                        help="model.dtype of a quantized run (default: the adapter's run)")


def run(args: argparse.Namespace) -> int:
    print(export_gguf(ModelChoice.of(args), args.out, file_type=args.type, lora=args.lora,
                      force=args.force, run_dtype=args.run_dtype).line())
    return 0


def export_gguf(choice: ModelChoice, out: str | Path, *, file_type: str = "f16",
                lora: bool = False, force: bool = False, run_dtype: str | None = None
                ) -> ExportedGGUF:
    """A GGUF file for llama.cpp: the base alone (no adapter), base and adapter merged, or (lora)
    the adapter alone; run_dtype: model.dtype of a quantized run (default: the adapter's)."""
    from cpudist.errors import UserError
    from cpudist.records import ExportedGGUF
    from cpudist.runtime.process import quiet_libraries

    quiet_libraries()
    check_choice("type", file_type, TYPE_NAMES)
    target = Path(out).expanduser()
    if target.exists() and not force:
        raise UserError(f"--out {out} already exists; choose a new file or pass --force")
    if lora and not choice.adapter:
        raise UserError("--lora writes an adapter: pass --adapter DIR with it")
    if choice.adapter:
        from cpudist.model.adapters import check_mergeable, resolve_adapter

        check_mergeable(resolve_adapter(str(choice.adapter)), "cpudist export")  # before slow ones
    # The adapter's recorded base when --base is left out; a wrong one is refused.
    chosen = trained_model(choice, run_dtype)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=target.parent) as scratch:
        written = _export(chosen, lora, file_type, target, Path(scratch))
    return ExportedGGUF(str(written), file_type, lora, chosen.model.path)


def _export(chosen: TrainedModel, lora: bool, file_type: str, out: Path, scratch: Path) -> Path:
    """The GGUF file: base alone, base and adapter merged, or (lora) the adapter alone."""
    from cpudist.config import ModelConfig
    from cpudist.errors import UserError
    from cpudist.model.adapters import check_mergeable
    from cpudist.model.gguf_export import export_lora, export_model, read_adapter
    from cpudist.model.load import resolve_model_path
    from cpudist.model.merge import merge

    method = check_mergeable(chosen.adapter, "cpudist export") if chosen.adapter else None
    if lora and method not in (None, "lora"):
        raise UserError(f"--lora: {chosen.adapter} is a {method} adapter and llama.cpp's adapter "
                        "files hold LoRA matrices; export it merged (drop --lora)")
    if method not in (None, "lora") or chosen.model.quantize != "none":
        # Folded into the weights first (as `cpudist merge` does): an IA3 adapter, or a run on a
        # quantized base, whose adapter was trained against the dequantized weights.
        if chosen.adapter is not None and not lora:
            return export_model(merge(chosen.model, chosen.adapter, scratch / "merged"), out,
                                file_type, None)
        return _export_lora_pair(chosen, lora, file_type, out, scratch)
    adapter = read_adapter(chosen.adapter) if chosen.adapter else None
    if lora and adapter is not None and adapter.dora:
        raise UserError(f"--lora: {chosen.adapter} is a DoRA adapter and llama.cpp's LoRA format "
                        "has no magnitude vectors; export it merged (drop --lora)")
    base_dir = resolve_model_path(ModelConfig(path=chosen.model.path))
    if lora:
        assert adapter is not None
        return export_lora(base_dir, adapter, out, file_type)
    return export_model(base_dir, out, file_type, adapter)


def _export_lora_pair(chosen: TrainedModel, lora: bool, file_type: str, out: Path,
                      scratch: Path) -> Path:
    """A quantized run's base alone (its dequantized weights, what the adapter was trained
    against), or (lora) its LoRA file for that base."""
    from cpudist.model.gguf_export import export_lora, export_model, read_adapter
    from cpudist.model.merge import write_dequantized_base

    base_dir = write_dequantized_base(chosen.model, scratch / "base")
    if lora:
        assert chosen.adapter is not None
        return export_lora(base_dir, read_adapter(chosen.adapter), out, file_type)
    return export_model(base_dir, out, file_type, None)
