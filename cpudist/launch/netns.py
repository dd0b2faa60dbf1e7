"""A fake cluster on one machine: N network namespaces ("nodes") joined by a private link, to rehearse
multi-node launches without a cluster (needs root and iproute2).

Node i is the namespace PREFIXi with address 10.250.0.(i+1)/24 on an interface named `ifname`
(default cpd0) in every node, so one `dist.interface=cpd0` (GLOO_SOCKET_IFNAME) and one
`--mca btl_tcp_if_include cpd0` are right on all of them. Two nodes: one veth pair. More: each
node's veth ends on a bridge that lives in a namespace of its own (PREFIXbr), so the machine's own
network namespace is never touched. Node names resolve inside the nodes through
/etc/netns/PREFIXi/hosts (which `ip netns exec` mounts).

A link shape (`parse_link`: rate, delay, jitter, loss) puts qdiscs on every node's interface
(tbf for the rate, netem under it for delay, jitter and loss), so each packet between nodes
crosses exactly one shaped egress: the rate is each node's sending rate and the delay the one-way
latency between two nodes. Deleting a namespace deletes its interfaces and their qdiscs; nothing
is ever left in the machine's own namespace, and `fake_cluster` removes its nodes also on
SIGTERM/SIGHUP and at interpreter exit.

MPI starts its remote ranks through the launch agent (netns-agent.sh beside this file) in place of
ssh; mpirun itself runs inside the first node. The nodes share this machine's cores, which MPI
cannot see: ranks get OMP_WAIT_POLICY=PASSIVE, or spinning OpenMP threads make every step ~10x
slower. Used by `cpudist fake-cluster` (launch/fake-cluster.sh) and by the tests.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
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
    """A one-line error when this machine cannot make namespaces: not root, no ip/unshare, or
    root without the right to (a container without CAP_SYS_ADMIN, or whose security profile
    forbids the mounts `ip netns add` makes)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise UserError("a fake cluster needs root (network namespaces); run as root")
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            raise UserError(f"a fake cluster needs '{tool}': apt-get install {package}")
    # Being root is not enough: only trying tells. A throwaway namespace, removed at once.
    probe = f"cpdprobe{os.getpid()}"
    done = _ip("netns", "add", probe, check=False)
    _ip("netns", "delete", probe, check=False)
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        why = lines[-1] if lines else f"ip netns add exited {done.returncode}"
        raise UserError(f"cannot create network namespaces here ({why}): run as root on the "
                        "host, or in a container with CAP_SYS_ADMIN (docker run --privileged)")


# --------------------------------------------------------------------------- link shapes

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d+)?)"


@dataclass(frozen=True)
class Link:
    """What every node's interface is shaped to (netem): tc's own spellings, and the numbers."""

    rate: str  # e.g. 100mbit
    delay: str | None = None  # one-way, e.g. 5ms
    jitter: str | None = None  # e.g. 1ms (needs delay)
    loss: str | None = None  # e.g. 0.1%
    rate_bps: float = 0.0
    delay_s: float = 0.0

    @property
    def burst_bytes(self) -> int:
        """What tbf lets through at once: 10 ms at the rate, and at least two 64 KiB GSO packets
        (veth sends them whole; a smaller bucket could never pass one)."""
        return max(int(self.rate_bps / 8 / 100), 2 * 65536 + 1514)

    @property
    def needs_netem(self) -> bool:
        return bool(self.delay or self.jitter or self.loss)

    def qdiscs(self, dev: str) -> list[list[str]]:
        """tc arguments, in order: tbf for the rate at the root (built into most kernels), and
        under it netem for delay, jitter and loss when asked for (sch_netem, often a module)."""
        # Queue: 200 ms at the rate before tbf drops (TCP's own pacing keeps it short).
        commands = [["qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", self.rate,
                      "burst", str(self.burst_bytes), "latency", "200ms"]]
        if self.needs_netem:
            netem = ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                     # netem's default queue of 1000 packets would drop at rate x delay.
                     "limit", "100000"]
            if self.delay:
                netem += ["delay", self.delay] + ([self.jitter] if self.jitter else [])
            if self.loss:
                netem += ["loss", self.loss]
            commands.append(netem)
        return commands

    def describe(self) -> str:
        return ",".join(p for p in (self.rate, self.delay, self.jitter, self.loss) if p)


def parse_link(text: str) -> Link:
    """RATE[,DELAY[,JITTER[,LOSS]]], e.g. 100mbit,5ms or 10gbit,1ms,0.2ms,0.01%; a UserError
    naming the part that is wrong."""
    parts = [p.strip() for p in text.split(",")]
    names = ("rate", "delay", "jitter", "loss")
    if len(parts) > len(names):
        raise UserError(f"--link {text!r}: at most RATE,DELAY,JITTER,LOSS (got {len(parts)} parts)")
    for name, part in zip(names, parts, strict=False):
        if not part:
            raise UserError(f"--link {text!r}: the {name} is empty")
    rate = re.fullmatch(_NUMBER + r"(bit|kbit|mbit|gbit|tbit)", parts[0].lower())
    if not rate or float(rate.group(1)) <= 0:
        raise UserError(f"--link {text!r}: rate {parts[0]!r} is not a rate like 100mbit or 10gbit "
                        "(units bit, kbit, mbit, gbit, tbit)")
    times = []
    for name, part in zip(("delay", "jitter"), parts[1:3], strict=False):
        match = re.fullmatch(_NUMBER + r"(us|ms|s)", part.lower())
        if not match:
            raise UserError(f"--link {text!r}: {name} {part!r} is not a time like 5ms "
                            "(units us, ms, s)")
        times.append(float(match.group(1)) * _TIME_UNITS[match.group(2)])
    loss = None
    if len(parts) == 4:
        match = re.fullmatch(_NUMBER + "%", parts[3])
        if not match or float(match.group(1)) >= 100:
            raise UserError(f"--link {text!r}: loss {parts[3]!r} is not a percentage like 0.1%")
        loss = parts[3]
    return Link(rate=parts[0].lower(), delay=parts[1].lower() if len(parts) > 1 else None,
                jitter=parts[2].lower() if len(parts) > 2 else None, loss=loss,
                rate_bps=float(rate.group(1)) * _RATE_UNITS[rate.group(2)],
                delay_s=times[0] if times else 0.0)


# --------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class FakeCluster:
    prefix: str
    nodes: tuple[str, ...]
    ifname: str = IFNAME
    link: Link | None = field(default=None)

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


def up(count: int, prefix: str = "node", ifname: str = IFNAME, link: Link | None = None
       ) -> FakeCluster:
    """Create PREFIX0..PREFIX(count-1), each interface shaped to `link`; removes what it made if a
    step fails."""
    check_can_run()
    if link is not None and shutil.which("tc") is None:
        raise UserError("a shaped link needs 'tc': apt-get install iproute2")
    if not 2 <= count <= 200:
        raise UserError(f"fake cluster of {count} nodes: give between 2 and 200")
    if nodes_of(prefix):
        raise UserError(f"namespaces {prefix}* exist already: run `cpudist fake-cluster down "
                        f"--prefix {prefix}` first")
    cluster = FakeCluster(prefix, tuple(f"{prefix}{i}" for i in range(count)), ifname, link)
    try:
        _create(cluster)
    except UserError:
        down(prefix)
        raise
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
        for command in cluster.link.qdiscs(cluster.ifname) if cluster.link else []:
            _tc(node, command)


def _tc(node: str, args: list[str]) -> None:
    done = subprocess.run(["tc", "-n", node, *args], capture_output=True, text=True, timeout=60)
    if done.returncode and "netem" in args and "unknown" in done.stderr:
        raise UserError("this kernel has no netem qdisc (sch_netem; try `modprobe sch_netem`): "
                        "delay, jitter and loss need it; a --link of a rate alone works without")
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, ["tc", *args], done.stdout,
                                            done.stderr)


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


def own_prefix(kind: str = "cpdt") -> str:
    """A prefix no other live process uses: two clusters made at the same time (colleagues' test
    runs, two scaling sweeps) never collide, and each removes only its own nodes."""
    return f"{kind}{os.getpid()}n"


def _exit_on(signum: int, _frame: object) -> None:
    # SystemExit unwinds through fake_cluster's finally, which removes the nodes.
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def fake_cluster(count: int, prefix: str | None = None, link: Link | None = None
                 ) -> Iterator[FakeCluster]:
    """A fake cluster for the duration of a with-block; removed afterwards, also on Ctrl-C,
    SIGTERM and SIGHUP (turned into SystemExit here) and at interpreter exit (atexit, should the
    with-block never be left). Only SIGKILL leaves it: `cpudist fake-cluster down --prefix P`."""
    prefix = prefix or own_prefix()
    check_can_run()
    if nodes_of(prefix):  # someone else's: refuse before the cleanup below could remove them
        raise UserError(f"namespaces {prefix}* exist already")
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _exit_on)
    cleanup = functools.partial(down, prefix)
    atexit.register(cleanup)
    try:
        yield up(count, prefix, link=link)
    finally:
        try:
            down(prefix)
        finally:
            atexit.unregister(cleanup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_action(action: str, count: int | None, prefix: str, link: str | None = None) -> int:
    if action == "up":
        if count is None:
            raise UserError("fake-cluster up N: give the number of nodes")
        shape = parse_link(link) if link else None
        cluster = up(count, prefix, link=shape)
        print(f"up: {' '.join(cluster.nodes)} on {cluster.ifname}, {cluster.address(0)}-"
              f"{cluster.address(count - 1)}; launch agent {AGENT}"
              + (f"; link {shape.describe()}" if shape else ""))
    elif action == "down":
        check_can_run()
        print(f"removed: {' '.join(down(prefix)) or 'nothing'}")
    else:
        print("\n".join(nodes_of(prefix)) or f"no namespaces {prefix}*")
    sys.stdout.flush()
    return 0
