"""Fake clusters with real network limits (cpudist.launch.netns): link shapes parsed with errors
that name the part, netem on every node's interface doing what it says, and nothing left behind
when the process that made the cluster is interrupted."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from cpudist.errors import UserError
from cpudist.launch import netns


def test_link_shapes_parse_into_tc_words_and_numbers() -> None:
    link = netns.parse_link("100Mbit,5ms")
    assert (link.rate, link.delay, link.rate_bps, link.delay_s) == ("100mbit", "5ms", 1e8, 0.005)
    tbf, netem = link.qdiscs("cpd0")
    assert tbf[:8] == ["qdisc", "add", "dev", "cpd0", "root", "handle", "1:", "tbf"]
    assert tbf[8:10] == ["rate", "100mbit"]
    assert netem[4:7] == ["parent", "1:1", "handle"] and netem[-2:] == ["delay", "5ms"]
    full = netns.parse_link("10gbit,1ms,200us,0.01%")
    assert full.qdiscs("x")[1][-5:] == ["delay", "1ms", "200us", "loss", "0.01%"]
    assert full.describe() == "10gbit,1ms,200us,0.01%"
    # A rate alone needs no netem (which some kernels lack).
    (only,) = netns.parse_link("1gbit").qdiscs("x")
    assert "tbf" in only and not netns.parse_link("1gbit").needs_netem


@pytest.mark.parametrize(("text", "part"), [
    ("100mbps,5ms", "rate '100mbps'"), ("fast", "rate 'fast'"), ("10gbit,5", "delay '5'"),
    ("10gbit,1ms,x", "jitter 'x'"), ("10gbit,1ms,1ms,5", "loss '5'"),
    ("10gbit,,1ms", "the delay is empty"), ("1gbit,1ms,1ms,1%,9", "at most")])
def test_a_bad_link_names_the_part(text: str, part: str) -> None:
    with pytest.raises(UserError, match=f"--link '{text}': {part}") as info:
        netns.parse_link(text)
    assert "\n" not in str(info.value)


@pytest.mark.netns
def test_root_without_the_right_to_make_namespaces_is_one_line() -> None:
    """Root in a container without CAP_SYS_ADMIN (here: dropped from the bounding set) cannot
    make namespaces: check_can_run says so at once, and so the netns tests skip there."""
    if os.geteuid() != 0:
        pytest.skip("not root: check_can_run stops at 'needs root' already")
    for tool in ("setpriv", "ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"'{tool}' not found")
    done = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin",
                           sys.executable, "-m", "cpudist.cli", "fake-cluster", "down",
                           "--prefix", f"cpdcap{os.getpid()}n"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: cannot create network namespaces here (")
    assert line.endswith("run as root on the host, or in a container with CAP_SYS_ADMIN "
                         "(docker run --privileged) [exit 2: bad input or config (do not retry; "
                         "fix what the message names)]")


def _need_netns() -> None:
    try:
        netns.check_can_run()
    except UserError as exc:
        pytest.skip(str(exc))
    if shutil.which("tc") is None:
        pytest.skip("'tc' not found: apt-get install iproute2")


HOLD = """
import signal, sys, time
from cpudist.launch import netns
# Ctrl-C reaches a foreground process with Python's KeyboardInterrupt; a test suite started as a
# shell's background job (as CI may be) passes SIGINT down ignored instead: undo that here.
signal.signal(signal.SIGINT, signal.default_int_handler)
with netns.fake_cluster(3, prefix=sys.argv[1], link=netns.parse_link("20mbit")):
    print("UP", flush=True)
    time.sleep(300)
"""


@pytest.mark.netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_cluster_leaves_nothing_behind(sig: int) -> None:
    _need_netns()
    prefix = f"cpdx{os.getpid()}s{int(sig)}n"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, prefix], stdout=subprocess.PIPE,
                              text=True)
    sleeper = None
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "UP"
        nodes = [f"{prefix}{i}" for i in range(3)]
        assert netns.nodes_of(prefix) == nodes and f"{prefix}br" in netns.namespaces()
        shown = subprocess.run(["tc", "-n", nodes[1], "qdisc", "show", "dev", netns.IFNAME],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in shown and "rate 20Mbit" in shown, shown
        # A process left running inside a node (as a killed mpirun leaves its ranks).
        sleeper = subprocess.Popen(["ip", "netns", "exec", nodes[2], "sleep", "300"])
        # Wait until it is inside the node (on a loaded machine `ip netns exec` takes a while).
        deadline = time.monotonic() + 30
        while not subprocess.run(["ip", "netns", "pids", nodes[2]], capture_output=True,
                                 text=True).stdout.strip():
            assert time.monotonic() < deadline, "the sleeper never entered the node"
            time.sleep(0.1)
        holder.send_signal(sig)
        holder.wait(timeout=60)
        assert sleeper.wait(timeout=30) != 0  # ended by the cleanup, not by itself
    finally:
        if holder.poll() is None:
            holder.kill()
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
        leftovers = netns.nodes_of(prefix) + [ns for ns in netns.namespaces()
                                              if ns == f"{prefix}br"]
        netns.down(prefix)  # never leave them to the next test run, whatever failed above
    assert not leftovers, leftovers
    assert not any((netns.NETNS_ETC / f"{prefix}{suffix}").exists() for suffix in ("0", "1", "2", "br"))
    # Nothing in the machine's own namespace either: no temporary veth end, no qdisc on one.
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"cpa{holder.pid}" not in links and f"cpb{holder.pid}" not in links
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    assert f"cpa{holder.pid}" not in qdiscs


SEND = """
import socket, sys, time
size = int(sys.argv[2])
sock = socket.create_connection((sys.argv[1], 5999), timeout=60)
started = time.perf_counter()
sock.sendall(b"x" * size)
sock.shutdown(socket.SHUT_WR)
sock.recv(1)  # the receiver's acknowledgement: every byte arrived
print(time.perf_counter() - started)
"""
RECEIVE = """
import socket
server = socket.create_server(("0.0.0.0", 5999))
print("LISTENING", flush=True)
conn, _ = server.accept()
while conn.recv(1 << 16):
    pass
conn.sendall(b"k")
"""


def _transfer_seconds(link: netns.Link, size: int) -> float:
    """Seconds to send `size` bytes from node 0 to node 1 of a 2-node cluster shaped to `link`."""
    with netns.fake_cluster(2, prefix=netns.own_prefix("cpdr"), link=link) as cluster:
        receiver = subprocess.Popen(cluster.exec_argv(cluster.nodes[1], [sys.executable, "-c",
                                                                         RECEIVE]),
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout is not None and "LISTENING" in receiver.stdout.readline()
            done = cluster.run(cluster.nodes[0], [sys.executable, "-c", SEND,
                                                  cluster.address(1), str(size)], timeout=120)
            assert done.returncode == 0, done.stderr
        finally:
            receiver.kill()
    return float(done.stdout)


@pytest.mark.netns
def test_the_shaped_link_limits_the_rate() -> None:
    """1 MB over 10mbit takes at least 0.7 s (what the token bucket's burst does not let through
    at once); the unshaped veth moves it in milliseconds, so the lower bound fails if the shaping
    is lost (and a loaded machine only makes it slower)."""
    _need_netns()
    size, link = 1_000_000, netns.parse_link("10mbit")
    seconds = _transfer_seconds(link, size)
    assert seconds >= 0.95 * (size - link.burst_bytes) * 8 / link.rate_bps, seconds


@pytest.mark.netns
def test_the_shaped_link_adds_delay_where_the_kernel_has_netem() -> None:
    _need_netns()
    link = netns.parse_link("1gbit,100ms")
    try:
        seconds = _transfer_seconds(link, 1000)
    except UserError as exc:
        if "no netem" not in str(exc):
            raise
        pytest.skip(str(exc))
    # A tiny message and its acknowledgement: one round trip, two shaped egresses.
    assert seconds >= 2 * link.delay_s * 0.95, seconds
