"""Failures a long run meets: preemption signals, a rank that dies or hangs, a crash or a write error
during a checkpoint, and non-finite losses. Real processes, real signals, real files."""

from __future__ import annotations

import builtins
import errno
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from safetensors.torch import load_file

from cpudist.files import TMP_MARK
from cpudist.train import checkpoint as ckpt
from tests.helpers import (
    REPO,
    cli_in_process,
    cpudist_cmd,
    mpirun_cmd,
    run,
    start_and_signal,
    step_losses,
    stopped_step,
    tiny_overrides,
)


def rank_processes(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The python rank processes under an mpirun, by rank."""
    ranks = {}
    for child in launcher.children(recursive=True):
        try:
            env = child.environ()
            if "OMPI_COMM_WORLD_RANK" in env and "python" in child.name():
                ranks[int(env["OMPI_COMM_WORLD_RANK"])] = child
        except psutil.Error:
            continue
    return ranks


def wait_for_steps(out: Path, steps: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 300
    while len(step_losses(out)) < steps:
        for proc in procs:
            assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.02)


def gone(pids: list[int], within_s: float = 10.0) -> bool:
    """Every process exited (zombies count: mpirun does not wait for the ranks it SIGKILLs)."""
    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# --------------------------------------------------------------------------- preemption


@pytest.mark.slow
@pytest.mark.mpi
def test_sigterm_to_one_rank_checkpoints_and_every_rank_exits(tiny_llama: Path, chat_file: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [*mpirun_cmd(2), *cpudist_cmd(), "train",
           *tiny_overrides(tiny_llama, chat_file, out, train__max_steps=500, train__batch_size=2)]
    pids: list[int] = []

    def rank1(proc: subprocess.Popen) -> int:
        ranks = rank_processes(psutil.Process(proc.pid))
        pids.extend(p.pid for p in ranks.values())
        return ranks[1].pid

    stopped = start_and_signal(cmd, out, signal.SIGTERM, target=rank1)
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    at = stopped_step(stopped.stdout)
    assert "stopped by signal 15 (SIGTERM)" in stopped.stdout
    assert "train.resume=auto" in stopped.stdout
    state = json.loads((out / "checkpoints" / f"step-{at}" / "state.json").read_text())
    assert state["train"]["step"] == at < 500
    assert gone(pids)


@pytest.mark.slow
@pytest.mark.mpi
def test_sigterm_to_mpirun_ends_the_job_and_leaves_a_resumable_run(tiny_llama: Path,
                                                                   chat_file: Path,
                                                                   tmp_path: Path) -> None:
    """mpirun answers SIGTERM with SIGTERM then SIGKILL 0.25 s later (docs/OPERATIONS.md), so a
    checkpoint may or may not make it; whatever happens, no rank survives, nothing half-written
    counts as a checkpoint, and train.resume=auto continues the run."""
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_llama, chat_file, out, train__max_steps=500,
                               train__batch_size=2, train__save_every=3)
    cmd = [*mpirun_cmd(2), *cpudist_cmd(), "train", *overrides]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        wait_for_steps(out, 4, [proc])
        ranks = rank_processes(psutil.Process(proc.pid))
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert gone([p.pid for p in ranks.values()])
    complete = ckpt.checkpoint_dirs(out / "checkpoints")
    assert complete  # step-3 was written before the signal
    newest = ckpt.load_checkpoint(complete[-1]).state.step
    resumed = run([*mpirun_cmd(2), *cpudist_cmd(), "train", *overrides, "train.resume=auto",
                   f"train.max_steps={newest + 1}"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"at step {newest}" in resumed.stdout
    assert [s for s, _ in step_losses(out)] == list(range(1, newest + 2))


@pytest.mark.slow
@pytest.mark.mpi
def test_sigterm_to_cpudist_launch_checkpoints_and_exits_cleanly(tiny_llama: Path, chat_file: Path,
                                                                 tmp_path: Path) -> None:
    """`cpudist launch` turns SIGTERM into SIGUSR1 for mpirun, which forwards it to every rank
    without killing them: the job checkpoints at the next step boundary and exits 75 (preempted
    with a checkpoint: a scheduler's retry resumes it)."""
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_llama, chat_file, out, train__max_steps=500, train__batch_size=2)
    cmd = [*cpudist_cmd(), "launch", "-np", "2", "--mpi-arg=--oversubscribe", "--", "train",
           *overrides]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        wait_for_steps(out, 3, [proc])
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, stdout[-3000:] + stderr[-3000:]
    at = stopped_step(stdout)
    assert "(SIGUSR1)" in stdout
    assert ckpt.load_checkpoint(out / "checkpoints" / f"step-{at}").state.step == at
    assert "train.resume=auto" in stdout


@pytest.mark.slow
def test_sigint_single_process_checkpoints(tiny_llama: Path, chat_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [*cpudist_cmd(), "train",
           *tiny_overrides(tiny_llama, chat_file, out, train__max_steps=500)]
    stopped = start_and_signal(cmd, out, signal.SIGINT)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    at = stopped_step(stopped.stdout)
    assert "(SIGINT)" in stopped.stdout
    assert (out / "checkpoints" / f"step-{at}" / "state.json").is_file()


# --------------------------------------------------------------------------- dead or hung ranks


@pytest.mark.slow
@pytest.mark.mpi
def test_sigkilled_rank_under_mpirun_ends_the_job(tiny_llama: Path, chat_file: Path,
                                                   tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [*mpirun_cmd(2), *cpudist_cmd(), "train",
           *tiny_overrides(tiny_llama, chat_file, out, train__max_steps=500, train__batch_size=2,
                           dist__timeout_s=5)]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        wait_for_steps(out, 2, [proc])
        ranks = rank_processes(psutil.Process(proc.pid))
        killed = time.monotonic()
        ranks[1].kill()
        stdout, stderr = proc.communicate(timeout=60)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 5 + 10, elapsed
    assert "rank 1" in stdout + stderr  # mpirun names the rank that vanished
    assert gone([p.pid for p in ranks.values()])


def launch_torchrun_style(cmd: list, world: int) -> list[subprocess.Popen]:
    """Start `world` ranks the way torchrun would (RANK/WORLD_SIZE/MASTER_*), without MPI."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("OMPI_", "PMI", "PMIX_", "SLURM_"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=REPO, env=env))
    return procs


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_surviving_rank_exits_within_the_timeout(fault: str, tiny_llama: Path, chat_file: Path,
                                                 tmp_path: Path) -> None:
    """No mpirun to clean up: the other rank itself notices a dead (or hung) peer and exits."""
    timeout_s = 5
    out = tmp_path / "run"
    cmd = [*cpudist_cmd(), "train",
           *tiny_overrides(tiny_llama, chat_file, out, train__max_steps=500, train__batch_size=2,
                           dist__timeout_s=timeout_s)]
    procs = launch_torchrun_style(cmd, 2)
    try:
        wait_for_steps(out, 2, procs)
        hit = time.monotonic()
        procs[1].send_signal(getattr(signal, fault))
        stdout, stderr = procs[0].communicate(timeout=timeout_s + 60)
        elapsed = time.monotonic() - hit
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    assert procs[0].returncode == 76  # lost a peer: a scheduler's retry resumes the job
    assert elapsed < timeout_s + 15, elapsed
    errors = [line for line in stderr.splitlines() + stdout.splitlines() if "error:" in line]
    assert len(errors) == 1, stdout[-2000:] + stderr[-2000:]
    assert errors[0].startswith("[rank 0] error: lost contact with the other ranks")
    fate = "has exited" if fault == "SIGKILL" else "is stopped"
    assert f"On this node rank 1 (pid {procs[1].pid}) {fate}" in errors[0]  # names the lost rank
    assert "train.resume=auto" in errors[0]
    assert "Traceback" not in stderr
    # Where the live rank was waiting: rank 0's stacks in OUTPUT/, down into the training loop
    # (usually the step's gradient allreduce; on a loaded machine it may be a collective at the
    # step boundary instead).
    stacks = (out / "lost-contact-rank0.txt").read_text()
    assert stacks.startswith("[rank 0] stack when contact was lost")
    assert "train/run.py" in stacks and "all threads (faulthandler)" in stacks
    assert str(out / "lost-contact-rank0.txt") in stdout + stderr


# --------------------------------------------------------------------------- checkpoints

KILL_DURING_SAVE = """
import os, signal, sys
from cpudist.train import checkpoint
real_save_file = checkpoint.save_file
def save_file(tensors, path):
    real_save_file(tensors, path)
    if "step-4" in path:  # the second checkpoint: die with half of it written
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save_file = save_file
from cpudist.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_during_save_keeps_previous_checkpoint(tiny_llama: Path, chat_file: Path,
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_llama, chat_file, out, train__max_steps=6, train__save_every=2)
    crashed = run([sys.executable, "-c", KILL_DURING_SAVE, "train", *overrides])
    assert crashed.returncode == -signal.SIGKILL
    root = out / "checkpoints"
    partial = [p.name for p in root.iterdir() if TMP_MARK in p.name]
    assert partial and partial[0].startswith(".step-4.tmp-")
    assert [p.name for p in ckpt.checkpoint_dirs(root)] == ["step-2"]
    loaded = ckpt.load_checkpoint(root / "step-2")  # the previous checkpoint loads
    assert loaded.state.step == 2

    resumed = cli_in_process(capsys, ["train", *overrides, "train.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "removed half-written checkpoint" in resumed.stdout + resumed.stderr
    assert "at step 2" in resumed.stdout
    assert not [p for p in root.iterdir() if TMP_MARK in p.name]
    assert [s for s, _ in step_losses(out)] == [1, 2, 3, 4, 5, 6]


def test_checkpoint_write_failure_stops_and_keeps_previous(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_llama, chat_file, out, train__max_steps=2)
    first = cli_in_process(capsys, ["train", *overrides])
    assert first.returncode == 0, first.stderr[-3000:]

    real_save_file = ckpt.save_file

    def disk_full(tensors: dict, path: str) -> None:  # half a file, then no space left
        real_save_file(tensors, path)
        with open(path, "r+b") as handle:
            handle.truncate(os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "save_file", disk_full)
    failed = cli_in_process(capsys, ["train", *overrides, "train.resume=auto", "train.max_steps=4"])
    assert failed.returncode == 2
    assert "Traceback" not in failed.stderr
    error = failed.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: could not write checkpoint {out / 'checkpoints' / 'step-4'}: "
                            "No space left on device")
    assert f"the previous checkpoint {out / 'checkpoints' / 'step-2'} is intact" in error
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]
    assert ckpt.load_checkpoint(root / "step-2").state.step == 2


class FullDisk:
    """An open file that takes half of a line, then fails as on a full disk."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def __enter__(self) -> FullDisk:
        return self

    def __exit__(self, *_: object) -> None:
        self.handle.close()

    def write(self, data: bytes) -> int:
        self.handle.write(bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_metrics_write_failure_does_not_stop_the_run(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cpudist.report import metrics as report

    calls = [0]

    def open_metrics(*args: Any, **kwargs: Any) -> Any:  # the lines of steps 2 and 3 hit it
        calls[0] += 1
        handle = builtins.open(*args, **kwargs)  # noqa: SIM115 - the caller closes it
        return FullDisk(handle) if calls[0] in (2, 3) else handle

    monkeypatch.setattr(report, "open", open_metrics, raising=False)
    out = tmp_path / "run"
    result = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, chat_file, out,
                                                              train__max_steps=4)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    said = [line for line in (result.stdout + result.stderr).splitlines()
            if str(out / "metrics.jsonl") in line]
    assert len(said) == 2, said
    assert f"could not write {out / 'metrics.jsonl'}: No space left on device" in said[0]
    assert said[1].endswith("works again; 2 logged step(s) are missing from it")
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    assert [s for s, _ in step_losses(out)] == [1, 4]  # whole lines only
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    assert ckpt.load_checkpoint(out / "checkpoints" / "step-4").state.step == 4


# --------------------------------------------------------------------------- numerical faults


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_llama, chat_file, out, train__max_steps=12, train__save_every=1,
                               train__keep_last=10, train__max_bad_steps=3)
    # Step 2 alone is skipped and the run goes on; steps 4, 5, 6 in a row stop it.
    monkeypatch.setenv("CPUDIST_FAULT_NAN_AT_STEP", "2,4,5,6")
    result = cli_in_process(capsys, ["train", *overrides])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "step 2: non-finite loss; update skipped (1 in a row)" in result.stdout
    assert "step 6: non-finite loss; update skipped (3 in a row)" in result.stdout
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: 3 steps in a row had a non-finite loss or gradient (step 6)")
    losses = dict(step_losses(out))
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert [s for s, v in losses.items() if not math.isfinite(v)] == [2, 4, 5, 6]
    saved = ckpt.checkpoint_dirs(out / "checkpoints")
    assert [p.name for p in saved] == ["step-1", "step-2", "step-3", "step-4", "step-5"]
    for path in saved:
        tensors = load_file(str(path / "adapter" / "adapter_model.safetensors"))
        assert all(t.isfinite().all() for t in tensors.values()), path
    # A skipped step leaves the weights as they were; the counters say what happened.
    state = json.loads((saved[-1] / "state.json").read_text())["train"]
    assert state["bad_steps_total"] == 3 and state["bad_steps_in_a_row"] == 2
    step1 = load_file(str(saved[0] / "adapter" / "adapter_model.safetensors"))
    step2 = load_file(str(saved[1] / "adapter" / "adapter_model.safetensors"))
    assert all((step1[k] == step2[k]).all() for k in step1)


def test_final_adapter_write_failure_is_a_clear_error(tiny_llama: Path, chat_file: Path,
                                                      tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "adapter").write_text("a file where the adapter directory goes")
    result = cli_in_process(capsys, ["train",
                                     *tiny_overrides(tiny_llama, chat_file, out, train__max_steps=2)])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: could not write the adapter to {out / 'adapter'}")
    assert ckpt.load_checkpoint(out / "checkpoints" / "step-2").state.step == 2
    assert not [p for p in out.iterdir() if p.name.startswith(".adapter")]
