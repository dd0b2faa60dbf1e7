"""Batches: padded or packed rows, and one global order of them that every rank cuts its share from.

The order depends only on the seed and the epoch, so any world size sees the same global batches.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cpudist.config import Config
from cpudist.data.tokenize import IGNORE, TokenizedSplit
from cpudist.errors import UserError


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None

    @property
    def label_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE).sum())

    @property
    def tokens(self) -> int:
        # Packed rows hold segment ids (1, 2, ...) in attention_mask, so count, never sum.
        return int((self.attention_mask > 0).sum())

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        kwargs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                  "labels": self.labels}
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids
        return kwargs


def collate(data: TokenizedSplit, indices: list[int], pad_id: int) -> Batch:
    """Right-padded batch of the given samples."""
    width = max(len(data.input_ids[i]) for i in indices)
    ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    labels = torch.full((len(indices), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(indices), width), dtype=torch.long)
    for row, index in enumerate(indices):
        length = len(data.input_ids[index])
        ids[row, :length] = torch.tensor(data.input_ids[index])
        labels[row, :length] = torch.tensor(data.labels[index])
        mask[row, :length] = 1
    return Batch(ids, mask, labels)


def pack(data: TokenizedSplit, indices: list[int], pad_id: int, max_length: int) -> Batch:
    """Several samples per row (first fit, in order); position ids restart at every sample.

    Attention stays inside each sample: the model sees a 4D block-diagonal causal mask built from
    the position ids (see loss.packed_attention_mask).
    """
    rows: list[list[int]] = []
    fill: list[int] = []
    for index in indices:
        length = len(data.input_ids[index])
        for row, used in enumerate(fill):
            if used + length <= max_length:
                rows[row].append(index)
                fill[row] += length
                break
        else:
            rows.append([index])
            fill.append(length)
    width = max(fill)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for row, members in enumerate(rows):
        offset = 0
        for segment, index in enumerate(members, start=1):
            length = len(data.input_ids[index])
            ids[row, offset : offset + length] = torch.tensor(data.input_ids[index])
            sample_labels = torch.tensor(data.labels[index])
            sample_labels[0] = IGNORE  # never predict a sample's first token from the previous one
            labels[row, offset : offset + length] = sample_labels
            mask[row, offset : offset + length] = segment  # segment ids; 0 = padding
            positions[row, offset : offset + length] = torch.arange(length)
            offset += length
    return Batch(ids, mask, labels, positions)


def balance(indices: list[int], lengths: list[int], world: int) -> list[list[int]]:
    """Deal one global micro-batch to `world` ranks, the same number of samples each, balanced by
    token count: longest sample first onto the rank with the fewest tokens so far (among those
    with room; ties to the lowest rank). Deterministic, and a function of the global micro-batch
    only. Without it length grouping gave rank 0 the longest samples of every micro-batch, and
    every other rank waited for it at the allreduce."""
    if world == 1:
        return [list(indices)]
    per_rank = len(indices) // world
    shares: list[list[int]] = [[] for _ in range(world)]
    tokens = [0] * world
    # Stable sort: equal lengths keep their order in the global batch.
    for index in sorted(indices, key=lambda i: -lengths[i]):
        rank = min((r for r in range(world) if len(shares[r]) < per_rank),
                   key=lambda r: (tokens[r], r))
        shares[rank].append(index)
        tokens[rank] += lengths[index]
    return shares


class GlobalBatches:
    """One global order of micro-batches per epoch, cut into each rank's share.

    Global micro-batch g holds batch_size * world samples; `balance` deals them to the ranks,
    batch_size each, balanced by token count. Every rank gets the same number of steps (the tail
    that does not fill a whole optimizer step is dropped).
    """

    def __init__(self, data: TokenizedSplit, batch_size: int, grad_accum: int, world: int,
                 seed: int, group_by_length: bool) -> None:
        self.data = data
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.world = world
        self.seed = seed
        self.group_by_length = group_by_length
        self.global_micro = batch_size * world
        self.steps_per_epoch = len(data) // (self.global_micro * grad_accum)
        # Asked at every step: a split of millions of rows takes seconds to order.
        self._lengths: list[int] | None = None
        self._order: tuple[int, list[list[int]]] | None = None
        if self.steps_per_epoch == 0:
            raise UserError(
                f"the training split has {len(data)} samples, fewer than one global batch "
                f"(train.batch_size={batch_size} x train.grad_accum={grad_accum} x {world} ranks); "
                "lower the batch size or add data"
            )

    def epoch_order(self, epoch: int) -> list[list[int]]:
        """Global micro-batches (lists of sample indices) of an epoch, deterministic in seed.

        Which samples make up an optimizer step depends only on the global batch (batch_size x
        grad_accum x world), not on how it is split: the same run with train.global_batch keeps
        its steps whatever micro-batch or world size resolves it.
        """
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        rng = random.Random(self.seed * 100_003 + epoch)
        order = list(range(len(self.data)))
        rng.shuffle(order)
        step_rows = self.grad_accum * self.global_micro
        usable = self.steps_per_epoch * step_rows
        order = order[:usable]
        if self.group_by_length:
            # Sort within windows of 64 steps by length, then shuffle the steps: similar lengths
            # share a micro-batch (little padding) while the order of steps stays random.
            lengths = self.lengths()
            window = 64 * step_rows
            grouped: list[int] = []
            for start in range(0, usable, window):
                grouped += sorted(order[start : start + window], key=lambda i: -lengths[i])
            steps = [grouped[i : i + step_rows] for i in range(0, usable, step_rows)]
            rng.shuffle(steps)
            order = [i for step in steps for i in step]
        batches = [order[i : i + self.global_micro] for i in range(0, usable, self.global_micro)]
        self._order = (epoch, batches)
        return batches

    def lengths(self) -> list[int]:
        if self._lengths is None:
            self._lengths = self.data.lengths()
        return self._lengths

    def step_batches(self, epoch: int, step_in_epoch: int, rank: int) -> list[list[int]]:
        """This rank's sample indices for each micro-step of one optimizer step."""
        return [shares[rank] for shares in self.step_shares(epoch, step_in_epoch)]

    def step_shares(self, epoch: int, step_in_epoch: int) -> list[list[list[int]]]:
        """Every rank's samples of each micro-step of one optimizer step: [micro][rank]."""
        lengths = self.lengths()
        return [balance(batch, lengths, self.world)
                for batch in self.global_step_batches(epoch, step_in_epoch)]

    def global_step_batches(self, epoch: int, step_in_epoch: int) -> list[list[int]]:
        batches = self.epoch_order(epoch)
        first = step_in_epoch * self.grad_accum
        return batches[first : first + self.grad_accum]


def eval_batches(data: TokenizedSplit, batch_size: int, rank: int, world: int,
                 limit: int | None) -> Iterator[list[int]]:
    """This rank's share of the validation set (strided, so every sample is seen once overall),
    shortest samples first. A limit of batches caps the samples at limit x batch_size over all
    ranks: the same samples, so the same figures, on any world size."""
    lengths = data.lengths()
    order = sorted(range(len(data)), key=lengths.__getitem__)
    if limit is not None:
        order = order[: limit * batch_size]
    mine = order[rank::world]
    for b in range(math.ceil(len(mine) / batch_size)):
        yield mine[b * batch_size : (b + 1) * batch_size]


def make_batch(data: TokenizedSplit, indices: list[int], pad_id: int, config: Config) -> Batch:
    """The batch of these samples as the config asks: packed rows or right-padded ones."""
    if config.data.packing:
        return pack(data, indices, pad_id, config.data.max_length)
    return collate(data, indices, pad_id)
