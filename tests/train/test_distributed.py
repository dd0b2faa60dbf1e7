"""Real `mpirun -np 2` on localhost: DDP gradients, 2-rank vs 1-rank loss curves, rank-0-only output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import SCRIPTS, cpudist_cmd, mpirun_cmd, run, tiny_overrides, write_jsonl

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def unique_chat_file(path: Path, count: int = 32) -> Path:
    """Every sample different, so two ranks' shards really give different gradients."""
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i + 3}?"},
                          {"role": "assistant", "content": f"{i} plus {i + 3} is {2 * i + 3}."}]}
            for i in range(count)]
    return write_jsonl(path, rows)


def losses(out: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def test_ddp_gradients_identical_across_ranks_gloo_and_mpi(tiny_llama: Path, tmp_path: Path) -> None:
    data = unique_chat_file(tmp_path / "unique.jsonl")
    script = SCRIPTS / "mpi_ddp_check.py"
    result = run([*mpirun_cmd(2), sys.executable, script, tiny_llama, data, tmp_path / "cache",
                  "gloo", "mpi", "mpi-nonblocking", "gloo-bf16", "mpi-bf16",
                  "mpi-nonblocking-bf16"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "backend=mpi->gloo" in result.stdout  # the log line says which path ran and why
    for path in ("gloo", "mpi", "mpi-nonblocking", "gloo-bf16", "mpi-bf16", "mpi-nonblocking-bf16"):
        for rank in (0, 1):
            assert f"DDP-CHECK-OK {path} rank={rank}" in result.stdout, result.stdout[-3000:]


def test_two_ranks_match_one_rank_and_only_rank0_writes(tiny_llama: Path, tmp_path: Path) -> None:
    data = unique_chat_file(tmp_path / "unique.jsonl")
    common = {"train__grad_accum": 2, "train__max_steps": 4}
    one = tmp_path / "one"
    single = run([*cpudist_cmd(), "train",
                  *tiny_overrides(tiny_llama, data, one, train__batch_size=4, **common)])
    assert single.returncode == 0, single.stderr[-3000:]
    # The command ran itself again with MKL's shim preloaded where this machine wants it.
    from cpudist.runtime.mkl_shim import library

    assert ("MKL: kernels chosen by the CPU's features (cpudist's shim preloaded)" if library()
            else "MKL: as shipped (") in single.stdout + single.stderr

    two = tmp_path / "two"
    logs = tmp_path / "logs"
    rank_cwd = tmp_path / "rank-cwd"
    rank_cwd.mkdir()
    harness = [sys.executable, SCRIPTS / "rank_harness.py", logs]
    args = ["train", *tiny_overrides(tiny_llama, data, two, train__batch_size=2,
                                     dist__backend="mpi", **common)]
    result = run([*mpirun_cmd(2), "--wdir", rank_cwd, *harness, *args], timeout=300)
    assert result.returncode == 0, (logs / "rank0.err").read_text()[-3000:]

    # Same global batch (4 per rank x 2 accumulation x 1 rank = 2 x 2 x 2), same seed: same curve.
    expected, got = losses(one), losses(two)
    assert [s for s, _ in got] == [1, 2, 3, 4] == [s for s, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-4)

    log = (logs / "rank0.out").read_text()
    assert "global batch: 8 = 2 per rank x 2 accumulation x 2 ranks" in log
    assert "communication: backend=mpi->gloo (requested mpi: gloo for setup, gradient allreduce " \
           "through mpi4py)" in log
    assert "; DDP comm hook: MPI Allreduce; collective timeout 300 s" in log
    # tokens/s counts the whole job's tokens (summed over ranks), not rank 0's half.
    def tokens_first_step(out: Path) -> float:
        first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        return first["tokens_per_s"] * first["step_s"]

    assert tokens_first_step(two) == pytest.approx(tokens_first_step(one), rel=1e-6)

    # Rank 1 printed nothing (warnings/errors only, and those carry its rank) ...
    assert (logs / "rank1.out").read_text() == ""
    for line in (logs / "rank1.err").read_text().splitlines():
        assert line.startswith("[rank 1] "), line
    # ... and wrote nothing in the output directory or its working directory.
    writes = json.loads((logs / "rank1.writes.json").read_text())
    assert not [p for p in writes if p.startswith(str(two)) or p.startswith(str(rank_cwd))], writes
    assert list(rank_cwd.iterdir()) == []
    rank0_writes = json.loads((logs / "rank0.writes.json").read_text())
    assert any(p.startswith(str(two / "checkpoints")) for p in rank0_writes)  # the audit works

    # Rank 0 wrote the same set of files a single process writes.
    def listing(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*"))

    assert listing(two) == listing(one)


def _bench_two_ranks(model: Path, tmp_path: Path, name: str, *overrides: str) -> dict:
    out = tmp_path / f"{name}.json"
    result = run([*mpirun_cmd(2), sys.executable, "-m", "cpudist.cli", "bench",
                  f"model.path={model}", f"data.cache_dir={tmp_path / 'data-cache'}",
                  "train.lr=5e-3", "lora.dropout=0.0", "dist.backend=gloo", *overrides,
                  "--steps", str(COMPRESSION_STEPS), "--warmup", "0", "--seq-len", "32",
                  "--batch-size", "2", "--dtype", "float32", "--threads", "1",
                  "--allocator", "none", "--json", out], timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


COMPRESSION_STEPS = 20


def test_bf16_gradient_compression_keeps_the_losses_and_halves_the_bytes(
        tiny_qwen: Path, tmp_path: Path) -> None:
    """dist.grad_compression=bf16 over 2 ranks, fp32 compute: the loss curve of 20 steps stays
    within 1e-3 (relative) of the fp32-gradient run, and the bytes allreduced per step halve."""
    full = _bench_two_ranks(tiny_qwen, tmp_path, "fp32", "dist.grad_compression=none")
    half = _bench_two_ranks(tiny_qwen, tmp_path, "bf16", "dist.grad_compression=bf16")
    assert len(full["losses"]) == len(half["losses"]) == COMPRESSION_STEPS
    assert full["losses"][-1] < full["losses"][0]  # it trained: the curve is worth comparing
    for step, (a, b) in enumerate(zip(full["losses"], half["losses"], strict=True)):
        assert abs(a - b) <= 1e-3 * abs(a), (step, a, b)
    # Every gradient element once per step, 4 bytes in fp32 and 2 in bf16.
    assert full["comm_mb_per_step"] == pytest.approx(full["gradient_mb"])
    assert half["comm_mb_per_step"] == pytest.approx(full["comm_mb_per_step"] / 2)
    assert len(half["compute_s_per_rank"]) == len(half["wait_for_slowest_s"]) == 2
