"""Which checkpoint directories exist and which of them are intact: the listing, the manifest of
sizes and SHA-256 sums each checkpoint carries, and the newest usable one.

Torch-free on purpose: `cpudist launch --restarts` asks it which step a restarted job resumes from
without loading torch. cpudist.train.checkpoint writes and reads the tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from cpudist.errors import UserError
from cpudist.files import TMP_MARK, remove

log = logging.getLogger("cpudist")
STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
DAMAGED_PREFIX = "damaged-"  # a checkpoint that failed its manifest, moved aside (kept to inspect)
_CHUNK = 1 << 20


def step_of(path: Path) -> int:
    match = STEP_DIR.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not a step-N checkpoint directory")
    return int(match.group(1))


def checkpoint_dirs(root: Path) -> list[Path]:
    """Complete checkpoints (state.json present: written before the rename), oldest first."""
    if not root.is_dir():
        return []
    found = [(step_of(path), path) for path in root.iterdir()
             if STEP_DIR.match(path.name) and (path / "state.json").is_file()]
    return [path for _, path in sorted(found)]


def clean_partial(root: Path) -> list[Path]:
    """Remove half-written checkpoint directories left by a crash during a save."""
    removed = []
    if root.is_dir():
        for path in root.iterdir():
            if TMP_MARK in path.name or (STEP_DIR.match(path.name)
                                         and not (path / "state.json").is_file()):
                remove(path)
                removed.append(path)
    return removed


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> Path:
    """directory/manifest.json: every file's size and SHA-256. Written last, so it covers the
    checkpoint as renamed into place."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size,
                                                     "sha256": _sha256(p)} for p in files}
    target = directory / MANIFEST
    target.write_text(json.dumps({"format": 1, "files": entries}, indent=1))
    return target


def verify(directory: Path) -> str | None:
    """What is wrong with a checkpoint against its manifest (None: intact, or no manifest)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        entries = manifest["files"]
        if not isinstance(entries, dict):
            raise TypeError("'files' is not a mapping")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} is unreadable ({exc})"
    for name, entry in entries.items():
        path = directory / name
        try:
            size = path.stat().st_size
            if size != entry["size"]:
                return f"{name} has {size} bytes, the manifest says {entry['size']}"
            if _sha256(path) != entry["sha256"]:
                return f"{name} does not match its SHA-256 in the manifest"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as exc:
            return f"{name} is unreadable ({exc.strerror or exc})"
    return None


def has_manifest(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def newest_usable(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint that passes its manifest, and (path, what is wrong) for each
    newer one that did not."""
    damaged = []
    for path in reversed(checkpoint_dirs(root)):
        wrong = verify(path)
        if wrong is None:
            return path, damaged
        damaged.append((path, wrong))
    return None, damaged


def _free_name(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}.{n}"), n + 1
    return candidate


def resume_auto(root: Path) -> Path | None:
    """The checkpoint train.resume=auto continues from: the newest intact one, None when there is
    none. Damaged newer ones are renamed damaged-step-N, out of the way of resume and retention
    but kept for a look; when every checkpoint is damaged nothing is moved and it is an error."""
    for path in clean_partial(root):
        log.warning("removed half-written checkpoint %s", path)
    found, damaged = newest_usable(root)
    if found is None and damaged:
        lines = "; ".join(f"{path.name}: {wrong}" for path, wrong in damaged)
        raise UserError(f"no usable checkpoint in {root} ({lines}). Resume from a good copy with "
                        "train.resume=PATH, or start over in a new output.dir")
    for path, wrong in damaged:
        aside = _free_name(path.with_name(DAMAGED_PREFIX + path.name))
        path.rename(aside)
        log.warning("checkpoint %s is damaged (%s); moved to %s, resuming from the previous one, "
                    "%s", path, wrong, aside.name, found.name if found else None)
    if found is not None and not has_manifest(found):
        log.warning("checkpoint %s has no %s (written by an older cpudist): resuming from it "
                    "unchecked", found, MANIFEST)
    return found


def check_given(path: Path) -> None:
    """train.resume=PATH: a damaged checkpoint is refused, naming what failed."""
    wrong = verify(path)
    if wrong is not None:
        raise UserError(f"train.resume={path}: the checkpoint is damaged ({wrong}); pick an "
                        "older one under checkpoints/ or use train.resume=auto")
    if not has_manifest(path):
        log.warning("checkpoint %s has no %s (written by an older cpudist): resuming from it "
                    "unchecked", path, MANIFEST)
