"""The one JSON Lines reader: datasets (non-objects are errors) and metrics.jsonl (skipped)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpudist.errors import UserError
from cpudist.jsonl import JsonlError, iter_jsonl, read_jsonl


def test_objects_blank_lines_and_offsets(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  \n{"b": "\xc3\xa9"}\n[1, 2]')
    lines = list(iter_jsonl(path))
    assert [(x.number, x.start, x.end) for x in lines] == [(1, 0, 9), (4, 13, 25), (5, 25, 31)]
    with pytest.raises(UserError, match=r"rows\.jsonl:5: each line must be a JSON object"):
        read_jsonl(path)
    assert read_jsonl(path, skip_non_objects=True) == [{"a": 1}, {"b": "é"}]


@pytest.mark.parametrize(("content", "message"), [
    (b'{"a": 1}\n{"a": }\n', r":2: malformed JSON \(Expecting value at column 7\); fix or remove"),
    (b'{"a": 1}\n{"a": "caf\xe9"}\n', r":2: not UTF-8 text; re-encode the file as UTF-8"),
])
def test_errors_name_the_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(JsonlError, match=message) as err:
        read_jsonl(path)
    assert (err.value.number, err.value.start) == (2, 9)
    with pytest.raises(JsonlError, match=r":2: .*; remove that line$"):
        read_jsonl(path, skip_non_objects=True, advice="remove that line")
