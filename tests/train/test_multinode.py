"""Two fake nodes (network namespaces + veth): real 2-rank Open MPI runs (a bare gloo allreduce,
then a whole `cpudist train`) whose traffic must cross the veth, checked on the interface's byte
counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cpudist.launch.netns import WAIT_POLICY
from cpudist.launch.netns import FakeCluster as NetnsCluster
from tests.helpers import tiny_overrides, venv_mpirun

pytestmark = [pytest.mark.netns, pytest.mark.mpi]

NUMEL = 4 * 1024 * 1024  # float32: 16 MiB per allreduce
ROUNDS = 2

PROGRAM = """
import socket, sys
import torch
import torch.distributed as dist
from cpudist.runtime import cluster, comm

ifname, numel, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
placement = cluster.detect_placement()
how = comm.init_process_group(placement, "gloo", None, None, ifname, 120)
for _ in range(rounds):
    t = torch.full((numel,), float(placement.rank + 1))
    dist.all_reduce(t)
    expected = placement.world_size * (placement.world_size + 1) / 2
    assert bool(torch.all(t == expected)), (t[:4], expected)
print(f"RANK {placement.rank}/{placement.world_size} on {socket.gethostname()} "
      f"via {placement.launcher}: {how}", flush=True)
comm.shutdown()
"""


def mpirun(cluster: NetnsCluster, np: int, argv: Sequence[str], workdir: Path,
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Real Open MPI mpirun, itself inside the first node, one slot per node."""
    hostfile = cluster.write_hostfile(workdir / "netns.hosts")
    cmd = [str(venv_mpirun()), "--allow-run-as-root", "-np", str(np), "--hostfile", str(hostfile),
           "--oversubscribe", "--bind-to", "none", *cluster.mpi_args(), "-x", "PATH",
           "-x", f"OMP_WAIT_POLICY={WAIT_POLICY}", *argv]
    return cluster.run(cluster.nodes[0], cmd, timeout=timeout)


def launch(cluster: NetnsCluster, np: int, program: Sequence[str], workdir: Path,
           timeout: float = 600, options: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """`cpudist launch -np N --hostfile ... -- PROGRAM` started inside the first node."""
    hostfile = cluster.write_hostfile(workdir / "netns.hosts")
    argv = [sys.executable, "-m", "cpudist.cli", "launch", "-np", str(np), "--hostfile",
            str(hostfile), "--mpirun", str(venv_mpirun()),
            *(f"--mpi-arg={arg}" for arg in cluster.mpi_args()), *options, "--", *program]
    env = {**os.environ, "OMP_WAIT_POLICY": WAIT_POLICY}
    return cluster.run(cluster.nodes[0], argv, timeout=timeout, env=env)


def test_namespaces_are_isolated(netns_cluster: NetnsCluster) -> None:
    node0, node1 = netns_cluster.nodes
    probe = [sys.executable, "-c", "import socket; print(socket.gethostname())"]
    assert netns_cluster.run(node1, probe).stdout.strip() == node1
    # Each node sees its own veth end with its own address.
    show = netns_cluster.run(node0, ["ip", "-4", "addr", "show", netns_cluster.ifname])
    assert netns_cluster.address(0) in show.stdout


def test_two_node_gloo_allreduce_crosses_the_veth(netns_cluster: NetnsCluster,
                                                  tmp_path: Path) -> None:
    node0, node1 = netns_cluster.nodes
    program = tmp_path / "allreduce.py"
    program.write_text(PROGRAM)
    before = {n: netns_cluster.counter(n) for n in (node0, node1)}
    done = mpirun(netns_cluster, 2, [sys.executable, str(program), netns_cluster.ifname,
                                     str(NUMEL), str(ROUNDS)], tmp_path)
    after = {n: netns_cluster.counter(n) for n in (node0, node1)}
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("RANK "))
    assert len(lines) == 2, done.stdout
    assert lines[0].startswith(f"RANK 0/2 on {node0} via openmpi")
    assert lines[1].startswith(f"RANK 1/2 on {node1} via openmpi")
    # Rank 0 announced its veth address for the rendezvous (dist.interface), not loopback.
    assert f"tcp://{netns_cluster.address(0)}:" in lines[0]
    tensor_bytes = NUMEL * 4
    for node in (node0, node1):
        sent = after[node] - before[node]
        # Each of the ROUNDS allreduces sends about one tensor's worth each way with 2 ranks.
        assert sent > tensor_bytes, f"{node} sent only {sent} bytes on {netns_cluster.ifname}"


def test_cpudist_launch_over_two_nodes(netns_cluster: NetnsCluster,
                                       tmp_path: Path) -> None:
    """`cpudist launch` with a hostfile and the agent: one rank on each fake node."""
    hosts = tmp_path / "check.hosts"
    hosts.write_text("a slots=1\n")
    done = launch(netns_cluster, 2, ["hostfile", "check", str(hosts), "--no-resolve"], tmp_path,
                  options=["--allocator", "none"])
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.stdout.count("1 host(s), 1 slot(s) in total") == 2
    assert "--map-by slot:PE=" in done.stderr  # one rank per node: bound to that node's cores


TRAIN_STEPS = 4
# Large enough that gradients, not setup chatter, dominate what crosses the link (512 KiB).
LORA_RANK = 64


@pytest.mark.slow
def test_two_node_train_allreduces_over_the_veth(netns_cluster: NetnsCluster,
                                                 tiny_llama: Path, chat_file: Path,
                                                 tmp_path: Path) -> None:
    """`cpudist launch -np 2 -- train` with one rank per fake node: rank 0 writes the run, and the
    DDP gradient allreduce of every step goes over the veth (the nodes share only the files)."""
    node0, node1 = netns_cluster.nodes
    out = tmp_path / "run"
    program = ["train", *tiny_overrides(tiny_llama, chat_file, out, train__max_steps=TRAIN_STEPS,
                                         lora__r=LORA_RANK, dist__backend="gloo",
                                         dist__interface=netns_cluster.ifname)]
    before = {n: netns_cluster.counter(n) for n in (node0, node1)}
    done = launch(netns_cluster, 2, program, tmp_path, timeout=240, options=["--allocator", "none"])
    after = {n: netns_cluster.counter(n) for n in (node0, node1)}
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"

    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["launcher"] == "openmpi"
    assert summary["steps"] == TRAIN_STEPS
    assert summary["global_batch"] == 2 * 4  # batch_size 4 per rank
    losses = [json.loads(line).get("loss") for line in (out / "metrics.jsonl").read_text()
              .splitlines()]
    assert sum(loss is not None for loss in losses) == TRAIN_STEPS
    adapter = out / "adapter" / "adapter_model.safetensors"
    assert (out / "adapter" / "adapter_config.json").is_file()
    # Rank 0 ran on node0 and rendezvoused on its veth address (dist.interface), not loopback.
    assert f"tcp://{netns_cluster.address(0)}:" in summary["communication"]

    # Each step all-reduces every LoRA gradient (the adapter file holds exactly those parameters).
    # With 2 ranks each side must receive the other's share of every element, so whatever the
    # algorithm each node sends at least the whole gradient buffer per step.
    grad_bytes = sum(t.numel() * t.element_size() for t in load_file(adapter).values())
    assert grad_bytes > 0
    for node in (node0, node1):
        sent = after[node] - before[node]
        assert sent > grad_bytes * TRAIN_STEPS, (
            f"{node} sent {sent} bytes on {netns_cluster.ifname}, less than "
            f"{TRAIN_STEPS} steps x {grad_bytes} gradient bytes")


@pytest.mark.slow
def test_scaling_over_two_nodes_reads_rank0_figures_from_stdout(
        netns_cluster: NetnsCluster, tiny_qwen: Path, tmp_path: Path) -> None:
    """`cpudist scaling --hostfile`: the 2-rank bench runs one rank per fake node with the
    launcher's command; its figures come back on rank 0's stdout (no shared output file needed)."""
    node0, node1 = netns_cluster.nodes
    hosts = netns_cluster.write_hostfile(tmp_path / "scaling.hosts")
    out = tmp_path / "scaling"
    argv = [sys.executable, "-m", "cpudist.cli", "scaling", "--np", "2", "--hostfile", str(hosts),
            *(f"--mpi-arg={arg}" for arg in netns_cluster.mpi_args()), "--allocator", "none",
            f"model.path={tiny_qwen}", f"data.cache_dir={tmp_path / 'data-cache'}",
            f"dist.interface={netns_cluster.ifname}", "--steps", "2", "--seq-len", "32",
            "--batch-size", "2", "--dtype", "float32", "--total-threads", "1", "--out", str(out)]
    done = netns_cluster.run(node0, argv, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    (row,) = json.loads((out / "scaling.json").read_text())
    assert row["world_size"] == 2 and row["threads"] == 1
    assert row["config"]["train"]["batch_size"] == 1  # the global batch of 2, one row per rank
    assert len(row["peak_rss_gb"]) == 2
    assert "--hostfile" in done.stderr and "--map-by" in done.stderr
