"""After training: `cpudist merge`, `cpudist generate` and `cpudist eval`.

All three load the base model the way training does (cpudist.model) and the adapter with peft.
`eval` runs the trainer's own evaluation (cpudist.trainer.evaluate: same data pipeline, batching
and label-only loss), so its loss is the number a run logs for the same validation file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any, get_args

import torch
from torch import nn

from cpudist.config import Config, DataConfig, ModelConfig, TrainConfig
from cpudist.errors import UserError

_DTYPES = list(get_args(ModelConfig.model_fields["dtype"].annotation))
_FORMATS = list(get_args(DataConfig.model_fields["format"].annotation))


# --------------------------------------------------------------------------- loading


def resolve_adapter(path: str) -> Path:
    """A PEFT adapter directory; OUTPUT/ and OUTPUT/checkpoints/step-N/ point at their adapter/."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"--adapter {path}: directory not found; pass OUTPUT/adapter of a "
                        "cpudist train run (or one of its checkpoints/step-N)")
    for candidate in (folder, folder / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            # peft would fall back to unpickling adapter_model.bin; only safetensors is read here.
            if not (candidate / "adapter_model.safetensors").is_file():
                raise UserError(f"--adapter {candidate}: no adapter_model.safetensors in it (pickled "
                                "adapter_model.bin files are not loaded); re-save the adapter with "
                                "save_pretrained(DIR, safe_serialization=True)")
            return candidate
    raise UserError(f"--adapter {path}: no adapter_config.json in it (nor in {folder / 'adapter'}); "
                    "pass OUTPUT/adapter of a cpudist train run")


def load_model(base: str, adapter: str | None, dtype: str, trust_remote_code: bool = False,
               ) -> tuple[nn.Module, Any, str]:
    """(model with the adapter applied when given, tokenizer, dtype reason); eval mode."""
    from cpudist.model import load_base_model, load_tokenizer, resolve_model_path

    config = ModelConfig(path=base, dtype=dtype, trust_remote_code=trust_remote_code)
    adapter_dir = resolve_adapter(adapter) if adapter else None  # fail before the slow load
    try:
        path = resolve_model_path(config)
    except UserError as exc:  # the model module speaks of config keys; here it is a flag
        raise UserError(str(exc).replace(f"model.path={base!r}", f"--base {base}")) from exc
    tokenizer = load_tokenizer(path, trust_remote_code)
    model, dtype_reason = load_base_model(config, path)
    if adapter_dir is not None:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, adapter_dir)
        except (RuntimeError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise UserError(f"--adapter {adapter_dir} does not fit the base model {base} ({first}); "
                            "pass the --base the adapter was trained on") from exc
    model.eval()
    return model, tokenizer, dtype_reason


def _autocast(dtype_reason: str) -> Any:
    # The same rule as training: bf16 compute where the frozen weights are bf16.
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype_reason.startswith("bfloat16"))


# --------------------------------------------------------------------------- merge


def merge(base: str, adapter: str, out: str, dtype: str = "float32", force: bool = False) -> Path:
    """Fold the adapter into the base weights; writes a plain Hugging Face model directory."""
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not force:
        raise UserError(f"--out {out} already exists and is not empty; choose a new directory "
                        "or pass --force to replace it")
    # Merge in fp32 so the folded-in update is not rounded twice; cast at the end if asked.
    model, tokenizer, _ = load_model(base, adapter, "float32")
    if not hasattr(model, "merge_and_unload"):
        raise UserError("merge needs --adapter")
    merged = model.merge_and_unload()
    if dtype == "bfloat16":
        merged = merged.to(torch.bfloat16)
    merged.config.use_cache = True  # training turned it off; generation wants it
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"--out {out}: could not write the merged model ({exc.strerror}); choose a "
                        "writable directory with enough space") from exc
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    os.replace(tmp, target)
    return target


# --------------------------------------------------------------------------- generate


def prompt_ids(tokenizer: Any, prompt: str, system: str | None) -> list[int]:
    """The prompt exactly as training renders a user turn (chat template, or the alpaca layout)."""
    from cpudist.data import IGNORE, to_messages, tokenize_conversation

    # An empty answer makes tokenize_conversation render the prompt with its generation prefix.
    messages = to_messages({"messages": [{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": ""}]},
                           "chat", "prompt", system)
    assert messages is not None
    ids, labels = tokenize_conversation(tokenizer, messages)
    first = next((i for i, label in enumerate(labels) if label != IGNORE), len(ids))
    return ids[:first]


@torch.no_grad()
def generate(model: nn.Module, tokenizer: Any, dtype_reason: str, prompt: str,
             system: str | None, max_new_tokens: int, temperature: float = 0.0,
             stream: bool = True) -> str:
    from transformers import TextStreamer

    ids = torch.tensor([prompt_ids(tokenizer, prompt, system)])
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature}
    with _autocast(dtype_reason):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, use_cache=True,
                             pad_token_id=tokenizer.pad_token_id, streamer=streamer, **sampling)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


# --------------------------------------------------------------------------- eval


class _WithAccuracy(nn.Module):
    """CausalLMLoss plus a count of label positions whose argmax prediction is the label.

    The loss itself comes from the wrapped module unchanged; the decoder's hidden states are
    caught with a hook and put through the LM head again for the argmax (soft-capping and logit
    scaling do not change an argmax).
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.correct = self.counted = 0
        self._hidden: torch.Tensor | None = None
        inner.decoder.register_forward_hook(self._catch)

    def _catch(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self._hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def forward(self, **batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from cpudist.loss import label_positions

        total, count = self.inner(**batch)
        assert self._hidden is not None
        flat_index, targets = label_positions(batch["labels"])
        rows = self._hidden.reshape(-1, self._hidden.shape[-1]).index_select(0, flat_index)
        chunk = self.inner.chunk_size or 1024
        for start in range(0, rows.shape[0], chunk):
            predicted = self.inner.head(rows[start : start + chunk]).argmax(dim=-1)
            self.correct += int((predicted == targets[start : start + chunk]).sum())
        self.counted += int(targets.numel())
        self._hidden = None
        return total, count


def evaluate_file(base: str, adapter: str | None, data: str, fmt: str, max_length: int,
                  batch_size: int, dtype: str = "auto", system: str | None = None,
                  max_batches: int | None = None) -> dict[str, Any]:
    """Loss, perplexity and token accuracy of (base + adapter) on a data file."""
    from cpudist.cluster import Placement
    from cpudist.data import TokenizedSplit, load_tokenized, resolve_data_path
    from cpudist.loss import CausalLMLoss
    from cpudist.trainer import Runtime, evaluate

    for flag, value, least in (("--max-length", max_length, 2), ("--batch-size", batch_size, 1),
                               ("--max-batches", max_batches, 1)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least} (got {value})")
    config = Config(
        data=DataConfig(path=data, format=fmt, max_length=max_length, system_prompt=system,
                        val_fraction=0.0),
        train=TrainConfig(batch_size=batch_size, eval_batches=max_batches),
    )
    try:
        path = resolve_data_path(data, config.data.cache_dir)
    except UserError as exc:
        raise UserError(str(exc).replace("(data.path)", "(--data)")) from exc
    model, tokenizer, dtype_reason = load_model(base, adapter, dtype)
    val, stats = load_tokenized(path, tokenizer, config.data)
    scorer = _WithAccuracy(CausalLMLoss(model, config.train.loss_chunk_size))
    rt = Runtime(placement=Placement(0, 1, 0, 1, "single"), peft_model=model, loss_module=scorer,
                 tokenizer=tokenizer, train_data=TokenizedSplit([], []), val_data=val,
                 autocast=lambda: _autocast(dtype_reason), pad_id=tokenizer.pad_token_id)
    result = evaluate(rt, config)
    if not result:
        raise UserError(f"--data {data}: no label tokens to evaluate")
    return {
        "loss": result["val_loss"], "perplexity": result["val_ppl"],
        "token_accuracy": scorer.correct / scorer.counted, "label_tokens": scorer.counted,
        "samples": len(val), "truncated": stats["truncated"], "dropped": stats["dropped_no_labels"],
        "dtype": dtype_reason, "data": str(path), "adapter": adapter,
    }


# --------------------------------------------------------------------------- commands


def _add_model_args(parser: argparse.ArgumentParser, adapter_required: bool = False) -> None:
    parser.add_argument("--base", required=True, metavar="MODEL",
                        help="base model: a local Hugging Face directory or a built-in name "
                             "(smollm2-135m-instruct)")
    parser.add_argument("--adapter", required=adapter_required, metavar="DIR",
                        help="LoRA adapter: OUTPUT/adapter of a train run (or a checkpoint dir)")


def register(subparsers: Any) -> None:
    merge_parser = subparsers.add_parser(
        "merge", help="fold a LoRA adapter into its base model (plain Hugging Face directory)",
        description="Write base + adapter as one model directory (safetensors, config, tokenizer) "
                    "that AutoModelForCausalLM.from_pretrained loads without peft.")
    _add_model_args(merge_parser, adapter_required=True)
    merge_parser.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    merge_parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                              help="dtype of the saved weights (merging is done in float32)")
    merge_parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    merge_parser.set_defaults(func=_run_merge)

    gen = subparsers.add_parser(
        "generate", help="answer a prompt with a base model (and adapter), streaming tokens",
        description="Greedy (or sampled) generation; the prompt is rendered with the tokenizer's "
                    "chat template the way training renders a user turn.")
    _add_model_args(gen)
    gen.add_argument("prompt", help="the user message")
    gen.add_argument("--system", help="system message (default: data.system_prompt of the "
                                      "adapter's run)")
    gen.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 = greedy (default); above 0 samples")
    gen.add_argument("--dtype", choices=_DTYPES, help="model.dtype (default: the adapter's run, "
                                                      "else auto)")
    gen.set_defaults(func=_run_generate)

    ev = subparsers.add_parser(
        "eval", help="loss, perplexity and token accuracy on a data file",
        description="Evaluate base (+ adapter) on FILE with the trainer's own validation code: "
                    "the loss equals what training logs for the same validation file.")
    _add_model_args(ev)
    ev.add_argument("--data", required=True, metavar="FILE",
                    help=".jsonl/.json/.parquet, a saved datasets directory, or chatterbot:english")
    # Unset data/model settings come from the config of the run that wrote --adapter (so the
    # numbers match its validation log), else from the schema defaults.
    ev.add_argument("--format", choices=_FORMATS, help="data.format")
    ev.add_argument("--max-length", type=int, metavar="N", help="data.max_length")
    ev.add_argument("--batch-size", type=int, metavar="N", help="train.batch_size")
    ev.add_argument("--max-batches", type=int, default=None, metavar="N",
                    help="evaluate only the first N batches (as train.eval_batches)")
    ev.add_argument("--system", help="data.system_prompt")
    ev.add_argument("--dtype", choices=_DTYPES, help="model.dtype")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(func=_run_eval)


def _quiet() -> None:
    from cpudist.quiet import quiet_libraries

    quiet_libraries()


def _run_merge(args: argparse.Namespace) -> int:
    _quiet()
    target = merge(args.base, args.adapter, args.out, args.dtype, args.force)
    print(f"merged model written to {target}")
    return 0


# Flag -> (section, key) of the config it stands for.
_RUN_SETTINGS = {"format": ("data", "format"), "max_length": ("data", "max_length"),
                 "batch_size": ("train", "batch_size"), "system": ("data", "system_prompt"),
                 "dtype": ("model", "dtype")}


def run_config(adapter: str | None) -> tuple[Config | None, Path | None]:
    """The config of the run that wrote the adapter: OUTPUT/config.yaml or step-N/config.yaml."""
    from cpudist.config import load_config

    if not adapter:
        return None, None
    path = resolve_adapter(adapter).parent / "config.yaml"
    if not path.is_file():
        return None, None
    try:
        return load_config(path), path
    except UserError as exc:
        print(f"note: ignoring {path} ({exc}); using default settings", file=sys.stderr)
        return None, None


def fill_from_run(args: argparse.Namespace, names: list[str]) -> None:
    """Set the flags the user left out from the adapter's run config (else schema defaults)."""
    config, path = run_config(args.adapter)
    taken = []
    for name in names:
        if getattr(args, name) is not None:
            continue
        section, key = _RUN_SETTINGS[name]
        value = getattr(getattr(config or Config(), section), key)
        setattr(args, name, value)
        if config is not None and value is not None:
            taken.append(f"{section}.{key}={value}")
    if taken:
        print(f"from {path}: {', '.join(taken)}", file=sys.stderr)


def _run_generate(args: argparse.Namespace) -> int:
    _quiet()
    fill_from_run(args, ["system", "dtype"])
    if args.max_new_tokens <= 0:
        raise UserError("--max-new-tokens must be at least 1")
    model, tokenizer, dtype_reason = load_model(args.base, args.adapter, args.dtype)
    generate(model, tokenizer, dtype_reason, args.prompt, args.system, args.max_new_tokens,
             args.temperature, stream=True)
    sys.stdout.flush()
    return 0


def _run_eval(args: argparse.Namespace) -> int:
    _quiet()
    fill_from_run(args, ["format", "max_length", "batch_size", "system", "dtype"])
    result = evaluate_file(args.base, args.adapter, args.data, args.format, args.max_length,
                           args.batch_size, args.dtype, args.system, args.max_batches)
    if args.json:
        print(json.dumps(result))
        return 0
    ppl = result["perplexity"]
    print(f"loss {result['loss']:.4f}  perplexity {ppl:.2f}{' (capped)' if ppl >= math.exp(50) else ''}"
          f"  token accuracy {100 * result['token_accuracy']:.2f}%  "
          f"({result['label_tokens']} label tokens, {result['samples']} samples; {result['dtype']})")
    return 0
