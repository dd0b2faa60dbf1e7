"""A fake cluster on one machine: N network namespaces ("nodes") joined by a private link, to rehearse
multi-node launches without a cluster (needs root and iproute2).

Node i is the namespace PREFIXi with address 10.250.0.(i+1)/24 on an interface named `ifname`
(default cpd0) in every node, so one `dist.interface=cpd0` (GLOO_SOCKET_IFNAME) and one
`--mca btl_tcp_if_include cpd0` are right on all of them. Two nodes: one veth pair. More: each
node's veth ends on a bridge that lives in a namespace of its own (PREFIXbr), so the machine's own
network namespace is never touched. Node names resolve inside the nodes through
/etc/netns/PREFIXi/hosts (which `ip netns exec` mounts).

MPI starts its remote ranks through the launch agent (netns-agent.sh beside this file) in place of
ssh; mpirun itself runs inside the first node. The nodes share this machine's cores, which MPI
cannot see: ranks get OMP_WAIT_POLICY=PASSIVE, or spinning OpenMP threads make every step ~10x
slower. Used by `cpudist fake-cluster` (launch/fake-cluster.sh) and by the tests.
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

from cpudist.errors import UserError

AGENT = Path(__file__).with_name("netns-agent.sh")
SUBNET = "10.250.0"
IFNAME = "cpd0"
NETNS_ETC = Path("/etc/netns")
# The nodes share this machine's cores: spinning OpenMP threads of one node's rank would starve the
# other's (10x slower steps measured on 2 cores).
WAIT_POLICY = "PASSIVE"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=60)


def namespaces() -> list[str]:
    done = _ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def nodes_of(prefix: str) -> list[str]:
    """Existing namespaces named PREFIX<digits>, in node order."""
    found = [ns for ns in namespaces() if ns.startswith(prefix) and ns[len(prefix):].isdigit()]
    return sorted(found, key=lambda ns: int(ns[len(prefix):]))


def check_can_run() -> None:
    """A one-line error when this machine cannot make namespaces (not root, no ip/unshare)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise UserError("a fake cluster needs root (network namespaces); run as root")
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            raise UserError(f"a fake cluster needs '{tool}': apt-get install {package}")


@dataclass(frozen=True)
class FakeCluster:
    prefix: str
    nodes: tuple[str, ...]
    ifname: str = IFNAME

    def address(self, index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def exec_argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """argv run inside `node`, with hostname `node` (as the launch agent does)."""
        return ["ip", "netns", "exec", node, "unshare", "--uts", "sh", "-c",
                f'hostname {node} && exec "$@"', "sh", *argv]

    def counter(self, node: str, name: str = "tx_bytes") -> int:
        """/sys/class/net/<ifname>/statistics/<name> as seen inside `node`."""
        done = subprocess.run(["ip", "netns", "exec", node, "cat",
                               f"/sys/class/net/{self.ifname}/statistics/{name}"],
                              capture_output=True, text=True, check=True, timeout=30)
        return int(done.stdout)

    def run(self, node: str, argv: Sequence[str], timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """argv inside `node`, output captured."""
        return subprocess.run(self.exec_argv(node, argv), capture_output=True, text=True,
                              timeout=timeout, env=env)

    def write_hostfile(self, path: Path, slots: int = 1) -> Path:
        """An Open MPI hostfile naming every node."""
        path.write_text("".join(f"{node} slots={slots}\n" for node in self.nodes))
        return path

    def mpi_args(self) -> list[str]:
        """Open MPI options that start ranks through the agent and keep MPI on the link."""
        return ["--mca", "plm_rsh_agent", str(AGENT),
                "--mca", "btl_tcp_if_include", self.ifname,
                "--mca", "oob_tcp_if_include", self.ifname]


def up(count: int, prefix: str = "node", ifname: str = IFNAME) -> FakeCluster:
    """Create PREFIX0..PREFIX(count-1); removes what it made if a step fails."""
    check_can_run()
    if not 2 <= count <= 200:
        raise UserError(f"fake cluster of {count} nodes: give between 2 and 200")
    if nodes_of(prefix):
        raise UserError(f"namespaces {prefix}* exist already: run `cpudist fake-cluster down "
                        f"--prefix {prefix}` first")
    cluster = FakeCluster(prefix, tuple(f"{prefix}{i}" for i in range(count)), ifname)
    try:
        _create(cluster)
    except (subprocess.CalledProcessError, OSError) as exc:
        down(prefix)
        detail = getattr(exc, "stderr", None) or str(exc)
        raise UserError(f"cannot create network namespaces here: {detail.strip()}") from None
    return cluster


def _create(cluster: FakeCluster) -> None:
    hosts = "127.0.0.1 localhost\n" + "".join(
        f"{cluster.address(i)} {node}\n" for i, node in enumerate(cluster.nodes))
    for node in cluster.nodes:
        _ip("netns", "add", node)
        _ip("-n", node, "link", "set", "lo", "up")
        (NETNS_ETC / node).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / node / "hosts").write_text(hosts)
        (NETNS_ETC / node / "hostname").write_text(node + "\n")
    # Temporary names in the root namespace are unique per process (15 chars max for a link name).
    a, b = f"cpa{os.getpid()}", f"cpb{os.getpid()}"
    if len(cluster.nodes) == 2:
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for end, node in ((a, cluster.nodes[0]), (b, cluster.nodes[1])):
            _ip("link", "set", end, "netns", node)
            _ip("-n", node, "link", "set", end, "name", cluster.ifname)
    else:
        bridge = f"{cluster.prefix}br"
        _ip("netns", "add", bridge)
        _ip("-n", bridge, "link", "set", "lo", "up")
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for i, node in enumerate(cluster.nodes):
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "netns", node)
            _ip("link", "set", b, "netns", bridge)
            _ip("-n", node, "link", "set", a, "name", cluster.ifname)
            _ip("-n", bridge, "link", "set", b, "name", f"p{i}", "master", "br0", "up")
    for i, node in enumerate(cluster.nodes):
        _ip("-n", node, "addr", "add", f"{cluster.address(i)}/24", "dev", cluster.ifname)
        _ip("-n", node, "link", "set", cluster.ifname, "up")


def down(prefix: str = "node") -> list[str]:
    """End every process inside the nodes, remove them, their bridge and their /etc/netns files;
    returns the namespaces removed."""
    removed = []
    for ns in [*nodes_of(prefix), f"{prefix}br"]:
        if ns in namespaces():
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            # Deleting a namespace deletes its veth ends (and so the peers in the other ones).
            _ip("netns", "delete", ns, check=False)
            removed.append(ns)
        for name in ("hosts", "hostname"):
            with contextlib.suppress(FileNotFoundError):
                (NETNS_ETC / ns / name).unlink()
        with contextlib.suppress(OSError):
            (NETNS_ETC / ns).rmdir()
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()
    return removed


@contextlib.contextmanager
def fake_cluster(count: int, prefix: str | None = None) -> Iterator[FakeCluster]:
    """A fake cluster for the duration of a with-block; removed afterwards, also on Ctrl-C."""
    prefix = prefix or f"cpdt{os.getpid() % 100000}n"
    cluster = up(count, prefix)
    try:
        yield cluster
    finally:
        down(prefix)


def run_action(action: str, count: int | None, prefix: str) -> int:
    if action == "up":
        if count is None:
            raise UserError("fake-cluster up N: give the number of nodes")
        cluster = up(count, prefix)
        print(f"up: {' '.join(cluster.nodes)} on {cluster.ifname}, {cluster.address(0)}-"
              f"{cluster.address(count - 1)}; launch agent {AGENT}")
    elif action == "down":
        check_can_run()
        print(f"removed: {' '.join(down(prefix)) or 'nothing'}")
    else:
        print("\n".join(nodes_of(prefix)) or f"no namespaces {prefix}*")
    sys.stdout.flush()
    return 0
