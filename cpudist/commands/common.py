"""Flags several commands share."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

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
class ModelChoice:
    """Which model a command runs, as the user named it: --base, --adapter,
    --ignore-fingerprint, --quantize, --quantize-group (None = not given). The same fields are
    the Python API's keyword arguments."""

    base: str | Path | None = None
    adapter: str | Path | None = None
    ignore_fingerprint: bool = False
    quantize: str | None = None
    quantize_group: int | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> ModelChoice:
        return cls(args.base, args.adapter, args.ignore_fingerprint,
                   getattr(args, "quantize", None), getattr(args, "quantize_group", None))


def check_choice(flag: str, value: object, choices: tuple[object, ...] | list[str]) -> None:
    """A value the CLI's argparse would have refused, given through the Python API."""
    if value is not None and value not in choices:
        raise UserError(f"{flag}={value!r}: choose one of {', '.join(map(str, choices))}")


def check_positive(flag: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserError(f"{flag}={value!r}: give a whole number of at least 1")


@dataclass(frozen=True)
class TrainedModel:
    """What a command that runs a trained model loads, resolved once before any slow load: the
    base (the given --base, else the one the adapter records, checked against the adapter), the
    adapter, and the settings the user left out taken from the config of the run that wrote the
    adapter (so that the figures match its validation log), else from the schema's defaults."""

    model: ModelConfig  # the base: path, dtype, quantization (a quantized run's scales)
    adapter: Path | None
    settings: dict[str, Any] = field(default_factory=dict)  # "section.key" -> value

    @property
    def named(self) -> str:
        """The model as the user named it, for errors: --adapter DIR, else --base MODEL."""
        return f"--adapter {self.adapter}" if self.adapter is not None else f"--base {self.model.path}"


def trained_model(choice: ModelChoice, dtype: str | None,
                  settings: dict[str, Any] | None = None) -> TrainedModel:
    """The TrainedModel of a ModelChoice, the setting giving model.dtype (`dtype`: --dtype, or
    merge's and export's --run-dtype) and other flags standing for settings
    ({"data.format": args.format, ...}; None = not given)."""
    from cpudist.config import ModelConfig
    from cpudist.model.adapters import resolve_adapter
    from cpudist.model.provenance import check_base, resolve_base

    check_choice("dtype", dtype, get_args(ModelConfig.model_fields["dtype"].annotation))
    check_choice("quantize", choice.quantize,
                 get_args(ModelConfig.model_fields["quantize"].annotation))
    check_positive("quantize_group", choice.quantize_group)
    adapter = resolve_adapter(str(choice.adapter)) if choice.adapter else None
    if adapter is None:
        if choice.base is None:
            raise UserError("--base MODEL is required without --adapter (a local Hugging Face "
                            "directory or smollm2-135m-instruct)")
        base = str(choice.base)
    else:
        given = str(choice.base) if choice.base is not None else None
        base_dir = resolve_base(adapter, given)
        check_base(adapter, base_dir, choice.ignore_fingerprint)
        if choice.base is None:
            print(f"base: {base_dir} (recorded by the adapter)", file=sys.stderr)
        base = str(base_dir)
    wanted = {"model.dtype": dtype, "model.quantize": choice.quantize,
              "model.quantize_group": choice.quantize_group, "model.quantize_head": None,
              **(settings or {})}
    chosen = _settings_from_run(adapter or _trained_in_full(base), wanted)
    model = ModelConfig(path=base, dtype=chosen.pop("model.dtype"),
                        quantize=chosen.pop("model.quantize"),
                        quantize_group=chosen.pop("model.quantize_group"),
                        quantize_head=chosen.pop("model.quantize_head"))
    return TrainedModel(model, adapter, chosen)


def _trained_in_full(base: str) -> Path | None:
    """OUTPUT/model (or a checkpoint's model/) of a peft.method=full run, whose run config sits
    beside it as beside an adapter; None for any other base."""
    path = Path(base).expanduser()
    return path if path.name == "model" and (path.parent / "config.yaml").is_file() else None


def _settings_from_run(trained: Path | None, wanted: dict[str, Any]) -> dict[str, Any]:
    """Each wanted setting: its flag's value, else the run's that trained `trained` (an adapter,
    or a model trained in full), else the default."""
    from cpudist.config import Config

    run, path = adapter_run_config(trained) if trained else (None, None)
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
