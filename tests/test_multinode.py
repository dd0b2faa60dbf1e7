"""Two fake nodes (network namespaces + veth): a real 2-rank Open MPI run whose gloo allreduce
must cross the veth, checked on the interface's byte counters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest_netns import NetnsCluster, netns_cluster  # noqa: F401  (fixture)

pytestmark = [pytest.mark.netns, pytest.mark.mpi]

NUMEL = 4 * 1024 * 1024  # float32: 16 MiB per allreduce
ROUNDS = 2

PROGRAM = """
import socket, sys
import torch
import torch.distributed as dist
from cpudist import cluster

ifname, numel, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
placement = cluster.detect_placement()
how = cluster.init_process_group(placement, "gloo", None, None, ifname, 120)
for _ in range(rounds):
    t = torch.full((numel,), float(placement.rank + 1))
    dist.all_reduce(t)
    expected = placement.world_size * (placement.world_size + 1) / 2
    assert bool(torch.all(t == expected)), (t[:4], expected)
print(f"RANK {placement.rank}/{placement.world_size} on {socket.gethostname()} "
      f"via {placement.launcher}: {how}", flush=True)
cluster.shutdown()
"""


def test_namespaces_are_isolated(netns_cluster: NetnsCluster) -> None:  # noqa: F811
    node0, node1 = netns_cluster.nodes
    probe = [sys.executable, "-c", "import socket; print(socket.gethostname())"]
    assert netns_cluster.run(node1, probe).stdout.strip() == node1
    # Each node sees its own veth end with its own address.
    show = netns_cluster.run(node0, ["ip", "-4", "addr", "show", netns_cluster.ifname])
    assert netns_cluster.address(0) in show.stdout


def test_two_node_gloo_allreduce_crosses_the_veth(netns_cluster: NetnsCluster,  # noqa: F811
                                                  tmp_path: Path) -> None:
    node0, node1 = netns_cluster.nodes
    program = tmp_path / "allreduce.py"
    program.write_text(PROGRAM)
    before = {n: netns_cluster.counter(n) for n in (node0, node1)}
    done = netns_cluster.mpirun(
        2, [sys.executable, str(program), netns_cluster.ifname, str(NUMEL), str(ROUNDS)],
        tmp_path)
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


def test_cpudist_launch_over_two_nodes(netns_cluster: NetnsCluster,  # noqa: F811
                                       tmp_path: Path) -> None:
    """`cpudist launch` with a hostfile and the agent: one rank on each fake node."""
    hosts = tmp_path / "check.hosts"
    hosts.write_text("a slots=1\n")
    done = netns_cluster.launch(2, ["hostfile", "check", str(hosts), "--no-resolve"], tmp_path,
                                options=["--allocator", "none"])
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.stdout.count("1 host(s), 1 slot(s) in total") == 2
    assert "--map-by slot:PE=" in done.stderr  # one rank per node: bound to that node's cores
