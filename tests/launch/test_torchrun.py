"""cpudist started by real torchrun: the same run as under mpirun, and torchrun's restarts
(--max-restarts) continued from the newest checkpoint without train.resume=auto, each restart a
record in metrics.jsonl; the run tracked in a real MLflow server by rank 0 alone, once, across
the restart; an elastic job (--nnodes 1:2) that loses a fake node continues on the one left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import (
    cpudist_cmd,
    cpudist_in_process,
    metric_records,
    mpirun_cmd,
    run,
    start_and_signal,
    step_losses,
    tiny_overrides,
)

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

STEPS = 8


def torchrun_cmd(nproc: int, *options: str) -> list[str]:
    """Real torchrun from the venv, one node (--standalone: c10d rendezvous on a free port)."""
    return [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node",
            str(nproc), "--monitor-interval", "0.2", *options, "--no-python", *cpudist_cmd()]


def worker(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's worker of this rank (RANK in its environment)."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "cpudist.cli" in child.cmdline():
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker of rank {rank} under torchrun")


def test_a_killed_rank_is_restarted_by_torchrun_and_ends_as_under_mpirun(
        tiny_llama: Path, chat_file: Path, tmp_path: Path, mlflow_server: str) -> None:
    """2 ranks under torchrun --max-restarts 2, rank 1 SIGKILLed after step 3 (checkpoint at step
    2): torchrun starts both again, cpudist resumes from step 2 by itself, and the run ends with
    the losses and adapter of the same run under mpirun -np 2 (fp32, one thread per rank)."""
    settings = {"train__max_steps": STEPS, "train__batch_size": 2, "train__save_every": 2,
                "dist__threads_per_rank": 1}
    reference = tmp_path / "mpirun"
    done = run([*mpirun_cmd(2), *cpudist_cmd(), "train",
                *tiny_overrides(tiny_llama, chat_file, reference, **settings)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    out = tmp_path / "torchrun"
    tracked = [f"tracking.mlflow_uri={mlflow_server}", "tracking.mlflow_experiment=torchrun",
               "tracking.tags={team: nlp}"]
    cmd = [*torchrun_cmd(2, "--max-restarts", "2"), "train",
           *tiny_overrides(tiny_llama, chat_file, out, **settings), *tracked]
    done = start_and_signal(cmd, out, signal.SIGKILL, after_steps=3,
                            target=lambda launcher: worker(launcher, 1))
    log = done.stdout + done.stderr
    (tmp_path / "torchrun.log").write_text(log)
    assert done.returncode == 0, log[-5000:]
    assert "restart 1 by torchrun: resuming from the newest checkpoint" in log
    assert "ranks: 2 (torchrun), this node: 2, threads per rank: 1" in log
    assert "cores of each rank here:" in log  # each rank pinned to its own share

    expected, got = step_losses(reference), step_losses(out)
    assert [s for s, _ in got] == list(range(1, STEPS + 1)), "every step once, in order"
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in expected],
                                                      abs=1e-6, rel=0)
    restarts = [r for r in metric_records(out) if r.get("event") == "restart"]
    assert [(r["attempt"], r["resumed_from_step"]) for r in restarts] == [(1, 2)]
    assert "torchrun started the workers again" in restarts[0]["reason"]
    assert_same_adapter(out, reference)
    assert_tracked_once(mlflow_server, "torchrun", out)


def assert_same_adapter(out: Path, reference: Path) -> None:
    from safetensors.torch import load_file

    got = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    wanted = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    assert got.keys() == wanted.keys()
    assert max(float((got[k] - wanted[k]).abs().max()) for k in wanted) <= 1e-6


def assert_tracked_once(uri: str, experiment: str, out: Path) -> None:
    """One MLflow run (rank 0's), finished, holding the config, every step once and the run's
    files; the same run OUTPUT/tracking.json names."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    [tracked] = client.search_runs([found.experiment_id])
    assert tracked.info.status == "FINISHED"
    assert tracked.info.run_id == json.loads((out / "tracking.json").read_text())["mlflow"]["run_id"]
    assert tracked.data.params["train.max_steps"] == str(STEPS)
    assert tracked.data.tags["team"] == "nlp"
    history = client.get_metric_history(tracked.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    losses = dict(step_losses(out))
    assert all(m.value == pytest.approx(losses[m.step], rel=1e-6) for m in history)
    assert [m.step for m in client.get_metric_history(tracked.info.run_id, "val_loss")] \
        == [0, STEPS]
    files = {f.path for f in client.list_artifacts(tracked.info.run_id)}
    assert {"adapter", "summary.json"} <= files
    adapter = {f.path for f in client.list_artifacts(tracked.info.run_id, "adapter")}
    assert "adapter/adapter_model.safetensors" in adapter


@pytest.mark.netns
def test_two_fake_nodes_rendezvous_across_the_veth_and_match_mpirun(
        netns_cluster: Any, tiny_llama: Path, chat_file: Path, tmp_path: Path) -> None:
    """One torchrun agent per fake node (network namespaces), c10d rendezvous on node 0's veth
    address: 2 ranks, one per node, train to the losses of the same run under mpirun -np 2."""
    settings = {"train__max_steps": 4, "train__batch_size": 2, "dist__threads_per_rank": 1}
    reference = tmp_path / "mpirun"
    done = run([*mpirun_cmd(2), *cpudist_cmd(), "train",
                *tiny_overrides(tiny_llama, chat_file, reference, **settings)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "torchrun"
    agents = [subprocess.Popen(netns_cluster.exec_argv(node, [
        str(Path(sys.executable).with_name("torchrun")), "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{netns_cluster.address(0)}:29477",
        "--rdzv-id", "two-nodes", "--local-addr", netns_cluster.address(index), "--no-python",
        *cpudist_cmd(), "train", *tiny_overrides(tiny_llama, chat_file, out, **settings),
        f"dist.interface={netns_cluster.ifname}"]), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for index, node in enumerate(netns_cluster.nodes)]
    logs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "ranks: 2 (torchrun), this node: 1" in logs[0] + logs[1]
    assert netns_cluster.address(0) in logs[0] + logs[1]  # the store on node 0's veth address
    expected, got = step_losses(reference), step_losses(out)
    assert [s for s, _ in got] == [1, 2, 3, 4]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in expected],
                                                      abs=1e-6, rel=0)
    assert_same_adapter(out, reference)


def node_pids(node: str) -> list[int]:
    """Every process in a fake node (network namespace)."""
    found = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True,
                           timeout=30)
    return [int(pid) for pid in found.stdout.split()]


def lose_node(node: str) -> None:
    """The node gone: its torchrun agent and its workers, which torchrun starts in sessions of
    their own (killing the agent's process group alone leaves them training)."""
    for pid in node_pids(node):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.netns
def test_an_elastic_job_that_loses_a_node_continues_on_the_node_left(
        netns_cluster: Any, tiny_llama: Path, chat_file: Path, tmp_path: Path) -> None:
    """torchrun --nnodes 1:2 on two fake nodes (one rank each), node 1 lost after step 2: node 0's
    rank loses its peer (exit 76), its agent restarts it, the next rendezvous closes with node 0
    alone once node 1's heartbeats stop, and cpudist resumes the 2-rank checkpoint on 1 rank with
    the global batch kept (2 rows x 2 accumulation), every step once, the losses and adapter of
    an uninterrupted run with the same global batch up to summation order."""
    from tests.train.test_resume import adapter_difference

    steps = 8
    settings = {"train__max_steps": steps, "train__batch_size": 2, "train__save_every": 2,
                "dist__threads_per_rank": 1, "dist__timeout_s": 30}
    reference = tmp_path / "reference"
    assert cpudist_in_process(["train", *tiny_overrides(
        tiny_llama, chat_file, reference, **{**settings, "train__batch_size": 4})]) == 0
    out = tmp_path / "elastic"
    # Dead-node detection after 2 missed 1 s heartbeats, and 6 s for a late joiner once one node
    # is there (defaults: 15 s and 30 s): the agents of a loaded machine may start seconds apart,
    # and a first round without node 1 would be a different run.
    rdzv = "last_call_timeout=6,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"
    logs = [tmp_path / f"node{index}.log" for index in range(2)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CPUDIST_FAULT_SLOW_STEP_S": "0.3"}
    agents = []
    try:
        for index, node in enumerate(netns_cluster.nodes):
            with logs[index].open("w") as log:
                agents.append(subprocess.Popen(netns_cluster.exec_argv(node, [
                    str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1:2",
                    "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"{netns_cluster.address(0)}:29478", "--rdzv-id", "shrink", "--rdzv-conf",
                    rdzv, "--local-addr", netns_cluster.address(index), "--max-restarts", "1",
                    "--monitor-interval", "0.2", "--no-python", *cpudist_cmd(), "train",
                    *tiny_overrides(tiny_llama, chat_file, out, **settings),
                    f"dist.interface={netns_cluster.ifname}"]), stdout=log,
                    stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.monotonic() + 120
        while len(step_losses(out)) < 2:
            assert all(agent.poll() is None for agent in agents), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "no progress: " + logs[0].read_text()[-3000:]
            time.sleep(0.05)
        lose_node(netns_cluster.nodes[1])
        agents[0].wait(timeout=120)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        for node in netns_cluster.nodes:
            lose_node(node)
    log = logs[0].read_text()
    assert agents[0].returncode == 0, log[-5000:]
    assert "ranks: 2 (torchrun), this node: 1" in log + logs[1].read_text()  # both nodes first
    assert "restart 1 by torchrun: resuming from the newest checkpoint" in log, log[-5000:]
    assert "resuming a 2-rank checkpoint: global batch 4 kept on 1 rank(s)" in log
    assert "global batch 4 = 1 rank(s) x micro-batch 2 x 2 accumulation" in log
    [restart] = [r for r in metric_records(out) if r.get("event") == "restart"]
    assert restart["resumed_from_step"] >= 2
    expected, got = step_losses(reference), step_losses(out)
    assert [s for s, _ in got] == list(range(1, steps + 1)), "every step once, in order"
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in expected], rel=1e-4)
    assert adapter_difference(out, reference) <= 1e-3
