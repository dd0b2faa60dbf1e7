"""`cpudist launch --restarts`: which failures start the job again, with what, how often, and the
records it leaves; against a fake mpirun (the real one: tests/train/test_soak.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpudist.launch.runner import restart_reason, shrunk_np
from cpudist.train.checkpoint_files import write_manifest
from tests.helpers import REPO


def fake_mpirun(tmp_path: Path, codes: list[int], body: str = "") -> Path:
    """An Open MPI look-alike: each run appends its arguments to calls.txt, runs `body`, then
    exits with the next of `codes`."""
    fake = tmp_path / "mpirun"
    fake.write_text(f"""#!/bin/bash
[ "$1" = --version ] && {{ echo 'mpirun (Open MPI) 5.0.11'; exit 0; }}
echo "$*" >> {tmp_path}/calls.txt
n=$(wc -l < {tmp_path}/calls.txt)
codes=({' '.join(map(str, codes))})
{body}
exit ${{codes[$((n - 1))]}}
""")
    fake.chmod(0o755)
    return fake


def launch_cmd(fake: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "cpudist.cli", "launch", "-np", "2", "--mpirun", str(fake),
            "--allocator", "none", "--restart-delay", "0", *flags, "--", "train",
            f"output.dir={out}", "train.max_steps=3"]


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []


def restart_records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"event"' in line]


def run_launch(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_which_failures_are_restarted() -> None:
    """The exit classes of cpudist.errors.ExitCode: retry a lost peer, a preemption with a
    checkpoint and a killed rank; not a finished job, bad input, the memory plan's refusal, an
    internal error or Ctrl-C, which a restart would only repeat."""
    assert restart_reason(137, stopped=False) == ("exit status 137: a rank was killed by "
                                                  "SIGKILL")
    assert restart_reason(76, stopped=False).startswith("exit status 76: lost a peer rank")
    assert restart_reason(75, stopped=False).startswith("exit status 75: preempted")
    assert restart_reason(5, stopped=False) == "exit status 5: a rank or mpirun failed"
    for code in (0, 1, 2, 3, 130):
        assert restart_reason(code, stopped=False) is None, code
    assert restart_reason(137, stopped=True) is None  # the user stopped the job
    assert restart_reason(75, stopped=True) is None


def test_a_killed_rank_restarts_the_job_resuming_with_a_record(tmp_path: Path) -> None:
    out = tmp_path / "out"
    step = out / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    write_manifest(step)
    (out / "metrics.jsonl").write_text('{"step": 4}\n{"step": 5, "lo')  # cut short by the kill
    done = run_launch(launch_cmd(fake_mpirun(tmp_path, [137, 76, 0]), out, "--restarts", "3"))
    assert done.returncode == 0, done.stderr
    made = calls(tmp_path)
    assert len(made) == 3
    assert "train.resume=auto" not in made[0]
    assert all(c.endswith("train.max_steps=3 train.resume=auto") for c in made[1:])
    assert "restart 1 of 3" in done.stderr and "restart 2 of 3" in done.stderr
    records = restart_records(out)
    assert [(r["attempt"], r["reason"], r["resumed_from_step"]) for r in records] == [
        (1, "exit status 137: a rank was killed by SIGKILL", 4),
        (2, "exit status 76: lost a peer rank (retry: the job resumes from the newest "
            "checkpoint)", 4)]
    assert all(r["time"].endswith("+00:00") for r in records)
    assert (out / "metrics.jsonl").read_text().startswith('{"step": 4}\n{"event": "restart"')


def test_bad_input_and_the_restart_limit_end_the_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for code in (2, 3, 1):  # bad input, the memory plan, an internal error
        done = run_launch(launch_cmd(fake_mpirun(tmp_path, [code]), out, "--restarts", "3"))
        assert done.returncode == code and len(calls(tmp_path)) == 1
        (tmp_path / "calls.txt").unlink()
    done = run_launch(launch_cmd(fake_mpirun(tmp_path, [137, 137, 137]), out, "--restarts", "1"))
    assert done.returncode == 137 and len(calls(tmp_path)) == 2
    assert "no restart left of --restarts 1" in done.stderr
    assert [r["attempt"] for r in restart_records(out)] == [1]


def test_without_restarts_a_failure_ends_the_run(tmp_path: Path) -> None:
    done = run_launch(launch_cmd(fake_mpirun(tmp_path, [137, 0]), tmp_path / "out"))
    assert done.returncode == 137 and len(calls(tmp_path)) == 1
    assert not (tmp_path / "out").exists()


def test_a_shrunk_hostfile_restarts_on_fewer_ranks_down_to_min_np(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    # The job's first run loses a host: the hostfile now offers one slot.
    fake = fake_mpirun(tmp_path, [137, 0], body=f'echo "localhost slots=1" > {hosts}')
    out = tmp_path / "out"
    done = run_launch(launch_cmd(fake, out, "--hostfile", str(hosts), "--restarts", "2",
                                 "--min-np", "1"))
    assert done.returncode == 0, done.stderr
    assert [c.split()[:2] for c in calls(tmp_path)] == [["-np", "2"], ["-np", "1"]]
    assert "now has 1 slot(s) of 2: restarting on 1 rank(s)" in done.stderr
    (tmp_path / "calls.txt").unlink()
    hosts.write_text("localhost slots=2\n")
    done = run_launch(launch_cmd(fake, out, "--hostfile", str(hosts), "--restarts", "2"))
    assert done.returncode == 137 and len(calls(tmp_path)) == 1
    assert "fewer than --min-np 2" in done.stderr


def test_only_hosts_taken_out_shrink_the_job() -> None:
    assert shrunk_np(2, 2, 2) == 2
    assert shrunk_np(8, 8, 6) == 6  # two slots gone
    assert shrunk_np(4, 8, 6) == 4  # still room
    assert shrunk_np(16, 2, 2) == 16  # bare host names, oversubscribed from the start
    assert shrunk_np(16, 4, 2) == 8  # ... and half the hosts gone


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finding them needs Linux /proc")
def test_processes_mpirun_leaves_behind_are_killed(tmp_path: Path) -> None:
    fake = fake_mpirun(tmp_path, [137, 0], body=f"sleep 300 & echo $! >> {tmp_path}/left.txt")
    done = run_launch(launch_cmd(fake, tmp_path / "out", "--restarts", "1"))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("killed 1 process(es) of the job") == 2
    for pid in map(int, (tmp_path / "left.txt").read_text().split()):
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_a_job_the_user_stops_is_not_restarted(tmp_path: Path) -> None:
    # The launcher turns SIGTERM into SIGUSR1 for the ranks; this job then exits non-zero.
    fake = fake_mpirun(tmp_path, [0], body="trap 'exit 1' USR1; sleep 30 & wait")
    proc = subprocess.Popen(launch_cmd(fake, tmp_path / "out", "--restarts", "3"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not calls(tmp_path):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stderr
    assert len(calls(tmp_path)) == 1 and "restart" not in stderr


def test_restart_flags_that_do_not_fit(tmp_path: Path) -> None:
    fake = fake_mpirun(tmp_path, [0])
    base = [sys.executable, "-m", "cpudist.cli", "launch", "-np", "2", "--mpirun", str(fake)]
    done = run_launch([*base, "--restarts", "2", "--", "bench"])
    assert done.returncode == 2 and "restart `train` jobs only, not bench" in done.stderr
    done = run_launch([*base, "--min-np", "1", "--", "train"])
    assert done.returncode == 2 and "--min-np applies to restarts" in done.stderr
    done = run_launch([*base, "--restarts", "2", "--min-np", "3", "--", "train"])
    assert done.returncode == 2 and "--min-np 3 is more than -np 2" in done.stderr
    assert not calls(tmp_path)


def test_note_restart_writes_one_record(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_launch([sys.executable, "-m", "cpudist.cli", "launch", "-np", "2",
                       "--note-restart", "3", "--reason", "slurm requeue", "--", "train",
                       f"output.dir={out}"])
    assert done.returncode == 0, done.stderr
    [record] = restart_records(out)
    assert (record["attempt"], record["reason"], record["resumed_from_step"]) == (
        3, "slurm requeue", 0)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_slurm_batch_file_restarts_and_continues_a_requeued_job(tmp_path: Path) -> None:
    """launch/slurm.sbatch with CPUDIST_RESTARTS and a fake srun: a failed srun runs again with
    train.resume=auto and a record; a requeued job (SLURM_RESTART_COUNT) resumes from the start."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_mpirun(bin_dir, [137, 0]).rename(bin_dir / "srun")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", CPUDIST_PYTHON=sys.executable,
               CPUDIST_RESTARTS="2", CPUDIST_RESTART_DELAY="0", SLURM_CPUS_PER_TASK="1")
    script = ["bash", "launch/slurm.sbatch", f"output.dir={out}", "train.max_steps=3"]
    done = subprocess.run(script, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    made = calls(bin_dir)
    assert len(made) == 2 and "train.resume=auto" not in made[0]
    assert made[1].endswith("dist.threads_per_rank=1 train.resume=auto")
    assert [(r["attempt"], r["reason"]) for r in restart_records(out)] == [
        (1, "srun exit status 137")]

    (bin_dir / "calls.txt").unlink()
    env.update(SLURM_RESTART_COUNT="1", CPUDIST_RESTARTS="0")
    done = subprocess.run(script, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 137 and "no restart left" in done.stderr
    assert calls(bin_dir)[0].endswith("train.resume=auto")
    assert restart_records(out)[-1]["reason"] == "slurm requeue 1"
