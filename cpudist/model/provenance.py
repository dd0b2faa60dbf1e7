"""Which base an adapter belongs to: recorded beside it at training time, checked when it is loaded.

Training (rank 0) writes next to adapter_config.json:
  cpudist_base.json   machine-readable: the base's absolute path, hub id when known, a fingerprint
                      of its weights, its config's shape figures, the LoRA settings
  README.md           the model card (PEFT's layout: YAML front matter with base_model and
                      library_name: peft) saying the same for people, and how to reload it

`cpudist generate / eval / merge / export --adapter DIR` call `resolve_base` (the given --base, or
the recorded one; a moved base is a one-line error naming what was looked for) and `check_base`
(refuses a base whose shapes or fingerprint differ; an adapter without a record only warns).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from cpudist.config import Config, LoraConfig, ModelConfig
from cpudist.errors import UserError
from cpudist.model.adapters import SEQ_CLS
from cpudist.model.load import BUILTIN_MODELS, BUILTIN_ORIGINS, LM_HEAD, Head, resolve_model_path
from cpudist.model.safetensors_io import read_header, weight_files

RECORD = "cpudist_base.json"
CARD = "README.md"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Named in the record, so a later change of the sampling is never compared with an older value.
FINGERPRINT_SCHEME = "cpudist-sampled-sha256/1"
SAMPLES_PER_TENSOR = 8
SAMPLE_BYTES = 1024
# Figures of config.json an adapter's shapes depend on (recorded, compared by check_base).
CONFIG_FIGURES = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "vocab_size")


# --------------------------------------------------------------------------- fingerprint


def _sample_offsets(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the byte ranges read from a tensor of `size` bytes: all of a small one,
    else SAMPLES_PER_TENSOR ranges spread evenly from its first byte to its last."""
    if size <= SAMPLES_PER_TENSOR * SAMPLE_BYTES:
        return [(0, size)]
    last = size - SAMPLE_BYTES
    return [(k * last // (SAMPLES_PER_TENSOR - 1), SAMPLE_BYTES) for k in range(SAMPLES_PER_TENSOR)]


def base_fingerprint(model_dir: Path) -> str:
    """A stable fingerprint of the weights of a safetensors model directory (a Hugging Face
    directory, the converted built-in model, or a quantized cache of model.quantize).

    sha256 over every tensor's name, dtype and shape (sorted by name, so re-sharding does not
    change it) and 8 KiB of its bytes read at evenly spread offsets. Not every byte is hashed: a
    7B directory is 15 GB, and this reads a few MB whatever the size. That is enough for what it
    is for, telling which weights an adapter sits on: another checkpoint of the same architecture
    (another fine-tune, conversion, dtype or quantization) differs in nearly every element, so
    in the sampled bytes of every tensor too. It is not a tamper check: an edit of a few elements
    between the samples goes unseen.
    """
    files = weight_files(Path(model_dir))
    if not files:
        raise UserError(f"{model_dir}: no *.safetensors weights in it to fingerprint; a base "
                        "model directory needs model.safetensors (or sharded *.safetensors)")
    tensors = []
    for file in files:
        header, data_start = read_header(file)  # a cut or damaged file: UserError naming it
        tensors += [(name, meta, file, data_start) for name, meta in header.items()]
    digest = hashlib.sha256(FINGERPRINT_SCHEME.encode())
    handles: dict[Path, int] = {}
    try:
        for name, meta, file, data_start in sorted(tensors, key=lambda t: t[0]):
            digest.update(json.dumps([name, meta["dtype"], meta["shape"]]).encode())
            if file not in handles:
                handles[file] = os.open(file, os.O_RDONLY)
            begin, end = meta["data_offsets"]
            for offset, length in _sample_offsets(end - begin):
                digest.update(os.pread(handles[file], length, data_start + begin + offset))
    finally:
        for handle in handles.values():
            os.close(handle)
    return digest.hexdigest()


# --------------------------------------------------------------------------- the record


def hub_id_of(model_path: str, model_dir: Path) -> str | None:
    """The Hugging Face hub id the base derives from, when it can be known: a built-in model's
    source, or the repository of a hub cache snapshot (.../models--ORG--NAME/snapshots/REV)."""
    if model_path in BUILTIN_ORIGINS:
        return BUILTIN_ORIGINS[model_path][0]
    for part in Path(model_dir).resolve().parts:
        match = re.fullmatch(r"models--([^/]+?)--(.+)", part)
        if match:
            return f"{match.group(1)}/{match.group(2)}"
    return None


def lora_scale(lora: LoraConfig) -> float:
    """What the adapter's update is multiplied by: alpha/r, or alpha/sqrt(r) with rsLoRA."""
    return lora.alpha / (math.sqrt(lora.r) if lora.use_rslora else lora.r)


def adapter_record(config: Config) -> dict[str, Any]:
    """The adapter's method and its settings, as cpudist_base.json records them ("lora" keeps
    its own key for LoRA, rsLoRA and DoRA)."""
    name = config.peft.method
    if name == "lora":
        lora = config.lora
        return {"method": name, "lora": {
            "r": lora.r, "alpha": lora.alpha, "scale": lora_scale(lora),
            "use_rslora": lora.use_rslora, "use_dora": lora.use_dora,
            "target_modules": lora.target_modules}}
    section = "ia3" if name == "ia3" else "prompt"
    return {"method": name, "settings": getattr(config, section).model_dump(mode="json")}


def base_record(config: Config, model_dir: Path, head: Head = LM_HEAD) -> dict[str, Any]:
    """What cpudist_base.json holds for a run of `config` on its base (resolved to model_dir);
    a classifier's `head` is recorded by its label names (in the order of its outputs)."""
    model = config.model
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    builtin = model.path if model.path in BUILTIN_MODELS else None
    return {
        "base_path": str(Path(model_dir).resolve()),
        "builtin": builtin,
        "hub_id": hub_id_of(model.path, model_dir),
        "hub_note": BUILTIN_ORIGINS[builtin][1] if builtin in BUILTIN_ORIGINS else None,
        "fingerprint": base_fingerprint(model_dir),
        "fingerprint_scheme": FINGERPRINT_SCHEME,
        "config": {key: hf_config[key] for key in CONFIG_FIGURES if key in hf_config},
        "quantize": None if model.quantize == "none" else
        {"method": model.quantize, "group": model.quantize_group, "head": model.quantize_head},
        **adapter_record(config),
        "labels": list(head.labels) if head.task == SEQ_CLS else None,
        "multi_label": head.multi_label,
    }


def read_record(adapter_dir: Path) -> dict[str, Any] | None:
    """cpudist_base.json of an adapter, or None for one written before it existed (or elsewhere)."""
    path = Path(adapter_dir) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or "base_path" not in record:
            raise ValueError("no base_path in it")
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable base record ({exc}); delete it to load the "
                        "adapter without checks, or copy the adapter directory again") from exc
    return record


def saved_head(adapter_dir: Path) -> Head:
    """The head a saved adapter was trained with: a classifier's labels come from its base record
    (PEFT saves the head's weights, not its label names)."""
    task = json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("task_type")
    if task != SEQ_CLS:
        return LM_HEAD
    record = read_record(adapter_dir)
    if record is None or not record.get("labels"):
        raise UserError(f"--adapter {adapter_dir}: a sequence-classification adapter without the "
                        f"label names of its head ({RECORD} with 'labels'); pass OUTPUT/adapter "
                        "of a cpudist train run with train.objective=classification")
    return Head(SEQ_CLS, tuple(record["labels"]), bool(record.get("multi_label")))


def _adapter_lines(record: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the card's lines about the adapter, its tags)."""
    method = record.get("method", "lora")
    lora = record.get("lora")
    if lora is None:
        settings = ", ".join(f"{k} {v}" for k, v in (record.get("settings") or {}).items())
        return [f"- method: {method} ({settings})"], [method.replace("_", "-"), "peft", "cpudist"]
    scale_rule = "alpha/sqrt(r), rsLoRA" if lora["use_rslora"] else "alpha/r"
    targets = lora["target_modules"]
    tags = ["lora", "peft", "cpudist"] + (["dora"] if lora["use_dora"] else []) + \
        (["rslora"] if lora["use_rslora"] else [])
    return [
        f"- r {lora['r']}, alpha {lora['alpha']:g}, scale {lora['scale']:.6g} ({scale_rule})",
        f"- target modules: {targets if isinstance(targets, str) else ', '.join(targets)}",
        f"- DoRA: {'yes' if lora['use_dora'] else 'no'}",
    ], tags


def _card(record: dict[str, Any], training: dict[str, Any]) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    hub_id, base, labels = record["hub_id"], record["base_path"], record.get("labels")
    adapter_lines, tags = _adapter_lines(record)
    data = ModelCardData(base_model=hub_id, library_name="peft", tags=tags)
    if hub_id is None:
        origin = "not known (a local directory)"
    else:
        origin = f"[{hub_id}](https://huggingface.co/{hub_id})"
        if record.get("hub_note"):
            origin += f": {record['hub_note']}"
    quantize = record.get("quantize")
    lines = [
        f"# {record.get('method', 'lora')} adapter trained with cpudist on {Path(base).name}", "",
        "## Base model", "",
        f"- trained on: `{base}`" + (f" (cpudist built-in model `{record['builtin']}`)"
                                     if record.get("builtin") else ""),
        f"- derives from the hub model: {origin}",
        f"- fingerprint of the base weights ({record['fingerprint_scheme']}): "
        f"`{record['fingerprint']}`",
        f"- architecture: {', '.join(f'{k} {v}' for k, v in record['config'].items())}",
    ]
    if quantize:
        lines.append(f"- trained on the base quantized by cpudist (model.quantize="
                     f"{quantize['method']}, group {quantize['group']}): cpudist eval, generate and "
                     "merge quantize it the same way; peft on the full-precision base computes "
                     "slightly different numbers")
    lines += [
        "", "cpudist refuses a base whose tensor shapes or fingerprint differ from the ones above "
        "(`cpudist_base.json` holds them for programs).", "",
        "## Adapter", "", *adapter_lines,
    ]
    if labels:
        lines.append(f"- a classifier of {len(labels)} labels (its head is saved with the "
                     f"adapter): {', '.join(labels)}")
    auto = "AutoModelForSequenceClassification" if labels else "AutoModelForCausalLM"
    head = f", num_labels={len(labels)}" if labels else ""
    figures = [(label, training.get(key)) for key, label in (
        ("steps", "training steps"), ("train_loss", "final training loss"),
        ("val_loss_before", "validation loss before"), ("val_loss_after", "validation loss after"))]
    lines += [f"- {label}: {value:.4f}" if isinstance(value, float) else f"- {label}: {value}"
              for label, value in figures if value is not None]
    lines += [
        "", "## Reload", "", "With peft (the base directory must be on this machine):", "",
        "```python", f"from transformers import {auto}", "from peft import PeftModel", "",
        f"base = {auto}.from_pretrained({base!r}{head})",
        "model = PeftModel.from_pretrained(base, \"path/to/this/adapter\")", "```", "",
        "With cpudist (the base is found from `cpudist_base.json`; pass `--base DIR` where it has "
        "moved; `cpudist merge` writes base + adapter as one model):", "",
        "```bash", "cpudist generate --adapter path/to/this/adapter \"Your question\"",
        "cpudist eval --adapter path/to/this/adapter --task configs/tasks/chatterbot-trivia-mc.jsonl",
        "cpudist merge --adapter path/to/this/adapter --out merged/", "```", "",
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def write_provenance(adapter_dir: Path, record: dict[str, Any],
                     training: dict[str, Any] | None = None) -> None:
    """cpudist_base.json and the model card README.md into a saved adapter directory (replacing
    the card peft writes, whose base_model is a path and whose body is an empty template)."""
    adapter_dir = Path(adapter_dir)
    (adapter_dir / RECORD).write_text(json.dumps(record, indent=1))
    (adapter_dir / CARD).write_text(_card(record, training or {}))


# --------------------------------------------------------------------------- when loading


def _adapter_config(adapter_dir: Path) -> dict[str, Any]:
    path = Path(adapter_dir) / "adapter_config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not readable JSON ({exc}); copy the adapter directory "
                        "again") from exc


def resolve_base(adapter_dir: Path, base: str | None, cache_dir: str | None = None) -> Path:
    """The base model directory for an adapter: `base` when given (a directory or a built-in
    name), else the one the adapter records (cpudist_base.json, else its adapter_config.json).

    Raises UserError (one line) when the given base is not a model directory, or when the recorded
    one is not there (moved, another machine): naming the path looked for, the hub id it derives
    from when known, and --base.
    """
    where = {} if cache_dir is None else {"cache_dir": cache_dir}  # of a built-in's conversion
    if base is not None:
        try:
            return resolve_model_path(ModelConfig(path=base, **where))
        except UserError as exc:
            raise UserError(str(exc).replace(f"model.path={base!r}", f"--base {base}")) from exc
    record = read_record(adapter_dir)
    recorded = record["base_path"] if record else \
        _adapter_config(adapter_dir).get("base_model_name_or_path")
    if not recorded:
        raise UserError(f"--adapter {adapter_dir}: it does not name its base model; pass --base "
                        "DIR (the model it was trained on)")
    if (Path(recorded).expanduser() / "config.json").is_file():
        return Path(recorded).expanduser()
    if record and record.get("builtin") in BUILTIN_MODELS:
        # A built-in model is rebuilt the same way on any machine; its fingerprint is still checked.
        return resolve_model_path(ModelConfig(path=record["builtin"], **where))
    hub_id = record.get("hub_id") if record else None
    derived = f" (derived from the hub model {hub_id}: download it and pass that directory)" \
        if hub_id else ""
    raise UserError(f"--adapter {adapter_dir}: its base model {recorded} is not there (moved, or "
                    f"another machine){derived}; pass --base DIR, the model it was trained on")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _base_shapes(base_dir: Path) -> dict[str, list[int]]:
    return {name: meta["shape"] for file in weight_files(base_dir)
            for name, meta in read_header(file)[0].items()}


def _adapter_mismatch(adapter_dir: Path, base_dir: Path) -> str | None:
    """Why the adapter's tensors cannot sit on the base's weights, or None when they fit.

    lora_A of a module reads its input (A is r x in), lora_B writes its output (B is out x r), a
    DoRA magnitude has one entry per output: each is compared with the base's module weight.
    """
    adapter, _ = read_header(Path(adapter_dir) / ADAPTER_WEIGHTS)
    base = _base_shapes(base_dir)
    checks = []
    for name, meta in adapter.items():
        match = re.fullmatch(r"base_model\.model\.(.+)\.(lora_A|lora_B|lora_magnitude_vector)"
                             r"(?:\.weight)?", name)
        if match:
            checks.append((match.group(1), match.group(2), meta["shape"]))
    found = [c for c in checks if f"{c[0]}.weight" in base]
    if checks and not found:
        # The base's files name tensors another way than its modules (a converted checkpoint):
        # peft's own load compares the shapes then.
        return None
    for module, kind, shape in checks:
        weight = base.get(f"{module}.weight")
        if weight is None:
            return f"the adapter adapts {module}, which the base has no weight for"
        if len(weight) != 2:
            continue
        out_features, in_features = weight
        if kind == "lora_A" and shape[-1] != in_features:
            return f"{module} takes {in_features} inputs in the base, {shape[-1]} in the adapter"
        if kind == "lora_B" and shape[0] != out_features:
            return f"{module} has {out_features} outputs in the base, {shape[0]} in the adapter"
        if kind == "lora_magnitude_vector" and shape[0] != out_features:
            return f"{module} has {out_features} outputs in the base, {shape[0]} in the adapter"
    return None


def check_base(adapter_dir: Path, base_dir: Path, ignore_fingerprint: bool = False) -> None:
    """Refuse a base the adapter does not belong to (one-line UserError saying which check failed:
    the config's shape figures, a module's shape, or the fingerprint of the weights). An adapter
    without cpudist_base.json (older runs, other tools) gets the shape check and a warning.
    ignore_fingerprint turns a fingerprint mismatch (same shapes, other weights) into a warning."""
    adapter_dir, base_dir = Path(adapter_dir), Path(base_dir)
    record = read_record(adapter_dir)
    if record:
        config = json.loads((base_dir / "config.json").read_text())
        for key, value in record.get("config", {}).items():
            if key in config and config[key] != value:
                raise UserError(f"--base {base_dir} does not fit --adapter {adapter_dir}: its "
                                f"{key} is {config[key]}, the adapter's base had {value} "
                                f"({record['base_path']}); pass the base the adapter was trained on")
    mismatch = _adapter_mismatch(adapter_dir, base_dir)
    if mismatch:
        raise UserError(f"--base {base_dir} does not fit --adapter {adapter_dir}: {mismatch}; pass "
                        "the base the adapter was trained on")
    if record is None:
        _warn(f"--adapter {adapter_dir} has no {RECORD} (an adapter from another tool or an older "
              f"cpudist), so cannot check that {base_dir} holds the weights it was trained on; its "
              "shapes fit")
        return
    if record.get("fingerprint_scheme") != FINGERPRINT_SCHEME:
        _warn(f"{adapter_dir / RECORD}: fingerprint scheme {record.get('fingerprint_scheme')} is "
              f"not this cpudist's ({FINGERPRINT_SCHEME}); the base's weights are not checked")
        return
    found = base_fingerprint(base_dir)
    if found != record["fingerprint"]:
        message = (f"--base {base_dir} has the adapter's shapes but other weights: fingerprint "
                   f"{found[:16]}, the adapter was trained on {record['fingerprint'][:16]} "
                   f"({record['base_path']})")
        if ignore_fingerprint:
            _warn(message + "; used anyway (--ignore-fingerprint)")
            return
        raise UserError(message + "; pass the base it was trained on, or --ignore-fingerprint to "
                        "use this one anyway")
