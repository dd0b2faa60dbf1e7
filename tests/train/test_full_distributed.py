"""peft.method=full under real `mpirun -np 2`: the same losses as one rank (fp32, same global batch),
over gloo and over dist.backend=mpi; ZeroRedundancyOptimizer (train.zero) equal to plain AdamW; a
ZeRO checkpoint continued on one rank; bf16 gradient compression."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.helpers import (
    cli_in_process,
    cpudist_cmd,
    mpirun_cmd,
    run,
    start_and_signal,
    step_losses,
    stopped_step,
    tiny_overrides,
)
from tests.train.test_distributed import unique_chat_file
from tests.train.test_full import model_tensors

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 6
# Global batch 8 = 1 rank x 4 rows x 2 accumulation = 2 ranks x 2 rows x 2 accumulation.
SETTINGS = {"peft__method": "full", "train__max_steps": STEPS, "train__lr": 1e-3,
            "train__grad_accum": 2}


def two_ranks(model: Path, data: Path, out: Path, **extra: object) -> list[str]:
    return [*mpirun_cmd(2), *cpudist_cmd(), "train",
            *tiny_overrides(model, data, out, train__batch_size=2, **{**SETTINGS, **extra})]


def losses(out: Path) -> list[float]:
    got = step_losses(out)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    return [loss for _, loss in got]


def model_difference(out: Path, reference: Path) -> float:
    """Frobenius norm of the final models' difference over the reference's norm."""
    final, wanted = model_tensors(out / "model"), model_tensors(reference / "model")
    assert final.keys() == wanted.keys()
    difference = sum(float((final[k] - wanted[k]).norm() ** 2) for k in wanted) ** 0.5
    return difference / sum(float(t.norm() ** 2) for t in wanted.values()) ** 0.5


def test_full_two_ranks_match_one_zero_matches_plain_resumes_on_one_rank_bf16_hook(
        tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = unique_chat_file(tmp_path / "unique.jsonl")
    one = tmp_path / "one"
    single = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, data, one,
                                                              train__batch_size=4, **SETTINGS)])
    assert single.returncode == 0, single.stderr[-3000:]

    # Every step's model kept, for comparing with the ZeRO run's checkpoint below.
    plain = tmp_path / "gloo"
    done = run(two_ranks(tiny_llama, data, plain, dist__backend="gloo", train__save_every=1,
                         train__keep_last=STEPS), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert losses(plain) == pytest.approx(losses(one), rel=1e-5)

    # ZeRO over dist.backend=mpi, stopped mid-way (its optimizer state gathered from both ranks
    # into the checkpoint): equal to plain AdamW so far; continued on one rank, as the
    # uninterrupted run up to summation order.
    out = tmp_path / "zero-mpi"
    zero = {**SETTINGS, "dist__backend": "mpi", "train__zero": True}
    stopped = start_and_signal(two_ranks(tiny_llama, data, out, **zero), out, signal.SIGUSR1,
                               after_steps=2)
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    at = stopped_step(stopped.stdout)
    assert 0 < at < STEPS
    assert "train.zero: AdamW state sharded across the ranks" in stopped.stdout
    assert "DDP comm hook: MPI Allreduce" in stopped.stdout
    assert [v for _, v in step_losses(out)] == pytest.approx(losses(plain)[:at], rel=1e-6)
    checkpoint = f"checkpoints/step-{at}"
    assert model_difference(out / checkpoint, plain / checkpoint) <= 1e-6
    resumed = cli_in_process(capsys, ["train", *tiny_overrides(
        tiny_llama, data, out, train__batch_size=2, **zero), "train.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming a 2-rank checkpoint: global batch 8 kept on 1 rank(s)" in resumed.stdout
    assert losses(out) == pytest.approx(losses(plain), rel=1e-4)
    assert model_difference(out, plain) <= 1e-3

    # bf16 gradient compression carries every gradient of the whole model: the run trains as
    # fp32's does, to bf16's precision, and does differ (the hook was on the path).
    compressed = tmp_path / "bf16"
    done = run(two_ranks(tiny_llama, data, compressed, dist__grad_compression="bf16"),
               timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert losses(compressed)[0] == losses(plain)[0]  # before any update
    assert losses(compressed) == pytest.approx(losses(plain), rel=1e-2)
    assert losses(compressed) != losses(plain)
