"""Soak test of supervised restarts: a 2-rank run of a tiny model under
`cpudist launch --restarts R`, with SIGKILLs sent to random ranks at random steps, must finish with
every step logged exactly once, the same final adapter as an uninterrupted 2-rank run (bit for
bit: fp32, lora.dropout=0) and no process of the run left behind.

    .venv/bin/python -m tests.scripts.soak --kills 4 --restarts 5 --steps 60 --seed 1
    (the long form; tests/train/test_soak.py runs a short one)

The seed picks the steps at which kills happen, the delay after that step and the rank: a failure
prints its seed and replays with it (the exact moment inside a step still depends on timing).
It prints one JSON line of figures and exits 1 with the reasons when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a file, too
    sys.path.insert(0, str(REPO))

from tests.helpers import (  # noqa: E402
    chat_rows,
    cpudist_cmd,
    make_tiny_model,
    save_tokenizer,
    tiny_overrides,
    write_jsonl,
)

TAG = "CPUDIST_SOAK_TAG"  # in the environment of every process of one soak run


def tagged(tag: str) -> dict[int, dict[str, str]]:
    """pid -> environment of this machine's processes carrying the run's tag."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"{TAG}={tag}".encode() not in raw.split(b"\0"):
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # dead, waiting to be reaped
        except (OSError, IndexError):
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                   if "=" in item)
        found[int(entry.name)] = env
    return found


def ranks(tag: str) -> dict[int, int]:
    """rank -> pid of the current job's training processes."""
    return {int(env["OMPI_COMM_WORLD_RANK"]): pid for pid, env in tagged(tag).items()
            if "OMPI_COMM_WORLD_RANK" in env}


def current_progress(metrics: Path) -> int:
    """The newest step the running job has logged: step lines after the last restart record
    (the launcher appends it before the job starts; older lines are the killed job's)."""
    newest = 0
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "restart":
            newest = 0
        elif "loss" in record:
            newest = max(newest, int(record["step"]))
    return newest


def train_settings(model: Path, data: Path, out: Path, steps: int, save_every: int) -> list[str]:
    return tiny_overrides(model, data, out, train__max_steps=steps, train__batch_size=2,
                          train__save_every=save_every, train__keep_last=2)


def launch(np: int, settings: list[str], tag: str, *flags: str) -> subprocess.Popen[bytes]:
    cmd = [*cpudist_cmd(), "launch", "-np", str(np), "--allocator", "none", *flags, "--",
           "train", *settings]
    # A slower step (a bigger model's pace) so that a kill lands mid-run, not after the end.
    env = {**os.environ, TAG: tag, "PYTHONUNBUFFERED": "1", "CPUDIST_FAULT_SLOW_STEP_S": "0.15"}
    # Its own process group: whatever happens to this script, the run can be ended as a whole.
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen[bytes], timeout: float, log: Path) -> int:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        log.write_bytes(output or b"")
        raise
    log.write_bytes(output or b"")
    return proc.returncode


def soak(workdir: Path, seed: int, kills: int, restarts: int, steps: int, save_every: int,
         model: Path | None, data: Path | None, timeout: float) -> dict[str, Any]:
    from safetensors.torch import load_file

    started = time.monotonic()
    rng = random.Random(seed)
    if model is None:
        model = make_tiny_model("llama", save_tokenizer(workdir / "tokenizer"), workdir / "model")
    if data is None:
        data = write_jsonl(workdir / "chat.jsonl", chat_rows())
    tag = uuid.uuid4().hex
    failures: list[str] = []

    reference = workdir / "reference"
    ref = launch(2, train_settings(model, data, reference, steps, save_every), tag)
    if finish(ref, timeout, workdir / "reference.log") != 0:
        raise SystemExit(f"the uninterrupted run failed: see {workdir / 'reference.log'}")

    out = workdir / "soaked"
    plan = sorted(rng.randint(1, max(1, steps - 4)) for _ in range(kills))
    proc = launch(2, train_settings(model, data, out, steps, save_every), tag,
                  "--restarts", str(restarts), "--restart-delay", "0.5")
    sent: list[dict[str, Any]] = []
    killed_pids: set[int] = set()
    try:
        for at_step in plan:
            delay, rank = rng.uniform(0, 0.3), rng.randrange(2)
            while proc.poll() is None:
                alive = ranks(tag)
                # A new job (not the one killed last), both ranks up, past the planned step.
                if (len(alive) == 2 and not killed_pids & set(alive.values())
                        and current_progress(out / "metrics.jsonl") >= at_step):
                    break
                if time.monotonic() - started > timeout:
                    raise subprocess.TimeoutExpired("soak", timeout)
                time.sleep(0.02)
            if proc.poll() is not None:
                break
            time.sleep(delay)
            alive = ranks(tag)
            if rank in alive:
                os.kill(alive[rank], signal.SIGKILL)
                sent.append({"after_step": current_progress(out / "metrics.jsonl"),
                             "rank": rank, "pid": alive[rank]})
                # The next kill waits for the next job: these pids end with this one.
                killed_pids = set(alive.values())
        code = finish(proc, max(1.0, timeout - (time.monotonic() - started)),
                      workdir / "soaked.log")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()

    if code != 0:
        failures.append(f"the run under --restarts ended with exit status {code}")
    if len(sent) != kills:
        failures.append(f"{len(sent)} of {kills} kills were sent (the run ended first)")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    logged = [r["step"] for r in records if "loss" in r]
    if logged != list(range(1, steps + 1)):
        failures.append(f"steps logged are not 1..{steps} exactly once: {logged}")
    restarted = [r for r in records if r.get("event") == "restart"]
    if [r["attempt"] for r in restarted] != list(range(1, len(sent) + 1)):
        failures.append(f"restart records {restarted} for {len(sent)} kills")
    final, wanted = (load_file(str(d / "adapter" / "adapter_model.safetensors"))
                     for d in (out, reference))
    if final.keys() != wanted.keys() or any(not (final[k] == wanted[k]).all() for k in wanted):
        failures.append("the final adapter differs from the uninterrupted run's")
    deadline = time.monotonic() + 10
    while (left := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        failures.append(f"processes left behind: {sorted(left)}")
    return {"seed": seed, "kills": len(sent), "kill_plan": sent, "restarts": len(restarted),
            "resumed_from": [r["resumed_from_step"] for r in restarted], "steps": steps,
            "seconds": round(time.monotonic() - started, 1), "failures": failures,
            "workdir": str(workdir)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: random)")
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="a tiny HF model dir (made if "
                        "not given)")
    parser.add_argument("--data", type=Path, default=None, help="a chat JSONL file")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary one, "
                        "kept when a check fails")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole soak")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cpudist-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = soak(workdir, seed, args.kills, args.restarts, args.steps, args.save_every,
                  args.model, args.data, args.timeout)
    print(json.dumps(result))
    if result["failures"]:
        print(f"soak FAILED (replay: --seed {seed}); logs in {workdir}:\n  "
              + "\n  ".join(result["failures"]), file=sys.stderr)
        return 1
    if args.workdir is None:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
