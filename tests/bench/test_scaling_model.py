"""The scaling model's arithmetic (cpudist.bench.scaling_model), on numbers worked by hand."""

from __future__ import annotations

import dataclasses

import pytest

from cpudist.bench import scaling_model as m
from tests.helpers import bench_result


def test_ring_allreduce_cost() -> None:
    # 4 ranks, 100 MB at 1 Gbit/s, 1 ms: 2 * 3/4 * 0.8 s + 6 * 1 ms.
    assert m.ring_allreduce_s(100e6, 4, 1e9, 1e-3) == pytest.approx(1.2 + 0.006)
    assert m.ring_allreduce_s(100e6, 1, 1e9, 1e-3) == 0.0


def test_one_bucket_is_never_hidden_and_small_buckets_are() -> None:
    one = m.StepProfile(compute_s=2.0, tokens=1000, wire_bytes=20e6, bucket_bytes=25e6)
    # 2 ranks: 2 * 1/2 * 160 Mbit / 1 Gbit/s = 0.16 s, + 2 * 1 ms.
    assert m.exposed_comm_s(one, 2, 1e9, 1e-3) == pytest.approx(0.162)
    # Four 5 MB buckets: 4 x (0.04 + 0.002) = 0.168 s in all; backward (1 s) hides up to 3/4 s,
    # so only the last bucket's 0.042 s shows.
    four = m.StepProfile(compute_s=2.0, tokens=1000, wire_bytes=20e6, bucket_bytes=5e6)
    assert m.exposed_comm_s(four, 2, 1e9, 1e-3) == pytest.approx(0.042)
    # A slow link: 4 x (0.4 + 0.002) = 1.608 s, of which 0.75 s hidden.
    assert m.exposed_comm_s(four, 2, 1e8, 1e-3) == pytest.approx(1.608 - 0.75)


def test_the_embeddings_last_bucket_is_exposed_whatever_backward_hides() -> None:
    # 20 MB: 5 + 5 + 2 MB buckets, then the embedding's 8 MB, handed over when backward (1 s)
    # ends. 2 ranks at 1 Gbit/s: 0.04, 0.04, 0.016, 0.064 s; all but the embedding's hide.
    profile = m.StepProfile(compute_s=2.0, tokens=1000, wire_bytes=20e6, bucket_bytes=5e6,
                            last_bucket_bytes=8e6)
    assert m.bucket_sizes(profile) == [5e6, 5e6, 2e6, 8e6]
    assert m.bucket_sizes(dataclasses.replace(profile, bucket_bytes=25e6)) == [20e6]
    assert m.exposed_comm_s(profile, 2, 1e9, 0.0) == pytest.approx(0.064)
    # Four even buckets of the same 20 MB would leave only a fifth of that exposed.
    even = m.StepProfile(compute_s=2.0, tokens=1000, wire_bytes=20e6, bucket_bytes=5e6)
    assert m.exposed_comm_s(even, 2, 1e9, 0.0) == pytest.approx(0.04)
    # At 100 Mbit/s the queue dominates: ready at 0.25 s, then 1.6 s of transfers.
    assert m.exposed_comm_s(profile, 2, 1e8, 0.0) == pytest.approx(0.25 + 1.6 - 1.0)


def test_prediction_adds_compute_wait_and_exposed_comm() -> None:
    profile = m.StepProfile(compute_s=2.0, tokens=1000, wire_bytes=20e6, bucket_bytes=25e6,
                            imbalance=0.05)
    p = m.predict(profile, 4, 1, 1e9, 1e-3)
    comm = 2 * 3 / 4 * 0.16 + 6e-3
    assert p.exposed_comm_s == pytest.approx(comm) and p.wait_s == pytest.approx(0.1)
    assert p.step_s == pytest.approx(2.1 + comm)
    assert p.tokens_per_s == pytest.approx(4000 / (2.1 + comm))
    # One node of one rank neither waits nor communicates.
    assert m.predict(profile, 1, 1, 1e9, 1e-3).step_s == pytest.approx(2.0)
    assert p.efficiency == pytest.approx(2.0 / (2.1 + comm))


def test_lora_gradient_bytes_of_the_presets() -> None:
    # The figures: about 18 MB for Qwen2.5-0.5B at r=8, 160 MB for a 7B at r=16.
    assert m.lora_gradient_bytes("qwen2.5-0.5b", 8) == 4 * 8 * 22912 * 24
    assert m.lora_gradient_bytes("qwen2.5-7b", 16) / 1e6 == pytest.approx(161.5, abs=0.1)
    # The bench's FLOP formula: one 512-token row of the 0.5B shape is 1.06 TFLOP.
    assert m.step_flops("qwen2.5-0.5b", 8, 512, 1, False) / 1e12 == pytest.approx(1.06, abs=0.01)


def test_profile_from_a_bench_result() -> None:
    figures = dict(world_size=2, s_per_step=3.0, tokens_per_s=400.0, comm_exposed_s_per_step=0.2,
                   wait_for_slowest_s=[0.4, 0.0], comm_mb_per_step=8.0, gradient_mb=16.0,
                   compute_s_per_rank=[2.0, 2.4], comm_last_bucket_mb=3.0,
                   config={"dist": {"grad_compression": "bf16", "bucket_cap_mb": 25.0}})
    p = m.profile_from_bench(bench_result(**figures))
    assert p.compute_s == pytest.approx(3.0 - 0.2 - 0.2)
    assert p.tokens == pytest.approx(600.0) and p.wire_bytes == 8e6
    assert p.bucket_bytes == 12.5e6 and p.imbalance == pytest.approx(2.4 / 2.2 - 1)
    assert p.last_bucket_bytes == 3e6
    single = m.profile_from_bench(bench_result(**{**figures, "world_size": 1,
                                                  "comm_mb_per_step": 0.0,
                                                  "wait_for_slowest_s": [0.0],
                                                  "compute_s_per_rank": [2.8]}))
    assert single.wire_bytes == 8e6  # 16 MB of fp32 gradients, sent in bf16
    assert single.imbalance == 0.0 and single.param_sync_bytes == 0.0
    sharded = m.profile_from_bench(bench_result(**{**figures, "config": {
        **figures["config"], "train": {"zero": True}}}))
    assert sharded.param_sync_bytes == 16e6  # the fp32 weights, as many bytes as their gradients


def test_full_fine_tuning_bytes_flops_and_sharded_optimizer() -> None:
    # SmolLM2-135M's parameter count, as transformers reports it (tied head).
    assert m.full_gradient_bytes("smollm2-135m") == 4 * 134_515_008
    # Every linear and the head trained: 6 FLOPs a weight a token where LoRA's frozen ones cost 4.
    lora = m.step_flops("qwen2.5-0.5b", 8, 512, 1, False)
    full = m.step_flops("qwen2.5-0.5b", 0, 512, 1, False, method="full")
    assert full > lora * 1.4
    # train.zero: after the allreduce, 3/4 of 100 MB of weights gathered at 1 Gbit/s, + 3 x 1 ms.
    plain = m.StepProfile(compute_s=2.0, tokens=1000, wire_bytes=20e6, bucket_bytes=25e6)
    zero = m.StepProfile(compute_s=2.0, tokens=1000, wire_bytes=20e6, bucket_bytes=25e6,
                         param_sync_bytes=100e6)
    assert (m.predict(zero, 4, 1, 1e9, 1e-3).exposed_comm_s
            == pytest.approx(m.predict(plain, 4, 1, 1e9, 1e-3).exposed_comm_s + 0.6 + 0.003))
    assert m.predict(zero, 1, 1, 1e9, 1e-3).step_s == pytest.approx(2.0)
    # The input embedding (tied to the head) is the last bucket: 49152 x 576 fp32, 21 % of it all.
    work = m.Workload("smollm2-135m", 0, 512, 4, False)
    profile = m.machine_profile(m.XEON_SPR_56, work, 1, 25.0, "bf16", 0.05)
    assert profile.last_bucket_bytes == 2 * 49152 * 576
    lora = m.machine_profile(m.XEON_SPR_56, m.WORKLOADS[0], 1, 25.0, "bf16", 0.05)
    assert lora.last_bucket_bytes == 0.0


def test_the_predicted_table_states_its_assumptions() -> None:
    table = m.predicted_table()
    assert table.startswith("Predicted") and "72 TFLOP/s" in table
    # LoRA: 3 links x 2 settings; full: 3 links x 3 settings (fp32, bf16, bf16 + train.zero).
    assert table.count("| qwen2.5-0.5b r=8") == 6 and table.count("| qwen2.5-7b") == 6
    assert table.count("| smollm2-135m full") == 9 and table.count("| qwen2.5-0.5b full") == 9
    assert "100 Gbit/s" in table and "16 node(s)" in table and "train.zero" in table
