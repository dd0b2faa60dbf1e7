"""Data files read as a stream of shards and tokenized by a pool of worker processes.

A file is cut into shards: byte ranges of a .jsonl starting at line starts, row groups of a
.parquet, row ranges of a saved datasets directory (a .json document is one shard: it is one JSON
value, parsed whole). A worker reads its shard a chunk of rows at a time, tokenizes the chunk and
appends it to its own Arrow file, so no process holds the raw records of more than a chunk, nor the
tokens of more than a chunk. The tokenized data is those Arrow files in shard order, which every
rank memory-maps.

Why a pool of our own rather than `datasets.map(num_proc=...)`: map starts from an Arrow table
of the raw records, which datasets' JSON loader builds in one process before any map (a serial
pass and a second copy of the raw text on disk); map names a failing row by its index in that
table, not by the file's line; and the error reaches the caller only through its pool's
teardown. Here each worker reads its own byte range of the file (the read is parallel too), a bad
row is reported as FILE:LINE the moment a worker meets it, and the pool is terminated at once.
Workers are forked: they inherit the loaded tokenizer and row function (nothing is pickled or
imported again), and only ever run Python, the tokenizer and pyarrow, never torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpudist.errors import UserError
from cpudist.jsonl import iter_jsonl
from cpudist.report.console import RowProgress

log = logging.getLogger("cpudist")

# A shard of a .jsonl file: about total / (4 x workers) bytes (several per worker, so that the
# last ones finish together), within these bounds.
MIN_SHARD_BYTES = 1 << 20
MAX_SHARD_BYTES = 64 << 20
SHARD_ROWS = 20_000  # rows per shard of a parquet file (whole row groups) or a datasets directory
CHUNK_ROWS = 1_000  # rows a worker tokenizes and writes at a time
PROGRESS_EVERY_S = 10.0

# One chunk of rows -> (columns of equal length, counts to add up). Each row comes with its place
# ("file:line" or "file (record n)") for errors.
ChunkTokenizer = Callable[[list[tuple[str, Any]]], tuple[dict[str, list[Any]], dict[str, int]]]


@dataclass(frozen=True)
class Shard:
    path: str
    kind: str  # jsonl | json | parquet | datasets
    start: int  # jsonl: byte offset; parquet: first row group; datasets: first row
    stop: int  # jsonl: byte offset; parquet: row group after the last; datasets: row after it
    first: int  # the line number (jsonl) or record number of its first row
    rows: int  # rows in it (jsonl: lines, an estimate), for the ETA


def kind_of(path: Path) -> str:
    if path.is_dir():
        return "datasets"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet"):
        return suffix[1:]
    raise UserError(f"{path}: unsupported data file type '{suffix}'; use .jsonl, .json, .parquet "
                    "or a saved datasets directory")


def plan_shards(paths: list[Path], workers: int) -> list[Shard]:
    """The shards of every file, in file and row order."""
    shards: list[Shard] = []
    for path in paths:
        kind = kind_of(path)
        if kind == "jsonl":
            shards += _jsonl_shards(path, workers)
        elif kind == "parquet":
            shards += _parquet_shards(path)
        elif kind == "datasets":
            rows = len(load_saved(path))
            shards += [Shard(str(path), kind, start, min(start + SHARD_ROWS, rows), start + 1,
                             min(SHARD_ROWS, rows - start)) for start in range(0, rows, SHARD_ROWS)]
        else:
            shards.append(Shard(str(path), kind, 0, 0, 1, 0))
    return shards


def _jsonl_shards(path: Path, workers: int) -> list[Shard]:
    """Byte ranges cut at line starts, with the number of each range's first line (one pass over
    the file counting newlines, in blocks)."""
    size = path.stat().st_size
    target = min(max(size // (4 * workers), MIN_SHARD_BYTES), MAX_SHARD_BYTES)
    cuts = [0]
    with open(path, "rb") as handle:
        while cuts[-1] + target < size:
            handle.seek(cuts[-1] + target)
            handle.readline()  # to the start of the next line
            if handle.tell() >= size:
                break
            cuts.append(handle.tell())
        cuts.append(size)
        shards, line = [], 1
        for start, stop in zip(cuts[:-1], cuts[1:], strict=True):
            handle.seek(start)
            lines, left = 0, stop - start
            while left > 0:
                block = handle.read(min(left, 16 << 20))
                lines += block.count(b"\n")
                left -= len(block)
            shards.append(Shard(str(path), "jsonl", start, stop, line, lines))
            line += lines
    return shards


def _parquet_refusal(path: Path, exc: BaseException) -> UserError | None:
    """A one-line UserError for a damaged parquet file (cut short, not parquet, corrupt pages),
    or None when exc is not about the file's content."""
    import pyarrow

    # pyarrow's own errors; its OSErrors (e.g. corrupt compressed data) carry no errno.
    if isinstance(exc, pyarrow.ArrowException) or (isinstance(exc, OSError) and exc.errno is None):
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return UserError(f"{path}: not a readable parquet file ({why}); copy or export it again")
    return None


def _parquet_shards(path: Path) -> list[Shard]:
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(path)
    except Exception as exc:
        refusal = _parquet_refusal(path, exc)
        if refusal is not None:
            raise refusal from None
        if isinstance(exc, OSError):
            raise UserError(f"{path}: cannot read it ({exc.strerror})") from None
        raise
    shards: list[Shard] = []
    group, record = 0, 1
    while group < metadata.num_row_groups:
        first, rows = group, 0
        while group < metadata.num_row_groups and (rows == 0 or rows < SHARD_ROWS):
            rows += metadata.row_group(group).num_rows
            group += 1
        shards.append(Shard(str(path), "parquet", first, group, record, rows))
        record += rows
    return shards


def load_saved(path: Path) -> Any:
    """A saved datasets directory (its train split, or its first, when it holds several)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(f"{path}: not a saved datasets directory ({exc})") from exc
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    return loaded


def _json_rows(path: Path) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; re-encode the file as UTF-8") from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg})") from None
    if isinstance(loaded, dict) and "data" in loaded:
        loaded = loaded["data"]
    if not isinstance(loaded, list):
        raise UserError(f"{path}: a .json dataset must be a list of objects (or use .jsonl)")
    return loaded


def shard_rows(shard: Shard) -> Iterator[tuple[str, Any]]:
    """(place, record) of each row of a shard, read as a stream."""
    path = Path(shard.path)
    if shard.kind == "jsonl":
        for line in iter_jsonl(path, start=shard.start, stop=shard.stop, first_line=shard.first):
            yield f"{path}:{line.number}", line.value
    elif shard.kind == "json":
        for number, row in enumerate(_json_rows(path), start=1):
            yield f"{path} (record {number})", row
    elif shard.kind == "parquet":
        yield from _parquet_rows(shard)
    else:
        table = load_saved(path)
        for begin in range(shard.start, shard.stop, CHUNK_ROWS):
            columns = table[begin : min(begin + CHUNK_ROWS, shard.stop)]
            for offset, values in enumerate(zip(*columns.values(), strict=True)):
                yield f"{path} (record {begin + offset + 1})", dict(zip(columns, values,
                                                                        strict=True))


def _parquet_rows(shard: Shard) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    path, number = Path(shard.path), shard.first
    try:
        batches = pq.ParquetFile(path).iter_batches(
            batch_size=CHUNK_ROWS, row_groups=list(range(shard.start, shard.stop)))
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{path} (record {number})", row
                number += 1
    except Exception as exc:
        refusal = _parquet_refusal(path, exc)
        if refusal is None or isinstance(exc, UserError):
            raise
        raise refusal from None


def chunks(rows: Iterator[tuple[str, Any]], size: int) -> Iterator[list[tuple[str, Any]]]:
    chunk: list[tuple[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# --------------------------------------------------------------------------- the pool


@dataclass
class Job:
    """What every worker needs: the shards, the row function, and where the Arrow files go."""

    shards: list[Shard]
    tokenize: ChunkTokenizer
    out: Path
    limit: int | None = None  # rows in all (data.max_samples): read in order, one process


class _Counter:
    """Rows done, in one process (the pool's is a shared multiprocessing.Value)."""

    def __init__(self) -> None:
        self.value = 0


_JOB: Job | None = None  # set before the workers fork; they read it (never pickled)
_DONE: Any = None  # rows done by all workers


def shard_file(out: Path, index: int) -> Path:
    return out / f"{index:05d}.arrow"


def _write_shard(job: Job, index: int, rows: Iterator[tuple[str, Any]],
                 tick: Callable[[int], None]) -> dict[str, int]:
    """Tokenize a shard's rows chunk by chunk into its Arrow file; the counts of its rows."""
    import pyarrow as pa

    stats: dict[str, int] = {}
    writer = None
    try:
        for chunk in chunks(rows, CHUNK_ROWS):
            columns, counts = job.tokenize(chunk)
            for key, value in counts.items():
                stats[key] = stats.get(key, 0) + value
            tick(len(chunk))
            if not next(iter(columns.values()), []):
                continue  # every row of the chunk dropped
            batch = _compact(pa.RecordBatch.from_pydict(columns))
            if writer is None:
                writer = pa.ipc.new_file(str(shard_file(job.out, index)), batch.schema)
            writer.write_batch(batch)
    finally:
        if writer is not None:
            writer.close()
    return stats


def _compact(batch: Any) -> Any:
    """Token id columns as 32-bit integers (Arrow infers 64): half the bytes on disk and mapped."""
    import pyarrow as pa

    fields = [pa.field(f.name, pa.list_(pa.int32())) if pa.types.is_list(f.type)
              and pa.types.is_integer(f.type.value_type) else f for f in batch.schema]
    return batch.cast(pa.schema(fields)) if fields != list(batch.schema) else batch


def _run_shard(index: int) -> tuple[int, dict[str, int]]:
    """A worker's task: one shard. A UserError is sent back as a plain one (picklable)."""
    job, done = _JOB, _DONE
    assert job is not None

    def tick(rows: int) -> None:
        with done.get_lock():
            done.value += rows

    try:
        return index, _write_shard(job, index, shard_rows(job.shards[index]), tick)
    except UserError as exc:
        raise UserError(str(exc)) from None


def _worker_start() -> None:
    # Forked from a rank: its signal handlers (stop at a step boundary) would make the pool's
    # terminate() wait for a shard to finish; Ctrl-C is the parent's to handle.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A rank's threads are pinned to its cores; a worker may run on any core of the node.
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


def run_job(job: Job, workers: int, what: str) -> dict[str, int]:
    """Tokenize every shard into job.out (one Arrow file per shard that kept rows); the counts
    added up. `workers` processes (1: this one). A bad row stops every worker at once."""
    progress = RowProgress(what, sum(shard.rows for shard in job.shards), PROGRESS_EVERY_S)
    if workers <= 1 or len(job.shards) <= 1 or job.limit is not None:
        results, done = _in_process(job, progress)
    else:
        results, done = _in_pool(job, min(workers, len(job.shards)), progress)
    progress.finish(done)
    stats: dict[str, int] = {}
    for counts in results:
        for key, value in counts.items():
            stats[key] = stats.get(key, 0) + value
    return stats


def _in_process(job: Job, progress: RowProgress) -> tuple[list[dict[str, int]], int]:
    counter = _Counter()
    left = job.limit

    def tick(rows: int) -> None:
        counter.value += rows
        progress.update(counter.value)

    results = []
    for index, shard in enumerate(job.shards):
        rows = shard_rows(shard)
        if left is not None:
            rows = _first(rows, left)
        results.append(_write_shard(job, index, rows, tick))
        if left is not None:
            left = job.limit - counter.value  # type: ignore[operator]
            if left <= 0:
                break
    return results, counter.value


def _first(rows: Iterator[tuple[str, Any]], count: int) -> Iterator[tuple[str, Any]]:
    for number, row in enumerate(rows):
        if number == count:
            return
        yield row


def _in_pool(job: Job, workers: int, progress: RowProgress) -> tuple[list[dict[str, int]], int]:
    global _JOB, _DONE
    context = multiprocessing.get_context("fork")
    _JOB, _DONE = job, context.Value("q", 0)
    pool = context.Pool(workers, initializer=_worker_start)
    try:
        results: list[dict[str, int]] = [{} for _ in job.shards]
        pending = pool.imap_unordered(_run_shard, range(len(job.shards)))
        for _ in job.shards:
            while True:
                try:
                    index, counts = pending.next(timeout=1.0)
                    break
                except multiprocessing.TimeoutError:
                    progress.update(_DONE.value)
            results[index] = counts
            progress.update(_DONE.value)
        pool.close()
        return results, _DONE.value
    except BaseException:
        pool.terminate()  # the first error stops every worker; no shard is finished
        raise
    finally:
        pool.join()
        _JOB = None
