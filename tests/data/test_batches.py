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
