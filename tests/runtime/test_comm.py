"""The one definition of communication and waiting (cpudist.runtime.comm.CommMeter, step_figures,
bus_gbps), on hand-made timings."""

from __future__ import annotations

import pytest

from cpudist.runtime.comm import bus_gbps, step_figures


def test_fast_rank_waits_for_the_slow_one_and_only_the_rest_is_exposed() -> None:
    # Rank 0 computed for 1.0 s, rank 1 for 1.5 s. Rank 0's last allreduce finished 0.7 s after
    # its hand-over: 0.5 s of that was waiting for rank 1, 0.2 s the transfer itself.
    raw = [{"bytes": 8e6, "last_bucket_bytes": 2e6, "compute_s": 1.0, "after_s": 0.7,
            "in_flight_s": 0.9},
           {"bytes": 8e6, "last_bucket_bytes": 2e6, "compute_s": 1.5, "after_s": 0.2,
            "in_flight_s": 0.4}]
    fast, slow = step_figures(raw)
    assert fast["wait_s"] == pytest.approx(0.5) and slow["wait_s"] == 0.0
    assert fast["exposed_s"] == pytest.approx(0.2) and slow["exposed_s"] == pytest.approx(0.2)
    assert fast["busy_s"] == pytest.approx(0.4) and slow["busy_s"] == pytest.approx(0.4)
    assert fast["compute_s"] == 1.0 and fast["bytes"] == 8e6 and fast["last_bucket_bytes"] == 2e6


def test_exposed_time_is_never_negative() -> None:
    raw = [{"bytes": 0.0, "last_bucket_bytes": 0.0, "compute_s": 1.0, "after_s": 0.1,
            "in_flight_s": 0.1},
           {"bytes": 0.0, "last_bucket_bytes": 0.0, "compute_s": 2.0, "after_s": 0.0,
            "in_flight_s": 0.0}]
    assert step_figures(raw)[0]["exposed_s"] == 0.0


def test_bus_bandwidth_is_the_ring_convention() -> None:
    # 4 ranks, 1 GB each in 1.5 s: a ring moves 2 * 3/4 GB per rank -> 1 GB/s.
    assert bus_gbps(1e9, 1.5, 4) == pytest.approx(1.0)
    assert bus_gbps(1e9, 0.0, 4) == 0.0 and bus_gbps(1e9, 1.0, 1) == 0.0


def test_allreduce_takes_only_the_ops_it_implements() -> None:
    import torch.distributed as dist

    from cpudist.runtime.cluster import Placement
    from cpudist.runtime.comm import allreduce, reduce_op

    single = Placement(rank=0, world_size=1, local_rank=0, local_size=1, launcher="single")
    assert allreduce([1.0, 2.0], single, op="min") == [1.0, 2.0]
    assert reduce_op("min") == dist.ReduceOp.MIN and reduce_op("max") == dist.ReduceOp.MAX
    assert reduce_op("sum") == dist.ReduceOp.SUM
    with pytest.raises(ValueError, match="allreduce op 'mean'"):
        allreduce([1.0], single, op="mean")
