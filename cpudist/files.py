"""Files written so that a reader never sees half of them, and work done once per node.

`replacing(target)` is the one way cpudist writes a file or directory that someone may read: the
content goes to a hidden temporary sibling, which replaces the target only once it is complete,
and is removed when writing fails. `file_lock` makes the processes of a node (and of nodes sharing
a filesystem) take turns at one-time work such as a model conversion or tokenization.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

TMP_MARK = ".tmp-"


@contextlib.contextmanager
def file_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive lock shared by every process on the node (ranks convert/tokenize once).
    `on_wait` is called when another process holds it, before waiting (to say so)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def temporary_sibling(target: Path) -> Path:
    """A hidden name beside target, unique per host and process (nodes may share a filesystem)."""
    target = Path(target)
    return target.with_name(f".{target.name}{TMP_MARK}{socket.gethostname()}-{os.getpid()}")


def remove(path: Path) -> None:
    """Remove a file or a directory tree, if it is there."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """Yield a temporary path to write target's new content to (a file, or a directory the caller
    creates); on success it takes target's place, on any error it is removed and target is left
    as it was. A directory target is swapped out first (os.replace cannot replace a non-empty
    directory), so readers see the old or the new one, never a mix."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(target)
    remove(tmp)
    try:
        yield tmp
        if target.is_dir() and not target.is_symlink():
            old = target.with_name(f".{target.name}.old-{socket.gethostname()}-{os.getpid()}")
            remove(old)
            os.replace(target, old)
            os.replace(tmp, target)
            remove(old)
        else:
            os.replace(tmp, target)
    except BaseException:
        remove(tmp)
        raise


def write_text(target: Path, text: str, encoding: str = "utf-8") -> None:
    """Write a text file atomically."""
    with replacing(target) as tmp:
        tmp.write_text(text, encoding=encoding)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file under path, and path itself, to disk."""
    for file in Path(path).rglob("*"):
        if file.is_file():
            with open(file, "rb+") as handle:
                os.fsync(handle.fileno())
    fsync_dir(path)


# Filesystems that several machines mount: a cache there is written once for the cluster.
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs",
                       "cephfs", "ceph", "glusterfs", "fuse.glusterfs", "panfs", "9p", "wekafs",
                       "fuse.sshfs", "afs")


def shared_filesystem(path: Path, mounts: str = "/proc/mounts") -> str | None:
    """The type of the network filesystem holding `path` (nfs4, lustre, ...), or None for a
    local one (or when the mount table cannot be read)."""
    target = os.path.realpath(path)
    best, kind = "", ""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind if kind in NETWORK_FILESYSTEMS else None
