"""cpudist as a library: `import cpudist; cpudist.train("my.yaml", {"train.max_steps": 50})`.

The same runs as the command line, on the same schema (cpudist/config.py), returning the typed
records instead of printing them: train and plan take a config; evaluate, generate, predict,
merge and export take a trained model as the commands do (adapter: OUTPUT/adapter of a run; base:
the model, by default the one the adapter records; quantize, quantize_group and
ignore_fingerprint as the flags) and call the very functions of cpudist/commands/ behind those
commands. Keyword arguments left None take the adapter's run's setting, else the default.
Bad input raises cpudist.UserError (one line naming the key and what to do), a run stopped by a
signal after its checkpoint raises cpudist.Preempted; nothing calls sys.exit. A script using
them runs as one rank: start it under mpirun, srun or torchrun for several (each rank runs the
script; train() returns the summary on rank 0, None elsewhere).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpudist.errors import UserError

if TYPE_CHECKING:
    from cpudist.commands.common import ModelChoice
    from cpudist.config import Config
    from cpudist.records import (
        ClassificationReport,
        DataEvalResult,
        ExportedGGUF,
        PreferenceEvalResult,
        RunSummary,
        TaskEvalResult,
    )
    from cpudist.train.plan import MemoryPlan

Overrides = Mapping[str, Any] | Sequence[str] | None


def make_config(config: str | Path | Config | None = None, overrides: Overrides = None) -> Config:
    """A Config from a YAML file (or a Config, or the defaults when None) and overrides, given as
    {"section.key": value} (values as Python objects) or as the command line's "section.key=value"
    strings."""
    from pydantic import ValidationError

    from cpudist.config import Config, load_config

    given = [] if overrides is None or isinstance(overrides, Mapping) else list(overrides)
    if isinstance(overrides, str):
        raise UserError(f"overrides={overrides!r}: give a mapping {{'section.key': value}} or a "
                        "list of 'section.key=value' strings")
    base = config if isinstance(config, Config) else load_config(config, given)
    if isinstance(config, Config) and given:
        raise UserError("overrides as 'section.key=value' strings go with a YAML file; with a "
                        "Config give them as a mapping {'section.key': value}")
    if not isinstance(overrides, Mapping) or not overrides:
        return base
    changes = {}
    for key, value in overrides.items():
        section, _, name = str(key).partition(".")
        if not name or "." in name or section not in Config.model_fields:
            raise UserError(f"override {key!r}: the key must be section.key, such as "
                            "'train.max_steps'")
        changes[section, name] = value
    try:
        return base.with_settings(changes)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if not isinstance(p, int))
        raise UserError(f"override {where}: {first['msg']} (got {first.get('input')!r})") from None


def train(config: str | Path | Config | None = None, overrides: Overrides = None, *,
          debug: bool = False) -> RunSummary | None:
    """`cpudist train`: fine-tune as this process's rank; the run's summary on rank 0 (None on
    the other ranks)."""
    from cpudist.train.run import train as run_training

    return run_training(make_config(config, overrides), debug=debug)


def plan(config: str | Path | Config | None = None, overrides: Overrides = None, *,
         ranks_per_node: int | None = None, world_size: int | None = None) -> MemoryPlan:
    """`cpudist plan`: the memory a run needs per rank and node, before loading anything."""
    from cpudist.train.plan import plan_here

    return plan_here(make_config(config, overrides), ranks_per_node, world_size)[0]


def evaluate(adapter: str | Path | None = None, *, data: str | Path | None = None,
             task: str | Path | None = None, base: str | Path | None = None,
             out: str | Path | None = None, format: str | None = None,
             max_length: int | None = None, batch_size: int | None = None,
             max_batches: int | None = None, system: str | None = None, dtype: str | None = None,
             max_new_tokens: int = 32, quantize: str | None = None,
             quantize_group: int | None = None, ignore_fingerprint: bool = False
             ) -> DataEvalResult | PreferenceEvalResult | ClassificationReport | TaskEvalResult:
    """`cpudist eval`: on data= a file, the trainer's validation figures (DataEvalResult; a
    preference file: PreferenceEvalResult; a classifier: ClassificationReport); on task= a task,
    the accuracy before and after the adapter (TaskEvalResult, also added to out, by default
    eval.json in the adapter's run directory)."""
    from cpudist.commands.eval import evaluate_data, evaluate_task_file

    choice = _choice(base, adapter, quantize, quantize_group, ignore_fingerprint)
    if (data is None) == (task is None):
        raise UserError("evaluate: give data=FILE (loss, perplexity, token accuracy) or "
                        "task=FILE (a multiple-choice or QA task), one of them")
    if task is not None:
        return evaluate_task_file(choice, task, out=out, max_new_tokens=max_new_tokens,
                                  system=system, dtype=dtype)[0]
    assert data is not None
    return evaluate_data(choice, data, data_format=format, max_length=max_length,
                         batch_size=batch_size, max_batches=max_batches, system=system,
                         dtype=dtype)


def generate(prompt: str, adapter: str | Path | None = None, *, base: str | Path | None = None,
             system: str | None = None, max_new_tokens: int = 128, temperature: float = 0.0,
             dtype: str | None = None, stream: bool = False, quantize: str | None = None,
             quantize_group: int | None = None, ignore_fingerprint: bool = False) -> str:
    """`cpudist generate`: the answer to a user message (greedy at temperature 0), rendered as
    training renders a user turn; stream=True also prints it token by token."""
    from cpudist.commands.generate import generate_answer

    return generate_answer(_choice(base, adapter, quantize, quantize_group, ignore_fingerprint),
                           prompt, system=system, max_new_tokens=max_new_tokens,
                           temperature=temperature, dtype=dtype, stream=stream)


def predict(adapter: str | Path, data: str | Path, out: str | Path | None = None, *,
            base: str | Path | None = None, batch_size: int | None = None,
            max_length: int | None = None, dtype: str | None = None,
            ignore_fingerprint: bool = False) -> list[dict[str, Any]]:
    """`cpudist predict`: a classifier's rows of data with their predicted 'label' (or
    'labels') and 'scores', also written to out (.jsonl) when given."""
    from cpudist.commands.predict import predict_file

    return predict_file(_choice(base, adapter, None, None, ignore_fingerprint), data, out,
                        batch_size=batch_size, max_length=max_length, dtype=dtype)


def merge(adapter: str | Path, out: str | Path, *, base: str | Path | None = None,
          dtype: str = "float32", force: bool = False, run_dtype: str | None = None,
          quantize: str | None = None, quantize_group: int | None = None,
          ignore_fingerprint: bool = False) -> Path:
    """`cpudist merge`: the adapter folded into its base, a plain Hugging Face directory at out
    (weights in dtype); returns out."""
    from cpudist.commands.merge import merge_adapter

    return merge_adapter(_choice(base, adapter, quantize, quantize_group, ignore_fingerprint),
                         out, dtype=dtype, force=force, run_dtype=run_dtype)


def export(out: str | Path, adapter: str | Path | None = None, *,
           base: str | Path | None = None, type: str = "f16", lora: bool = False,
           force: bool = False, run_dtype: str | None = None, quantize: str | None = None,
           quantize_group: int | None = None, ignore_fingerprint: bool = False) -> ExportedGGUF:
    """`cpudist export`: a GGUF file for llama.cpp: the base alone (no adapter), base and
    adapter merged, or with lora=True the adapter alone."""
    from cpudist.commands.export import export_gguf

    return export_gguf(_choice(base, adapter, quantize, quantize_group, ignore_fingerprint),
                       out, file_type=type, lora=lora, force=force, run_dtype=run_dtype)


def _choice(base: str | Path | None, adapter: str | Path | None, quantize: str | None,
            quantize_group: int | None, ignore_fingerprint: bool) -> ModelChoice:
    from cpudist.commands.common import ModelChoice

    return ModelChoice(base, adapter, ignore_fingerprint, quantize, quantize_group)
