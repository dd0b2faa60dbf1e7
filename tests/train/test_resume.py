"""Exact resume: a run stopped by a signal and continued with train.resume=auto gives the same
per-step losses, bit for bit, as a run that was never interrupted (fp32, same machine).

Single-process runs train in this process, signalled between two steps (tests.helpers.signal_after);
under mpirun the signal comes from outside, at whatever moment it lands."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.helpers import (
    cli_in_process,
    cpudist_cmd,
    metric_records,
    mpirun_cmd,
    run,
    signal_after,
    start_and_signal,
    step_losses,
    stopped_step,
    tiny_overrides,
)

STEPS = 10  # 24 training samples / global batch 4 = 6 steps per epoch: the run crosses an epoch


def assert_same_run(reference: Path, resumed: Path, stopped_at: int) -> None:
    expected, got = step_losses(reference), step_losses(resumed)
    assert [s for s, _ in got] == list(range(1, STEPS + 1)), "every step exactly once, in order"
    assert 0 < stopped_at < STEPS
    assert got == expected  # bitwise: same floats, not approximately
    records = metric_records(resumed)
    assert [r["lr"] for r in records if "lr" in r] == [r["lr"] for r in metric_records(reference)
                                                       if "lr" in r]
    assert sum(1 for r in records if "val_loss" in r) == 1  # final evaluation, not duplicated
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["steps"] == STEPS


def test_single_process_resume_is_exact(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = {"train__max_steps": STEPS, "lora__dropout": 0.1}  # dropout: the RNG must resume too
    reference = tmp_path / "reference"
    done = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, chat_file, reference,
                                                            **settings)])
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "interrupted"
    args = ["train", *tiny_overrides(tiny_llama, chat_file, out, **settings)]
    with monkeypatch.context() as patch:
        signal_after(patch, 3)
        stopped = cli_in_process(capsys, args)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    at = stopped_step(stopped.stdout)
    assert at == 3
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"stopped by SIGTERM after step 3; checkpoint saved in {out / 'checkpoints'}; resume with "
        "train.resume=auto [exit 75: preempted with a checkpoint (retry: the job resumes from it)]")
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step-{at}"]
    # Nothing a loader would have to unpickle: tensors in safetensors, the rest JSON/YAML/text.
    files = [p for p in (out / "checkpoints").rglob("*") if p.is_file()]
    assert {p.suffix for p in files} <= {".safetensors", ".json", ".yaml", ".md"}, files
    assert (f"Resume it (under the same launcher; another number of ranks keeps the global "
            f"batch) with:\n  cpudist train {out / 'config.yaml'} train.resume=auto") in stopped.stdout

    resumed = cli_in_process(capsys, [*args, "train.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{at}'} at step {at}" in resumed.stdout
    assert_same_run(reference, out, at)


@pytest.mark.slow
@pytest.mark.mpi
def test_two_rank_resume_is_exact(tiny_llama: Path, chat_file: Path, tmp_path: Path) -> None:
    """Stopped by SIGUSR1 to mpirun (forwarded to every rank); every rank's RNG and shard resume."""
    settings = {"train__max_steps": STEPS, "train__batch_size": 2, "lora__dropout": 0.1}
    reference = tmp_path / "reference"
    done = run([*mpirun_cmd(2), *cpudist_cmd(), "train",
                *tiny_overrides(tiny_llama, chat_file, reference, **settings)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    out = tmp_path / "interrupted"
    cmd = [*mpirun_cmd(2), *cpudist_cmd(), "train",
           *tiny_overrides(tiny_llama, chat_file, out, **settings)]
    stopped = start_and_signal(cmd, out, signal.SIGUSR1)
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    at = stopped_step(stopped.stdout)

    resumed = run([*cmd, "train.resume=auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert_same_run(reference, out, at)


@pytest.mark.slow
@pytest.mark.mpi
def test_resume_on_another_world_size_keeps_the_global_batch(tiny_llama: Path, chat_file: Path,
                                                             tmp_path: Path) -> None:
    """2 ranks stopped mid-run, continued by 1 rank: the global batch (2 x 2 rows) is kept as
    1 rank x 2 rows x 2 accumulation steps, the same samples in the same order; losses and the
    final adapter agree with an uninterrupted 2-rank run up to summation order."""
    settings = {"train__max_steps": STEPS, "train__batch_size": 2}
    resumed = continue_on(1, 2, tiny_llama, chat_file, tmp_path, settings)
    assert "resuming a 2-rank checkpoint: global batch 4 kept on 1 rank(s)" in resumed
    assert "global batch 4 = 1 rank(s) x micro-batch 2 x 2 accumulation" in resumed
    assert_close_run(tmp_path / "interrupted", tmp_path / "reference")


@pytest.mark.slow
@pytest.mark.mpi
def test_a_global_batch_that_does_not_divide_is_refused(tiny_llama: Path, chat_file: Path,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_llama, chat_file, out, train__max_steps=2, train__batch_size=3)
    first = run([*cpudist_cmd(), "train", *overrides])
    assert first.returncode == 0, first.stderr[-3000:]
    again = run([*mpirun_cmd(2), *cpudist_cmd(), "train", *overrides, "train.resume=auto",
                 "train.max_steps=4"])
    assert again.returncode != 0
    errors = [line for line in again.stderr.splitlines() if "error:" in line]
    assert errors, again.stderr[-3000:]
    assert "global batch of 3 rows does not divide among 2 ranks" in errors[0]
    assert "resume on 1, 3 ranks" in errors[0]
    assert "Traceback" not in again.stderr


def _launch(ranks: int) -> list[str]:
    return [*(mpirun_cmd(ranks) if ranks > 1 else []), *cpudist_cmd(), "train"]


def continue_on(ranks: int, started_on: int, model: Path, data: Path, tmp_path: Path,
                settings: dict) -> str:
    """An uninterrupted run on started_on ranks (tmp_path/reference), and the same run stopped by
    a signal after a few steps and continued with train.resume=auto on ranks ranks
    (tmp_path/interrupted); returns the continuation's stdout."""
    done = run([*_launch(started_on), *tiny_overrides(model, data, tmp_path / "reference", **settings)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "interrupted"
    overrides = tiny_overrides(model, data, out, **settings)
    stopped = start_and_signal([*_launch(started_on), *overrides], out,
                               signal.SIGUSR1 if started_on > 1 else signal.SIGTERM, after_steps=3)
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert 0 < stopped_step(stopped.stdout) < STEPS
    resumed = run([*_launch(ranks), *overrides, "train.resume=auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return resumed.stdout


def assert_close_run(out: Path, reference: Path) -> None:
    """Every step once, losses within 1e-4 and the adapter within 1e-3 (relative) of the
    reference: equal up to the summation order another world size brings."""
    expected, got = step_losses(reference), step_losses(out)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in expected], rel=1e-4)
    assert adapter_difference(out, reference) <= 1e-3


def adapter_difference(run: Path, reference: Path) -> float:
    """Frobenius norm of the final adapters' difference over the reference's norm."""
    from safetensors.torch import load_file

    final = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    wanted = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    assert final.keys() == wanted.keys()
    difference = sum(float((final[k] - wanted[k]).norm() ** 2) for k in wanted) ** 0.5
    return difference / sum(float(t.norm() ** 2) for t in wanted.values()) ** 0.5


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte flipped inside the newest checkpoint's largest file (the tensors still load: only
    the manifest notices): resume moves it aside, continues from the one before, and ends where
    an uninterrupted run ends, bit for bit."""
    settings = {"train__max_steps": STEPS, "train__save_every": 3}
    reference = tmp_path / "reference"
    done = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, chat_file, reference,
                                                            **settings)])
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "damaged"
    args = ["train", *tiny_overrides(tiny_llama, chat_file, out, **settings)]
    with monkeypatch.context() as patch:
        signal_after(patch, 7)
        stopped = cli_in_process(capsys, args)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    at = stopped_step(stopped.stdout)
    saved = sorted((out / "checkpoints").iterdir(), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in saved] == [f"step-{at - at % 3 if at % 3 else at - 3}", f"step-{at}"]
    newest = saved[-1]
    largest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x01
    largest.write_bytes(bytes(data))

    resumed = cli_in_process(capsys, [*args, "train.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    name = largest.relative_to(newest).as_posix()
    assert f"{newest} is damaged ({name} does not match its SHA-256" in resumed.stdout
    assert f"resumed from {saved[0]} at step" in resumed.stdout
    assert (out / "checkpoints" / f"damaged-{newest.name}").is_dir()
    assert step_losses(out) == step_losses(reference)  # every step once, bit for bit
    assert adapter_difference(out, reference) == 0.0


@pytest.mark.slow
@pytest.mark.mpi
def test_resume_from_one_rank_on_two(tiny_llama: Path, chat_file: Path, tmp_path: Path) -> None:
    """1 rank x 2 rows x 2 accumulation stopped mid-run, continued by 2 ranks x 2 rows: the same
    global batch of 4, losses and adapter as an uninterrupted 1-rank run up to summation order."""
    settings = {"train__max_steps": STEPS, "train__batch_size": 2, "train__grad_accum": 2}
    resumed = continue_on(2, 1, tiny_llama, chat_file, tmp_path, settings)
    assert "resuming a 1-rank checkpoint: global batch 4 kept on 2 rank(s)" in resumed
    assert_close_run(tmp_path / "interrupted", tmp_path / "reference")


@pytest.mark.slow
@pytest.mark.mpi
def test_resume_from_two_ranks_on_four(tiny_llama: Path, chat_file: Path, tmp_path: Path) -> None:
    """2 ranks x 2 rows x 2 accumulation stopped mid-run, continued by 4 ranks x 2 rows (ranks
    that did not exist take rank 0's RNG): losses and adapter as the uninterrupted 2-rank run."""
    settings = {"train__max_steps": STEPS, "train__batch_size": 2, "train__grad_accum": 2}
    resumed = continue_on(4, 2, tiny_llama, chat_file, tmp_path, settings)
    assert "resuming a 2-rank checkpoint: global batch 8 kept on 4 rank(s)" in resumed
    assert_close_run(tmp_path / "interrupted", tmp_path / "reference")
