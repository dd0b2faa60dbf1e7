"""Flags several commands share."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpudist.errors import UserError

if TYPE_CHECKING:
    from cpudist.config import Config, ModelConfig


def add_settings(parser: argparse.ArgumentParser) -> None:
    """[CONFIG] [section.key=value ...], anywhere on the command line."""
    parser.add_argument("settings", nargs="*", metavar="[CONFIG] section.key=value",
                        help="a YAML config (default: the built-in defaults) and overrides such "
                             "as train.lr=1e-4 data.path=my.jsonl, in any order among the flags")


def split_settings(words: list[str]) -> tuple[str | None, list[str]]:
    """(the config file, the overrides) of the words add_settings collected."""
    configs = [w for w in words if "=" not in w]
    if len(configs) > 1:
        raise UserError(f"more than one config file given ({', '.join(configs)}); pass one YAML "
                        "file and write other settings as section.key=value")
    return (configs[0] if configs else None), [w for w in words if "=" in w]


def add_model_arguments(parser: argparse.ArgumentParser, adapter_required: bool = False) -> None:
    parser.add_argument("--base", metavar="MODEL",
                        help="base model: a local Hugging Face directory or a built-in name "
                             "(smollm2-135m-instruct); default with --adapter: the base the "
                             "adapter records (its cpudist_base.json)")
    parser.add_argument("--adapter", required=adapter_required, metavar="DIR",
                        help="LoRA adapter: OUTPUT/adapter of a train run (or a checkpoint dir)")
    parser.add_argument("--ignore-fingerprint", action="store_true",
                        help="use a --base whose weights differ from those the adapter was "
                             "trained on (its shapes must still fit)")


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", choices=["none", "int8", "int4"],
                        help="model.quantize of the base (default: the adapter's run, else none)")
    parser.add_argument("--quantize-group", type=positive_int, metavar="N",
                        help="model.quantize_group (default: the adapter's run, else 64)")


def _int_from(text: str, minimum: int, bound: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be {bound}")
    return value


def positive_int(text: str) -> int:
    return _int_from(text, 1, "at least 1")


def non_negative_int(text: str) -> int:
    return _int_from(text, 0, "0 or more")


@dataclass(frozen=True)
class TrainedModel:
    """What a command that runs a trained model loads, resolved once before any slow load: the
    base (the given --base, else the one the adapter records, checked against the adapter), the
    adapter, and the settings the user left out taken from the config of the run that wrote the
    adapter (so that the figures match its validation log), else from the schema's defaults."""

    model: ModelConfig  # the base: path, dtype, quantization (a quantized run's scales)
    adapter: Path | None
    settings: dict[str, Any] = field(default_factory=dict)  # "section.key" -> value


def trained_model(args: argparse.Namespace, dtype: str | None,
                  settings: dict[str, Any] | None = None) -> TrainedModel:
    """The TrainedModel of --base/--adapter/--ignore-fingerprint/--quantize/--quantize-group, the
    flag giving model.dtype (`dtype`: --dtype, or merge's and export's --run-dtype) and other
    flags standing for settings ({"data.format": args.format, ...}; None = not given)."""
    from cpudist.config import ModelConfig
    from cpudist.model.adapters import resolve_adapter
    from cpudist.model.provenance import check_base, resolve_base

    adapter = resolve_adapter(args.adapter) if args.adapter else None
    if adapter is None:
        if args.base is None:
            raise UserError("--base MODEL is required without --adapter (a local Hugging Face "
                            "directory or smollm2-135m-instruct)")
        base = args.base
    else:
        base_dir = resolve_base(adapter, args.base)
        check_base(adapter, base_dir, args.ignore_fingerprint)
        if args.base is None:
            print(f"base: {base_dir} (recorded by the adapter)", file=sys.stderr)
        base = str(base_dir)
    wanted = {"model.dtype": dtype, "model.quantize": getattr(args, "quantize", None),
              "model.quantize_group": getattr(args, "quantize_group", None), **(settings or {})}
    chosen = _settings_from_run(adapter, wanted)
    model = ModelConfig(path=base, dtype=chosen.pop("model.dtype"),
                        quantize=chosen.pop("model.quantize"),
                        quantize_group=chosen.pop("model.quantize_group"))
    return TrainedModel(model, adapter, chosen)


def _settings_from_run(adapter: Path | None, wanted: dict[str, Any]) -> dict[str, Any]:
    """Each wanted setting: its flag's value, else the adapter's run's, else the default."""
    from cpudist.config import Config

    run, path = adapter_run_config(adapter) if adapter else (None, None)
    source = run or Config()
    chosen, taken = {}, []
    for key, value in wanted.items():
        section, name = key.split(".")
        if value is None:
            value = getattr(getattr(source, section), name)
            if run is not None and value is not None:
                taken.append(f"{key}={value}")
        chosen[key] = value
    if taken:
        print(f"from {path}: {', '.join(taken)}", file=sys.stderr)
    return chosen


def adapter_run_config(adapter_dir: Path) -> tuple[Config | None, Path | None]:
    """The config of the run that wrote an adapter: OUTPUT/config.yaml beside OUTPUT/adapter, or
    step-N/config.yaml beside a checkpoint's adapter/. (None, None) when there is none; a file
    that is there but invalid is an error, since its settings (a quantized base, its dtype) decide
    how the adapter's base must be loaded."""
    from cpudist.config import load_config

    path = adapter_dir.parent / "config.yaml"
    if not path.is_file():
        return None, None
    try:
        return load_config(path), path
    except UserError as exc:
        raise UserError(f"the adapter's run config is invalid: {exc}. Fix {path} (it says how the "
                        "adapter's base was loaded: dtype, quantization), or move the adapter out "
                        "of that run directory and give --dtype/--quantize yourself") from None
