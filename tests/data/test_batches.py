"""Batches: padded and packed rows, and one global order that every rank cuts a disjoint share of."""

from __future__ import annotations

import pytest

from cpudist.data.batches import GlobalBatches, collate, pack
from cpudist.data.tokenize import IGNORE, TokenizedSplit
from cpudist.errors import UserError


def _split(lengths: list[int]) -> TokenizedSplit:
    ids = [list(range(1, n + 1)) for n in lengths]
    return TokenizedSplit(ids, [list(x) for x in ids])


@pytest.mark.parametrize("group", [False, True])
def test_ranks_get_disjoint_equal_shards_of_the_same_global_batches(group: bool) -> None:
    data = _split([5 + (i * 7) % 23 for i in range(50)])
    one = GlobalBatches(data, batch_size=4, grad_accum=2, world=1, seed=1, group_by_length=group)
    two = GlobalBatches(data, batch_size=2, grad_accum=2, world=2, seed=1, group_by_length=group)
    assert one.steps_per_epoch == two.steps_per_epoch == 6
    for step in range(two.steps_per_epoch):
        r0, r1 = two.step_batches(0, step, 0), two.step_batches(0, step, 1)
        whole = one.step_batches(0, step, 0)
        for k in range(2):
            assert not set(r0[k]) & set(r1[k])
            assert sorted(r0[k] + r1[k]) == sorted(whole[k])
    assert one.epoch_order(0) != one.epoch_order(1)


def test_too_small_dataset_is_a_clear_error() -> None:
    with pytest.raises(UserError, match="fewer than one global batch"):
        GlobalBatches(_split([3, 4, 5]), batch_size=2, grad_accum=1, world=2, seed=0,
                      group_by_length=False)


def test_collate_pads_right_and_pack_resets_positions() -> None:
    data = _split([3, 5, 2])
    batch = collate(data, [0, 1, 2], pad_id=0)
    assert batch.input_ids.shape == (3, 5)
    assert batch.attention_mask.sum().item() == 10 and batch.tokens == 10
    assert batch.labels[2, 2:].eq(IGNORE).all()
    packed = pack(data, [0, 1, 2], pad_id=0, max_length=8)
    assert packed.input_ids.shape[0] == 2  # 3+5 fill row one, 2 goes to row two
    assert packed.position_ids is not None
    assert packed.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert packed.attention_mask[0].tolist() == [1, 1, 1, 2, 2, 2, 2, 2]
    # The first token of each packed sample is never a target of the previous sample.
    assert packed.labels[0, 3].item() == IGNORE


def test_ranks_of_a_step_get_balanced_token_counts_on_skewed_lengths() -> None:
    # Long-tailed lengths (most short, a few very long), grouped by length: the contiguous cut
    # gave rank 0 the longest samples of every micro-batch.
    lengths = [8 + (i * 37) % 40 + (400 if i % 11 == 0 else 0) for i in range(256)]
    data = _split(lengths)
    world, batch = 4, 4
    batches = GlobalBatches(data, batch_size=batch, grad_accum=2, world=world, seed=3,
                            group_by_length=True)
    worst = 0.0
    for step in range(batches.steps_per_epoch):
        per_rank = [sum(lengths[i] for micro in batches.step_batches(0, step, r) for i in micro)
                    for r in range(world)]
        assert all(len(m) == batch for r in range(world) for m in batches.step_batches(0, step, r))
        worst = max(worst, (max(per_rank) - min(per_rank)) / (sum(per_rank) / world))
    # Greedy longest-first leaves at most about one sample's length between ranks.
    assert worst < 0.15, worst


def test_balance_is_deterministic_and_keeps_the_sample_set() -> None:
    from cpudist.data.batches import balance

    lengths = [50, 3, 40, 7, 7, 30, 1, 12]
    shares = balance(list(range(8)), lengths, 2)
    assert shares == balance(list(range(8)), lengths, 2)
    assert sorted(shares[0] + shares[1]) == list(range(8))
    assert [len(s) for s in shares] == [4, 4]
    # 50+12+7+7 against 40+30+3+1: greedy, not optimal (75/75), but within the shortest sample.
    assert [sum(lengths[i] for i in s) for s in shares] == [76, 74]
    assert balance([5, 2], lengths, 1) == [[5, 2]]
