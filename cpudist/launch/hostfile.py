"""Hostfiles in both MPI flavours' syntax: parse, validate, convert.

Open MPI:  ``host slots=N [max_slots=M]``   MPICH / Intel MPI (hydra): ``host:N``
Both accept a bare ``host`` (one slot for hydra; cpudist counts it as one slot everywhere) and
``#`` comments. Each MPI rejects the other's syntax, so the launcher converts a hostfile to the
syntax of the MPI it found (``cpudist hostfile convert`` does the same by hand).

`check` (behind ``cpudist hostfile check FILE [--np N]``) reports hosts and slots, and fails on
lines that neither MPI would accept or host names that do not resolve, naming FILE:LINE.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cpudist.errors import UserError

Syntax = Literal["openmpi", "hydra"]

# Host names (RFC 1123 labels, dots allowed), IPv4 addresses, and bracket-free IPv6 addresses
# (only in Open MPI syntax: hydra's ':' separator makes IPv6 ambiguous).
_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_IPV6_RE = re.compile(r"^[0-9A-Fa-f:]+$")


@dataclass(frozen=True)
class HostEntry:
    host: str
    slots: int  # 1 when the line did not say
    max_slots: int | None
    line: int  # 1-based line in the file, for messages
    explicit_slots: bool


@dataclass(frozen=True)
class Hostfile:
    path: str
    entries: tuple[HostEntry, ...]
    # Syntax the file was written in; None when every line is a bare host (valid in both).
    syntax: Syntax | None

    @property
    def hosts(self) -> list[str]:
        """Distinct hosts in file order (a host listed twice is one host with summed slots)."""
        return list(self.slots_by_host())

    def slots_by_host(self) -> dict[str, int]:
        slots: dict[str, int] = {}
        for entry in self.entries:
            slots[entry.host] = slots.get(entry.host, 0) + entry.slots
        return slots

    @property
    def total_slots(self) -> int:
        return sum(entry.slots for entry in self.entries)

    def ranks_per_host(self, np: int) -> dict[str, int]:
        """Where `np` ranks land when slots are filled in file order (both MPIs' default).

        Ranks beyond the total slots are spread round-robin over the hosts, as an oversubscribed
        run does; the launcher uses the busiest host to size threads per rank.
        """
        placed: dict[str, int] = {}
        remaining = np
        for host, slots in self.slots_by_host().items():
            placed[host] = min(slots, remaining)
            remaining -= placed[host]
        hosts = list(placed)
        for i in range(remaining):
            placed[hosts[i % len(hosts)]] += 1
        return placed


def _error(path: str, line: int, what: str) -> str:
    return f"{path}:{line}: {what}"


def _positive(value: str, key: str, path: str, lineno: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise UserError(_error(path, lineno, f"{key}={value!r} must be a positive integer"))
    return number


def _check_host(host: str, path: str, lineno: int, allow_ipv6: bool) -> None:
    if _HOST_RE.match(host) or (allow_ipv6 and ":" in host and _IPV6_RE.match(host)):
        return
    raise UserError(_error(path, lineno, f"{host!r} is not a valid host name or address"))


def _parse_line(text: str, path: str, lineno: int) -> tuple[HostEntry, Syntax | None]:
    tokens = text.split()
    first = tokens[0]
    if "=" in first:
        raise UserError(_error(path, lineno, f"line starts with {first!r}: put the host first"))
    # hydra: "host:N" (one token). An IPv6 address has several ':' and is Open MPI syntax.
    if first.count(":") == 1:
        host, _, count = first.partition(":")
        if len(tokens) > 1:
            raise UserError(_error(
                path, lineno,
                f"hydra syntax {first!r} takes nothing after it (found {' '.join(tokens[1:])!r}); "
                "use either 'host:N' (MPICH/Intel MPI) or 'host slots=N' (Open MPI)"))
        if not host:
            raise UserError(_error(path, lineno, f"{first!r} has no host name before ':'"))
        _check_host(host, path, lineno, allow_ipv6=False)
        slots = _positive(count, "slots (after ':')", path, lineno)
        return HostEntry(host, slots, None, lineno, True), "hydra"
    _check_host(first, path, lineno, allow_ipv6=True)
    slots: int | None = None
    max_slots: int | None = None
    for token in tokens[1:]:
        key, eq, value = token.partition("=")
        key = key.replace("-", "_")
        if not eq or key not in ("slots", "max_slots"):
            raise UserError(_error(
                path, lineno,
                f"unknown field {token!r}: Open MPI lines look like 'host slots=N [max_slots=M]'"))
        number = _positive(value, key, path, lineno)
        if key == "slots":
            slots = number
        else:
            max_slots = number
    if slots is not None and max_slots is not None and max_slots < slots:
        raise UserError(_error(path, lineno, f"max_slots={max_slots} is less than slots={slots}"))
    syntax: Syntax | None = "openmpi" if len(tokens) > 1 else None
    entry = HostEntry(first, slots or 1, max_slots, lineno, slots is not None)
    return entry, syntax


def parse_text(text: str, path: str = "<hostfile>") -> Hostfile:
    """Parse a hostfile in either syntax; the whole file must use one of them."""
    entries: list[HostEntry] = []
    syntax: Syntax | None = None
    syntax_line = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        entry, line_syntax = _parse_line(line, path, lineno)
        if line_syntax is not None:
            if syntax is not None and line_syntax != syntax:
                raise UserError(_error(
                    path, lineno,
                    f"{line_syntax} syntax here but {syntax} syntax on line {syntax_line}: "
                    "one file must use one syntax (cpudist hostfile convert can rewrite it)"))
            syntax, syntax_line = line_syntax, lineno
        entries.append(entry)
    if not entries:
        raise UserError(f"{path}: no hosts in the file (only comments or blank lines)")
    return Hostfile(path, tuple(entries), syntax)


def parse(path: str | Path) -> Hostfile:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: hostfile not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read hostfile ({exc})") from None
    return parse_text(text, str(path))


def render(hostfile: Hostfile, syntax: Syntax) -> str:
    """The hostfile in `syntax`; repeated hosts are merged (their slots summed)."""
    lines = [f"# converted by cpudist from {hostfile.path} ({syntax} syntax)"]
    max_slots: dict[str, int] = {}
    for entry in hostfile.entries:
        if entry.max_slots is not None:
            max_slots[entry.host] = max_slots.get(entry.host, 0) + entry.max_slots
    for host, slots in hostfile.slots_by_host().items():
        if syntax == "hydra":
            # hydra has no max_slots: it oversubscribes without asking.
            lines.append(f"{host}:{slots}")
        else:
            extra = f" max_slots={max_slots[host]}" if host in max_slots else ""
            lines.append(f"{host} slots={slots}{extra}")
    return "\n".join(lines) + "\n"


def unresolvable(hostfile: Hostfile,
                 resolve: Callable[[str], Any] | None = None) -> list[HostEntry]:
    """Entries whose host name does not resolve (getaddrinfo fails) on this machine."""
    def default(host: str) -> Any:
        return socket.getaddrinfo(host, None)

    resolve = resolve or default
    bad: list[HostEntry] = []
    seen: dict[str, bool] = {}
    for entry in hostfile.entries:
        if entry.host not in seen:
            try:
                resolve(entry.host)
                seen[entry.host] = True
            except (OSError, UnicodeError):
                seen[entry.host] = False
        if not seen[entry.host]:
            bad.append(entry)
    return bad


def check(path: str | Path, np: int | None = None, resolve: bool = True,
          resolver: Callable[[str], Any] | None = None) -> tuple[Hostfile, list[str]]:
    """Validate a hostfile; raises UserError on errors, returns warnings."""
    hostfile = parse(path)
    if resolve:
        bad = unresolvable(hostfile, resolver)
        if bad:
            raise UserError("\n".join(
                _error(hostfile.path, e.line,
                       f"host {e.host!r} does not resolve on {socket.gethostname()}: fix the name, "
                       "add it to /etc/hosts or DNS, or pass --no-resolve")
                for e in bad))
    warnings: list[str] = []
    if np is not None and np > hostfile.total_slots:
        warnings.append(
            f"{hostfile.path}: {np} ranks but only {hostfile.total_slots} slots: ranks will share "
            "cores (Open MPI needs --oversubscribe, which cpudist launch adds); add hosts or "
            "slots, or lower -np")
    implicit = [e for e in hostfile.entries if not e.explicit_slots]
    if implicit and hostfile.syntax is None:
        warnings.append(
            f"{hostfile.path}: no slot counts given; cpudist counts 1 slot per host (Open MPI 5 "
            "may count every core): write 'host slots=N' or 'host:N' to be explicit")
    return hostfile, warnings


def describe(hostfile: Hostfile) -> Iterable[str]:
    syntax = hostfile.syntax or "bare host names (valid in both)"
    yield f"{hostfile.path}: {syntax} syntax"
    for host, slots in hostfile.slots_by_host().items():
        yield f"  {host}: {slots} slot{'s' if slots != 1 else ''}"
    yield f"{len(hostfile.hosts)} host(s), {hostfile.total_slots} slot(s) in total"
