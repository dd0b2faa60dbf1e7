"""cpudist as a library: `import cpudist; cpudist.train("my.yaml", {"train.max_steps": 50})`.

The same runs as the command line, on the same schema (cpudist/config.py), returning the typed
records instead of printing them. Bad input raises cpudist.UserError (one line naming the key and
what to do), a run stopped by a signal after its checkpoint raises cpudist.Preempted; nothing
calls sys.exit. A script using them runs as one rank: start it under mpirun, srun or torchrun for
several (each rank runs the script; train() returns the summary on rank 0, None elsewhere).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpudist.errors import UserError

if TYPE_CHECKING:
    from cpudist.config import Config
    from cpudist.records import RunSummary
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
    from cpudist.runtime.cluster import detect_placement
    from cpudist.train.plan import make_plan, resolve_batch

    chosen = make_config(config, overrides)
    placement = detect_placement()
    ranks = ranks_per_node or placement.local_size
    chosen, _ = resolve_batch(chosen, world_size or max(placement.world_size, ranks), ranks)
    return make_plan(chosen, ranks)
