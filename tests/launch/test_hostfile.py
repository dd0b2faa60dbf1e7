"""Hostfile parsing, validation and conversion (no network: resolution is injected)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cpudist.errors import UserError
from cpudist.launch import hostfile as hf
from tests.helpers import REPO


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts"
    path.write_text(text)
    return path


def test_openmpi_syntax_with_comments_and_blank_lines() -> None:
    parsed = hf.parse_text(
        "# cluster\n\nnode1 slots=4 max_slots=8  # big one\nnode2 slots=2\n  \nnode3\n", "H")
    assert parsed.syntax == "openmpi"
    assert parsed.hosts == ["node1", "node2", "node3"]
    assert [e.line for e in parsed.entries] == [3, 4, 6]
    assert parsed.entries[0].max_slots == 8
    assert parsed.total_slots == 7  # bare host counts one slot


def test_hydra_syntax_and_bare_hosts() -> None:
    parsed = hf.parse_text("a:2\nb:3\nc\n")
    assert parsed.syntax == "hydra"
    assert parsed.slots_by_host() == {"a": 2, "b": 3, "c": 1}


def test_bare_hosts_are_valid_in_both() -> None:
    parsed = hf.parse_text("10.0.0.1\nhost-b.example.org\n")
    assert parsed.syntax is None
    assert parsed.total_slots == 2


def test_repeated_host_sums_slots() -> None:
    parsed = hf.parse_text("a slots=2\nb slots=1\na slots=3\n")
    assert parsed.hosts == ["a", "b"]
    assert parsed.slots_by_host() == {"a": 5, "b": 1}


def test_ipv6_in_openmpi_syntax() -> None:
    assert hf.parse_text("fe80::1 slots=2\n").hosts == ["fe80::1"]


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("a slots=2\nb slots=x\n", 2, "slots='x' must be a positive integer"),
        ("a slots=0\n", 1, "must be a positive integer"),
        ("a cpus=2\n", 1, "unknown field 'cpus=2'"),
        ("a slots=4 max_slots=2\n", 1, "max_slots=2 is less than slots=4"),
        ("a:2\nb slots=2\n", 2, "openmpi syntax here but hydra syntax on line 1"),
        ("a:2 slots=3\n", 1, "takes nothing after it"),
        (":2\n", 1, "no host name"),
        ("a:0\n", 1, "must be a positive integer"),
        ("slots=2 a\n", 1, "put the host first"),
        ("bad/host slots=1\n", 1, "not a valid host name"),
        ("# only\n\n", None, "no hosts"),
    ],
)
def test_syntax_errors_name_file_and_line(text: str, line: int | None, fragment: str) -> None:
    with pytest.raises(UserError) as err:
        hf.parse_text(text, "my.hosts")
    message = str(err.value)
    assert fragment in message
    assert message.startswith(f"my.hosts:{line}:" if line else "my.hosts:")


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="hostfile not found"):
        hf.parse(tmp_path / "nope")


@pytest.mark.parametrize("target", ["openmpi", "hydra"])
def test_convert_round_trip(target: str) -> None:
    src = hf.parse_text("a slots=2 max_slots=4\nb slots=3\nc\n")
    text = hf.render(src, target)  # type: ignore[arg-type]
    back = hf.parse_text(text)
    assert back.syntax == target
    assert back.slots_by_host() == {"a": 2, "b": 3, "c": 1}
    if target == "hydra":
        assert "a:2\nb:3\nc:1\n" in text
    else:
        assert "a slots=2 max_slots=4\n" in text


def test_ranks_per_host_fills_slots_in_order_then_wraps() -> None:
    parsed = hf.parse_text("a slots=2\nb slots=2\n")
    assert parsed.ranks_per_host(3) == {"a": 2, "b": 1}
    assert parsed.ranks_per_host(4) == {"a": 2, "b": 2}
    assert parsed.ranks_per_host(7) == {"a": 4, "b": 3}


def test_check_unresolvable_host_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "good slots=1\n# comment\nghost slots=1\n")

    def resolver(host: str) -> object:
        if host == "ghost":
            raise socket.gaierror("Name or service not known")
        return []

    with pytest.raises(UserError) as err:
        hf.check(path, resolver=resolver)
    assert f"{path}:3: host 'ghost' does not resolve" in str(err.value)
    assert "good" not in str(err.value)
    # --no-resolve skips the lookup
    parsed, warnings = hf.check(path, resolve=False)
    assert parsed.total_slots == 2 and warnings == []


def test_check_warns_when_more_ranks_than_slots(tmp_path: Path) -> None:
    path = write(tmp_path, "localhost slots=2\n")
    _, warnings = hf.check(path, np=3)
    assert len(warnings) == 1 and "3 ranks but only 2 slots" in warnings[0]
    assert hf.check(path, np=2)[1] == []


def test_shipped_hostfiles_parse() -> None:
    expected = {"localhost": ("openmpi", 2), "cluster-4node.openmpi": ("openmpi", 8),
                "cluster-4node.hydra": ("hydra", 8), "netns-2node": ("openmpi", 2)}
    for name, (syntax, slots) in expected.items():
        parsed = hf.parse(REPO / "hostfiles" / name)
        assert (parsed.syntax, parsed.total_slots) == (syntax, slots), name
    assert hf.parse(REPO / "hostfiles/netns-2node").hosts == ["node0", "node1"]
    openmpi = hf.parse(REPO / "hostfiles/cluster-4node.openmpi")
    hydra = hf.parse(REPO / "hostfiles/cluster-4node.hydra")
    assert openmpi.slots_by_host() == hydra.slots_by_host()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cpudist.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_check_reports_hosts_and_slots() -> None:
    done = run_cli("hostfile", "check", "hostfiles/localhost", "--np", "4")
    assert done.returncode == 0, done.stderr
    assert "localhost: 2 slots" in done.stdout
    assert "1 host(s), 2 slot(s) in total" in done.stdout
    assert "4 ranks but only 2 slots" in done.stderr


def test_cli_check_error_exit_code(tmp_path: Path) -> None:
    path = write(tmp_path, "a slots=1\nb slots=two\n")
    done = run_cli("hostfile", "check", str(path), "--no-resolve")
    assert done.returncode == 2
    assert f"{path}:2: slots='two'" in done.stderr


def test_cli_convert(tmp_path: Path) -> None:
    out = tmp_path / "h.hydra"
    done = run_cli("hostfile", "convert", "hostfiles/cluster-4node.openmpi", "--to", "hydra",
                   "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert hf.parse(out).syntax == "hydra"
