"""JSON Lines files, read with errors that name FILE:LINE.

One reader for datasets (cpudist.data) and metrics.jsonl (cpudist.plots, and cpudist.report when a
run resumes); the callers differ only in the advice they give and in how they take lines that are
not JSON objects.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from cpudist.errors import UserError

RE_ENCODE = "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
FIX_LINE = "fix or remove that line"


class JsonlError(UserError):
    """A line that is not UTF-8 text or not JSON, at byte offset `start` of the file."""

    def __init__(self, message: str, number: int, start: int) -> None:
        super().__init__(message)
        self.number = number
        self.start = start


class Line(NamedTuple):
    number: int  # 1-based, as editors count
    start: int  # byte offset of the line in the file
    end: int  # byte offset just past it (past its newline, if it has one)
    value: Any  # the parsed JSON


def iter_jsonl(path: Path, advice: str | None = None, start: int = 0, stop: int | None = None,
               first_line: int = 1) -> Iterator[Line]:
    """Every non-blank line of `path`, parsed. `advice` ends the error message of a bad line
    (default: how to fix a hand-made file). A shard of the file: the lines that begin in the byte
    range [start, stop), `start` being the beginning of line number `first_line`."""
    offset = start
    with open(path, "rb") as handle:  # bytes, so that a bad encoding is reported by line
        handle.seek(start)
        for number, raw in enumerate(handle, start=first_line):
            if stop is not None and offset >= stop:
                break
            start, offset = offset, offset + len(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise JsonlError(f"{path}:{number}: not UTF-8 text; {advice or RE_ENCODE}",
                                 number, start) from None
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                # Some messages end in "at" ("Invalid control character at"): said once.
                raise JsonlError(f"{path}:{number}: malformed JSON "
                                 f"({exc.msg.removesuffix(' at')} at column "
                                 f"{exc.colno}); {advice or FIX_LINE}", number, start) from None
            yield Line(number, start, offset, value)


def read_jsonl(path: Path, *, skip_non_objects: bool = False,
               advice: str | None = None) -> list[dict[str, Any]]:
    """The JSON objects of `path`. A line that is another JSON value is an error (datasets, where
    it is a mistake) or skipped (skip_non_objects: metrics.jsonl, where only objects count)."""
    rows = []
    for line in iter_jsonl(path, advice):
        if isinstance(line.value, dict):
            rows.append(line.value)
        elif not skip_non_objects:
            raise UserError(f"{path}:{line.number}: each line must be a JSON object")
    return rows
