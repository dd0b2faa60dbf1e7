"""What a bench trains on, the same for cpudist and its peers: synthetic full-label rows, or a fixed
set of real instruct samples, and where each bench step falls in it."""

from __future__ import annotations

import random
from typing import Any

import torch

from cpudist.bench.options import DATA_KINDS, PAIR_OBJECTIVES
from cpudist.config import Config
from cpudist.data.preference import PreferenceSplit, load_pairs
from cpudist.data.tokenize import TokenizedSplit, build_datasets
from cpudist.errors import UserError


def synthetic_split(samples: int, seq_len: int, vocab: int, seed: int) -> TokenizedSplit:
    """Uniform-length rows of random token ids in [0, vocab); every token is a label."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (samples, seq_len), generator=generator).tolist()
    return TokenizedSplit(ids, [list(row) for row in ids])


def fixed_sample_set(split: TokenizedSplit, samples: int, seed: int, where: str) -> TokenizedSplit:
    """`samples` samples of `split`, drawn once (seeded). cpudist's bench and the HF baseline both
    time exactly one epoch over this set, so label tokens/s compares the same work: each side
    batches the samples its own way (length-grouped vs random) but neither can draw an easier set."""
    if len(split) < samples:
        raise UserError(f"{where} has {len(split)} training samples; the bench times one epoch of "
                        f"--steps x batch x grad_accum x ranks = {samples} samples: lower --steps or "
                        "the batch size, or use a bigger data.path")
    chosen = sorted(random.Random(seed).sample(range(len(split)), samples))
    return TokenizedSplit([split.input_ids[i] for i in chosen], [split.labels[i] for i in chosen])


def synthetic_pairs(samples: int, seq_len: int, vocab: int, seed: int) -> PreferenceSplit:
    """Pairs of random token ids: a prompt of half of seq_len, then a chosen and a rejected answer
    of the other half, so each of a pair's two sequences is seq_len tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompt = seq_len // 2

    def rows(width: int) -> list[list[int]]:
        return torch.randint(0, vocab, (samples, width), generator=generator).tolist()

    return PreferenceSplit(rows(prompt), rows(seq_len - prompt), rows(seq_len - prompt))


def _pair_samples(config: Config, kind: str, samples: int, tokenizer: Any, vocab: int
                  ) -> tuple[PreferenceSplit, str]:
    """bench_samples for train.objective=dpo or orpo: preference pairs."""
    length = config.data.max_length
    if kind == "synthetic":
        return (synthetic_pairs(samples, length, vocab, config.train.seed),
                f"synthetic pairs: {samples} x (prompt {length // 2} + chosen {length - length // 2}"
                f" | rejected {length - length // 2}) random tokens")
    train, _, stats = build_datasets(config.data, tokenizer, config.train.seed, load=load_pairs)
    if len(train) < samples:
        raise UserError(f"data.path {config.data.path} has {len(train)} training pairs; the bench "
                        f"times one epoch of {samples} pairs: lower --steps or the batch size")
    chosen = sorted(random.Random(config.train.seed).sample(range(len(train)), samples))
    return train.subset(chosen), f"instruct pairs: {stats['source']} ({samples} of {stats['train']})"


def bench_samples(config: Config, kind: str, samples: int, tokenizer: Any, vocab: int
                  ) -> tuple[TokenizedSplit | PreferenceSplit, str]:
    """(the samples a bench times one epoch of, a description)."""
    if config.objective_name() in PAIR_OBJECTIVES:
        return _pair_samples(config, kind, samples, tokenizer, vocab)
    if kind == "synthetic":
        return (synthetic_split(samples, config.data.max_length, vocab, config.train.seed),
                f"synthetic: {samples} rows x {config.data.max_length} random tokens, all labels")
    if kind != "instruct":
        raise UserError(f"--data {kind!r}: choose one of {', '.join(DATA_KINDS)}")
    train, _, stats = build_datasets(config.data, tokenizer, config.train.seed)
    train = fixed_sample_set(train, samples, config.train.seed, f"data.path {config.data.path}")
    return train, (f"instruct: {stats['source']} ({samples} of {stats['train']} samples, "
                   "prompt tokens masked)")


def bench_step_position(step: int, warmup: int, steps_per_epoch: int) -> tuple[int, int]:
    """(epoch, index) of bench step `step`: warm-up steps run first; the timed steps then start a
    fresh epoch, so `--steps` timed steps cover the fixed sample set exactly once."""
    if step < warmup:
        return divmod(step, steps_per_epoch)
    warm_epochs = -(-warmup // steps_per_epoch)
    epoch, index = divmod(step - warmup, steps_per_epoch)
    return warm_epochs + epoch, index
