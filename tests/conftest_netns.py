"""Reusable fake-cluster fixture: N network namespaces joined by a veth pair (or a bridge).

Import the fixture into a test module (tests/conftest.py is the lead's):

    from conftest_netns import NetnsCluster, netns_cluster  # noqa: F401

    @pytest.mark.netns
    def test_x(netns_cluster: NetnsCluster) -> None:
        done = netns_cluster.mpirun(2, [sys.executable, "prog.py"], tmp_path)

The cluster is made by launch/netns-cluster.sh with a prefix unique to this test process, so runs
on the same machine do not collide; it is always torn down (and any process still inside its
namespaces ended) when the module's tests finish. Skips, with the reason, without root, iproute2,
unshare or the venv's Open MPI.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SH = REPO / "launch" / "netns-cluster.sh"
AGENT_SH = REPO / "launch" / "netns-agent.sh"
IFNAME = "cpd0"
# The fake nodes share this machine's cores, which no launcher can see: spinning OpenMP threads
# of one node's rank would starve the other's (10x slower steps measured on 2 cores).
WAIT_POLICY = "PASSIVE"


@dataclass(frozen=True)
class NetnsCluster:
    prefix: str
    nodes: tuple[str, ...]
    ifname: str
    mpirun_path: str

    def address(self, index: int) -> str:
        return f"10.250.0.{index + 1}"

    def exec_argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """argv run inside `node`, with hostname `node` (as the launch agent does)."""
        return ["ip", "netns", "exec", node, "unshare", "--uts", "sh", "-c",
                f'hostname {node} && exec "$@"', "sh", *argv]

    def run(self, node: str, argv: Sequence[str], timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.exec_argv(node, argv), capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=REPO)

    def counter(self, node: str, name: str = "tx_bytes") -> int:
        """/sys/class/net/<ifname>/statistics/<name> as seen inside `node`."""
        done = subprocess.run(["ip", "netns", "exec", node, "cat",
                               f"/sys/class/net/{self.ifname}/statistics/{name}"],
                              capture_output=True, text=True, check=True, timeout=30)
        return int(done.stdout)

    def write_hostfile(self, path: Path, slots: int = 1) -> Path:
        path.write_text("".join(f"{node} slots={slots}\n" for node in self.nodes))
        return path

    def mpi_args(self) -> list[str]:
        """Open MPI options that start ranks through the agent and keep MPI on the veth."""
        return ["--mca", "plm_rsh_agent", str(AGENT_SH),
                "--mca", "btl_tcp_if_include", self.ifname,
                "--mca", "oob_tcp_if_include", self.ifname]

    def mpirun(self, np: int, argv: Sequence[str], workdir: Path, timeout: float = 300,
               extra: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
        """Real mpirun, itself inside the first node, one slot per node."""
        hostfile = self.write_hostfile(workdir / "netns.hosts")
        cmd = [self.mpirun_path, "--allow-run-as-root", "-np", str(np), "--hostfile",
               str(hostfile), "--oversubscribe", "--bind-to", "none", *self.mpi_args(),
               "-x", f"PYTHONPATH={REPO}", "-x", "PATH", "-x", f"OMP_WAIT_POLICY={WAIT_POLICY}",
               *extra, *argv]
        return self.run(self.nodes[0], cmd, timeout=timeout)


    def launch(self, np: int, program: Sequence[str], workdir: Path, timeout: float = 600,
               options: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
        """`cpudist launch -np N --hostfile ... -- PROGRAM` started inside the first node, e.g.
        program=["train", "cfg.yaml", f"dist.interface={cluster.ifname}"]."""
        hostfile = self.write_hostfile(workdir / "netns.hosts")
        argv = [sys.executable, "-m", "cpudist.cli", "launch", "-np", str(np), "--hostfile",
                str(hostfile), "--mpirun", self.mpirun_path,
                *(f"--mpi-arg={arg}" for arg in self.mpi_args()), *options, "--", *program]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": WAIT_POLICY}
        return self.run(self.nodes[0], argv, timeout=timeout, env=env)


def _skip_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"'{tool}' not found: apt-get install {package}"
    if _mpirun() is None:
        return "no Open MPI mpirun next to this Python (pip install 'cpudist[mpi]')"
    return None


def _mpirun() -> str | None:
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else None


def _kill_leftovers(nodes: Sequence[str]) -> None:
    # Only processes inside our own namespaces: ranks or daemons a failed test left behind.
    for node in nodes:
        done = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True)
        for pid in done.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def make_netns_cluster(nodes: int = 2, prefix: str | None = None) -> Iterator[NetnsCluster]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    mpirun = _mpirun()
    assert mpirun is not None
    prefix = prefix or f"cpdt{os.getpid() % 100000}n"
    env = {**os.environ, "IFNAME": IFNAME}
    up = subprocess.run(["sh", str(CLUSTER_SH), "up", str(nodes), prefix], capture_output=True,
                        text=True, env=env, timeout=60)
    names = tuple(f"{prefix}{i}" for i in range(nodes))
    try:
        if up.returncode != 0:
            pytest.skip(f"cannot create network namespaces here: {up.stderr.strip()}")
        yield NetnsCluster(prefix, names, IFNAME, mpirun)
    finally:
        _kill_leftovers(names)
        subprocess.run(["sh", str(CLUSTER_SH), "down", prefix], capture_output=True, env=env,
                       timeout=60)


@pytest.fixture(scope="module")
def netns_cluster() -> Iterator[NetnsCluster]:
    """Two fake nodes (PREFIX0, PREFIX1) on cpd0, 10.250.0.1-2; torn down after the module."""
    with make_netns_cluster(2) as cluster:
        yield cluster
