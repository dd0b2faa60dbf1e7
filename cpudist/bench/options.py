"""What a bench is asked to do (its flags), and the config it runs with. No torch here: the
commands build these before anything heavy is imported."""

from __future__ import annotations

from dataclasses import dataclass

from cpudist.bench.presets import preset_dir
from cpudist.config import Config, load_config
from cpudist.errors import UserError

# --data: synthetic full-label rows, or real instruct samples from data.path.
DATA_KINDS = ("synthetic", "instruct")
# --objective values that train on preference pairs (synthetic: a prompt of half the sequence
# length, then a chosen and a rejected answer of the other half each).
PAIR_OBJECTIVES = ("dpo", "orpo")


@dataclass
class BenchArgs:
    preset: str | None
    layers: int | None
    data: str
    steps: int
    warmup: int
    batch_size: int | None
    seq_len: int | None
    dtype: str | None
    threads: int | None
    profile: bool = False
    objective: str | None = None  # train.objective; dpo and orpo time preference pairs
    method: str | None = None  # peft.method; full trains every weight

    def flags(self) -> list[str]:
        """The same settings as `cpudist bench` flags (for the bench run in another process)."""
        flags = ["--data", self.data, "--steps", str(self.steps), "--warmup", str(self.warmup)]
        for flag, value in (("--preset", self.preset), ("--layers", self.layers),
                            ("--batch-size", self.batch_size), ("--seq-len", self.seq_len),
                            ("--dtype", self.dtype), ("--threads", self.threads)):
            if value is not None:
                flags += [flag, str(value)]
        if self.objective:
            flags += ["--objective", self.objective]
        if self.method:
            flags += ["--method", self.method]
        return flags + (["--profile"] if self.profile else [])


def bench_config(config_path: str | None, overrides: list[str], args: BenchArgs) -> Config:
    """The run's config: CONFIG + overrides, then the bench flags (which win)."""
    extra = []
    if args.batch_size:
        extra.append(f"train.batch_size={args.batch_size}")
    if args.seq_len:
        extra.append(f"data.max_length={args.seq_len}")
    if args.dtype:
        extra.append(f"model.dtype={args.dtype}")
    if args.threads:
        extra.append(f"dist.threads_per_rank={args.threads}")
    if args.objective:
        extra.append(f"train.objective={args.objective}")
    if args.method:
        extra.append(f"peft.method={args.method}")
    if args.objective in PAIR_OBJECTIVES:
        extra.append("data.format=preference")
        if not any(item.startswith("data.path=") for item in overrides):
            extra.append("data.path=chatterbot-pairs:english")  # --data instruct: real pairs
    config = load_config(config_path, [*overrides, *extra])
    if args.preset:
        config.model.path = str(preset_dir(args.preset, args.layers, config.model.cache_dir))
    elif args.layers:
        raise UserError("--layers needs --preset (it shrinks a preset model)")
    return config
