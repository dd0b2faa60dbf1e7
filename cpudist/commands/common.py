"""Flags several commands share."""

from __future__ import annotations

import argparse

from cpudist.errors import UserError


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


def settle_base(args: argparse.Namespace) -> None:
    """--base as a model directory: the given one or the adapter's recorded base, refused when
    the adapter does not belong to it (cpudist.model.provenance). Before any slow load."""
    import sys

    from cpudist.model.adapters import resolve_adapter
    from cpudist.model.provenance import check_base, resolve_base

    if args.adapter is None:
        if args.base is None:
            raise UserError("--base MODEL is required without --adapter (a local Hugging Face "
                            "directory or smollm2-135m-instruct)")
        return
    adapter_dir = resolve_adapter(args.adapter)
    base_dir = resolve_base(adapter_dir, args.base)
    check_base(adapter_dir, base_dir, args.ignore_fingerprint)
    if args.base is None:
        print(f"base: {base_dir} (recorded by the adapter)", file=sys.stderr)
    args.base = str(base_dir)


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", choices=["none", "int8", "int4"],
                        help="model.quantize of the base (default: the adapter's run, else none)")
    parser.add_argument("--quantize-group", type=int, metavar="N",
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


# Flag -> (section, key) of the config setting it stands for.
RUN_SETTINGS = {"format": ("data", "format"), "max_length": ("data", "max_length"),
                "batch_size": ("train", "batch_size"), "system": ("data", "system_prompt"),
                "dtype": ("model", "dtype"), "run_dtype": ("model", "dtype"),
                "quantize": ("model", "quantize"),
                "quantize_group": ("model", "quantize_group")}


def fill_from_run(args: argparse.Namespace, names: list[str]) -> None:
    """Set the flags the user left out from the config of the run that wrote --adapter (so the
    numbers match its validation log), else from the schema defaults."""
    import sys

    from cpudist.config import Config
    from cpudist.model.adapters import resolve_adapter
    from cpudist.train.output import adapter_run_config

    config, path = (adapter_run_config(resolve_adapter(args.adapter)) if args.adapter
                    else (None, None))
    taken = []
    for name in names:
        if getattr(args, name) is not None:
            continue
        section, key = RUN_SETTINGS[name]
        value = getattr(getattr(config or Config(), section), key)
        setattr(args, name, value)
        if config is not None and value is not None:
            taken.append(f"{section}.{key}={value}")
    if taken:
        print(f"from {path}: {', '.join(taken)}", file=sys.stderr)
