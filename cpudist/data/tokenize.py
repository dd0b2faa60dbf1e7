"""Tokenizing once, with prompt masking, cached on disk; and the train/validation split.

Token ids are cached (keyed by the file, format, tokenizer and max_length) so every later run and
every rank reads them instead of tokenizing again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, overload

from cpudist.config import DataConfig
from cpudist.data.chat_spans import derived_renders
from cpudist.data.formats import Messages, to_sample
from cpudist.data.read import resolve_data_paths
from cpudist.data.shards import Job, plan_shards, run_job
from cpudist.errors import UserError
from cpudist.files import file_lock, replacing, shared_filesystem

log = logging.getLogger("cpudist")

IGNORE = -100  # the label of a position that carries no loss (the value PyTorch and HF skip)
ALPACA_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"


def tokenize_conversation(tokenizer: Any, messages: Messages) -> tuple[list, list]:
    """Token ids and labels; only assistant turns (and their end-of-turn token) carry loss.

    The conversation is rendered, then tokenized whole, as generation and serving see it: pieces
    tokenized one by one split differently at their seams with SentencePiece tokenizers (Llama 2,
    Mistral: "[/INST]Paris" is "]", "P", not "]", "▁P"), and a template that writes the BOS itself
    (Llama 2 and 3, Mistral) got a second one from the tokenizer."""
    ids, labels, _ = _tokenize_conversation(tokenizer, messages)
    return ids, labels


def render_chat(tokenizer: Any, messages: Messages, generation_prompt: bool) -> str:
    """The conversation as the tokenizer's chat template writes it; a template that refuses it is
    a UserError."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except TemplateError as exc:  # the template's own raise_exception(...) among them
        raise UserError(f"the tokenizer's chat template refused this conversation ({exc}); give "
                        "it the roles it takes (some templates take no system turn, or need user "
                        "and assistant turns to alternate)") from None


def _tokenize_conversation(tokenizer: Any, messages: Messages, derive: bool = True
                           ) -> tuple[list, list, bool]:
    """tokenize_conversation's ids and labels, and whether only the last answer carries loss.

    Every prompt and prompt + answer is rendered; where the template allows (chat_spans.py)
    those renders are cut from one render of the whole (derive=False: always render each)."""
    if tokenizer.chat_template is None:
        prompt = ALPACA_TEMPLATE.format(
            instruction="\n\n".join(m["content"] for m in messages if m["role"] != "assistant"))
        answer = "\n".join(m["content"] for m in messages if m["role"] == "assistant")
        ids, labels = label_spans(tokenizer, prompt + answer, [(len(prompt), len(prompt + answer))],
                                   add_special_tokens=True)
        return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id], False

    def exact(upto: int, generation_prompt: bool) -> str:
        return render_chat(tokenizer, messages[:upto], generation_prompt)

    answers = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    render = exact
    if derive and answers and answers[0] > 0:
        render = derived_renders(tokenizer, messages, answers[-1] + 1) or exact
    spans: list[tuple[int, int]] = []
    done = ""
    for index in answers:
        before = render(index, generation_prompt=True)
        after = render(index + 1, generation_prompt=False)
        if not before.startswith(done) or not after.startswith(before):
            break
        spans.append((len(before), len(after)))
        done = after
    last_only = len(spans) < len(answers)
    if last_only:
        # The template rewrites earlier turns once a later one follows (Qwen3 drops their
        # reasoning): the answers it renders as the last turn are the ones generation produces,
        # so the last answer carries loss and the rewritten history is its context.
        before = render(answers[-1], generation_prompt=True)
        done = render(answers[-1] + 1, generation_prompt=False)
        if not done.startswith(before):
            raise UserError("the tokenizer's chat template does not render a conversation's last "
                            "answer after its prompt; use data.format=text or a standard chat "
                            "template")
        spans = [(len(before), len(done))]
    # As apply_chat_template(tokenize=True): the template writes whatever special tokens it wants.
    ids, labels = label_spans(tokenizer, done, spans, add_special_tokens=False)
    return ids, labels, last_only


def label_spans(tokenizer: Any, text: str, spans: list[tuple[int, int]], add_special_tokens: bool
                 ) -> tuple[list[int], list[int]]:
    """text tokenized whole; a token is its own label where it overlaps one of spans (character
    ranges), IGNORE elsewhere."""
    if not getattr(tokenizer, "is_fast", False):  # no offsets: tokenize piece by piece
        ids: list[int] = []
        labels: list[int] = []
        cuts = [0, *(cut for span in spans for cut in span), len(text)]
        for number, (start, end) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
            piece = tokenizer(text[start:end], add_special_tokens=add_special_tokens and not start)
            ids += piece["input_ids"]
            labels += piece["input_ids"] if number % 2 else [IGNORE] * len(piece["input_ids"])
        return ids, labels
    import numpy as np

    backend = tokenizer.backend_tokenizer
    if backend.truncation is None and backend.padding is None:
        # The Rust tokenizer itself: what tokenizer(...) returns here, without its per-call
        # Python (a fifth of the time of a conversation's tokenization).
        encoding = backend.encode(text, add_special_tokens=add_special_tokens)
        ids, offsets = encoding.ids, encoding.offsets
    else:
        encoded = tokenizer(text, add_special_tokens=add_special_tokens,
                            return_offsets_mapping=True)
        ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    if not ids:
        return [], []
    token_ids = np.asarray(ids, dtype=np.int64)
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    start, end = bounds[:, 0], bounds[:, 1]
    inside = np.zeros(len(ids), dtype=bool)
    for begin, stop in spans:
        inside |= (start < stop) & (end > begin)
    return list(ids), np.where(inside & (end > start), token_ids, IGNORE).tolist()


class Rows:
    """Rows of token ids stored flat: the values (one array per stored chunk, memory-mapped from
    the cache), and each row's chunk, start and length. A row is read as a list of ints; no row
    is held as one, so a split of millions of rows costs 20 bytes a row besides its tokens."""

    def __init__(self, values: list[Any], chunk: Any, start: Any, length: Any) -> None:
        self.values, self.chunk, self.start, self.length = values, chunk, start, length

    def __len__(self) -> int:
        return len(self.length)

    @overload
    def __getitem__(self, index: int) -> list[int]: ...

    @overload
    def __getitem__(self, index: slice) -> list[list[int]]: ...

    def __getitem__(self, index: int | slice) -> list[int] | list[list[int]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        begin = int(self.start[index])
        return self.values[self.chunk[index]][begin : begin + int(self.length[index])].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[index] for index in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (Rows, list)) else NotImplemented

    def subset(self, indices: Any) -> Rows:
        return Rows(self.values, self.chunk[indices], self.start[indices], self.length[indices])

    @classmethod
    def concat(cls, parts: Sequence[Rows]) -> Rows:
        """The rows of each part, in order (their values shared, not copied)."""
        import numpy as np

        values: list[Any] = []
        chunks = []
        for part in parts:
            chunks.append(part.chunk + len(values))
            values += part.values
        return cls(values, np.concatenate(chunks).astype(np.int32),
                   np.concatenate([part.start for part in parts]),
                   np.concatenate([part.length for part in parts]))

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]]) -> Rows:
        import numpy as np

        length = np.array([len(row) for row in rows], dtype=np.int64)
        start = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
        flat = np.fromiter((token for row in rows for token in row), dtype=np.int64,
                           count=int(length.sum()))
        return cls([flat], np.zeros(len(rows), dtype=np.int32), start, length)

    @classmethod
    def from_column(cls, column: Any) -> Rows:
        """An Arrow list column (chunked), its values read in place (zero-copy)."""
        import numpy as np

        values, chunk, start, length = [], [], [], []
        for number, part in enumerate(column.chunks):
            offsets = part.offsets.to_numpy()
            values.append(part.values.to_numpy(zero_copy_only=True))
            start.append(offsets[:-1].astype(np.int64))
            length.append(np.diff(offsets).astype(np.int64))
            chunk.append(np.full(len(part), number, dtype=np.int32))
        if not values:
            return cls.from_lists([])
        return cls(values, np.concatenate(chunk), np.concatenate(start), np.concatenate(length))


class TokenizedSplit:
    """Supervised fine-tuning samples: token ids and labels (IGNORE where no loss), as Rows."""

    def __init__(self, input_ids: Sequence[Sequence[int]] | Rows,
                 labels: Sequence[Sequence[int]] | Rows) -> None:
        self.input_ids = input_ids if isinstance(input_ids, Rows) else Rows.from_lists(input_ids)
        self.labels = labels if isinstance(labels, Rows) else Rows.from_lists(labels)

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> list[int]:
        return self.input_ids.length.tolist()

    def label_count(self, index: int) -> int:
        # Labels are shifted by one inside the loss: the first position never counts.
        return sum(1 for label in self.labels[index][1:] if label != IGNORE)

    def subset(self, indices: Sequence[int]) -> TokenizedSplit:
        import numpy as np

        chosen = np.asarray(indices, dtype=np.int64)
        return TokenizedSplit(self.input_ids.subset(chosen), self.labels.subset(chosen))


@dataclass
class TokenizeStats:
    samples: int
    truncated: int
    dropped_no_labels: int
    # Conversations whose template rewrites earlier turns: only their last answer carries loss.
    last_answer_only: int


def places(records: Sequence[Any], source: str) -> list[tuple[str, Any]]:
    """Records in memory with their places for errors (FILE:LINE for JSON lines)."""
    return [(f"{source}:{number}" if source.endswith(".jsonl") else f"{source} (record {number})",
             row) for number, row in enumerate(records, start=1)]


def tokenize_records(records: list[dict[str, Any]], tokenizer: Any, config: DataConfig,
                     source: str) -> tuple[TokenizedSplit, TokenizeStats]:
    """Records in memory tokenized for supervised fine-tuning (as each chunk of a file is)."""
    columns, stats = sft_chunk(places(records, source), tokenizer, config)
    return (TokenizedSplit(columns["input_ids"], columns["labels"]),
            TokenizeStats(**stats))


def sft_chunk(rows: list[tuple[str, Any]], tokenizer: Any, config: DataConfig
              ) -> tuple[dict[str, list[Any]], dict[str, int]]:
    """Rows (with their places) -> columns input_ids and labels, and the counts for the log."""
    input_ids: list[list[int]] = []
    labels: list[list[int]] = []
    truncated = dropped = last_only = 0
    for where, row in rows:
        if not isinstance(row, dict):
            raise UserError(f"{where}: each record must be an object")
        sample = to_sample(row, config.format, where, config.system_prompt)
        if not isinstance(sample, (str, list)):
            raise UserError(f"{where}: data.format={config.format} rows are not for "
                            "train.objective=sft (data.format=preference: train.objective=dpo or orpo)")
        if isinstance(sample, str):
            ids = tokenizer(sample, add_special_tokens=True)["input_ids"]
            ids = ids + [tokenizer.eos_token_id]
            row_labels = list(ids)
        else:
            try:
                ids, row_labels, rewritten = _tokenize_conversation(tokenizer, sample)
            except UserError as exc:
                raise UserError(f"{where}: {exc}") from None
            last_only += rewritten
        if len(ids) > config.max_length:
            truncated += 1
            ids, row_labels = ids[: config.max_length], row_labels[: config.max_length]
        if all(label == IGNORE for label in row_labels[1:]):
            dropped += 1
            continue
        input_ids.append(ids)
        labels.append(row_labels)
    return ({"input_ids": input_ids, "labels": labels},
            {"samples": len(rows), "truncated": truncated, "dropped_no_labels": dropped,
             "last_answer_only": last_only})


_PROBE: Messages = [{"role": "user", "content": "Hello, what is 2 + 2?"},
                    {"role": "assistant", "content": " 4.\nDone."}]


def fingerprint(paths: list[Path], config: DataConfig, tokenizer: Any, kind: str) -> str:
    """The cache key of data files tokenized for `kind` (an objective's rows: sft, ...): the
    files' bytes (a directory's names, sizes and times), what the tokenizer does, the settings."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{path.name}\n".encode())
        if path.is_dir():
            for file in sorted(path.rglob("*")):
                if file.is_file():
                    digest.update(f"{file.name}:{file.stat().st_size}:{file.stat().st_mtime_ns}"
                                  .encode())
        else:
            with open(path, "rb") as handle:
                digest.update(hashlib.file_digest(handle, "sha256").digest())
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())[:2000]) + str(len(tokenizer))
    # What the tokenizer does, not only what it holds: the same vocabulary and template can
    # tokenize differently (a BOS added or not, another normalizer). A cache keyed on vocabulary
    # alone kept serving rows that started with a doubled <|im_start|> after such a change.
    behaviour: list[Any] = [tokenizer(_PROBE[0]["content"], add_special_tokens=True)["input_ids"]]
    if tokenizer.chat_template is not None:
        behaviour.append(tokenize_conversation(tokenizer, _PROBE))
    settings = [kind, config.format, config.max_length, config.system_prompt, config.max_samples,
                tokenizer.chat_template or "", vocab, behaviour, "v6"]
    digest.update(json.dumps(settings).encode())
    return digest.hexdigest()[:16]


# A chunk of rows (each with its place, FILE:LINE, for errors) as an objective tokenizes them:
# (rows, tokenizer, data settings) -> (columns of equal length, counts to add up: "samples", ...).
RowTokenizer = Callable[[list[tuple[str, Any]], Any, DataConfig],
                        tuple[dict[str, list[Any]], dict[str, int]]]


def load_columns(paths: Path | list[Path], tokenizer: Any, config: DataConfig, kind: str,
                 tokenize: RowTokenizer, empty: Callable[[dict[str, int]], str]
                 ) -> tuple[Any, dict[str, int]]:
    """Files' rows tokenized by `tokenize` once per node (under a node-wide lock; once for the
    cluster when the cache is on a shared filesystem), by a pool of worker processes, and cached
    as Arrow files that every later run and rank maps. (pyarrow table, counts; "cache_hit": 1
    when the cache was there.) `empty(counts)` says why no row was kept, when none was."""
    paths = [paths] if isinstance(paths, Path) else list(paths)
    cache = Path(config.cache_dir) / f"{paths[0].stem}-{fingerprint(paths, config, tokenizer, kind)}"
    lock = cache.with_suffix(".lock")

    def waiting() -> None:
        log.info("waiting for another process to tokenize %s (it holds %s)",
                 ", ".join(map(str, paths)), lock)

    with file_lock(lock, waiting):
        hit = (cache / "stats.json").exists()
        if not hit:
            shared = shared_filesystem(cache.parent)
            log.info("tokenizing %s into %s: %s", ", ".join(map(str, paths)), cache,
                     f"on a shared filesystem ({shared}): written once for the cluster" if shared
                     else "on this node's filesystem: written once per node")
            _tokenize_into(cache, paths, config, lambda rows: tokenize(rows, tokenizer, config),
                           empty)
    stats = json.loads((cache / "stats.json").read_text())
    return read_cache(cache), {**stats, "cache_hit": int(hit)}


def _tokenize_into(cache: Path, paths: list[Path], config: DataConfig,
                   tokenize: Callable[[list[tuple[str, Any]]], Any],
                   empty: Callable[[dict[str, int]], str]) -> None:
    """The cache directory written whole, or not at all (a bad row leaves nothing behind)."""
    from cpudist.runtime.hardware import physical_cores

    workers = config.tokenize_workers or physical_cores()
    # Another node on a shared filesystem may win the race: the same content either way.
    with replacing(cache) as tmp:
        tmp.mkdir(parents=True)
        job = Job(plan_shards(paths, workers), tokenize, tmp, config.max_samples)
        stats = run_job(job, workers, f"tokenizing {paths[0].name}"
                        + (f" and {len(paths) - 1} more" if len(paths) > 1 else ""))
        if not stats.get("samples"):
            raise UserError(f"{paths[0]}: the dataset is empty; it needs at least one record")
        if not any(tmp.glob("*.arrow")):
            raise UserError(empty(stats))
        (tmp / "stats.json").write_text(json.dumps(stats))


def read_cache(cache: Path) -> Any:
    """The cached Arrow files, in shard order, as one table memory-mapped from disk."""
    import pyarrow as pa

    tables = [pa.ipc.open_file(pa.memory_map(str(file))).read_all()
              for file in sorted(cache.glob("*.arrow"))]
    return pa.concat_tables(tables)


def _no_sft_samples(stats: dict[str, int], source: str, max_length: int) -> str:
    return (f"{source}: no sample has a response token within data.max_length={max_length} "
            f"({stats['truncated']} of {stats['samples']} truncated); raise data.max_length or "
            "shorten the prompts")


def load_tokenized(paths: Path | list[Path], tokenizer: Any, config: DataConfig
                   ) -> tuple[TokenizedSplit, dict]:
    """Files tokenized for supervised fine-tuning (prompt masked), cached (load_columns)."""
    first = paths if isinstance(paths, Path) else paths[0]
    table, stats = load_columns(paths, tokenizer, config, "sft", sft_chunk,
                                lambda counts: _no_sft_samples(counts, str(first),
                                                               config.max_length))
    return (TokenizedSplit(Rows.from_column(table["input_ids"]),
                           Rows.from_column(table["labels"])), stats)


class Subsettable(Protocol):
    def __len__(self) -> int: ...

    def subset(self, indices: list[int]) -> Any: ...


SplitT = TypeVar("SplitT", bound=Subsettable)


def split_validation(data: SplitT, fraction: float, seed: int) -> tuple[SplitT, SplitT]:
    """(train, validation): `fraction` of the samples held out, chosen by the seed alone."""
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    n_val = int(round(len(order) * fraction)) if fraction > 0 else 0
    if fraction > 0 and len(order) > 1:
        n_val = max(1, n_val)
    return data.subset(sorted(order[n_val:])), data.subset(sorted(order[:n_val]))


def cap_validation(val: SplitT, limit: int | None, seed: int) -> SplitT:
    """At most `limit` held-out samples, drawn by the seed alone: the same ones at every
    evaluation, in every run with this seed and data (their order kept)."""
    if limit is None or len(val) <= limit:
        return val
    return val.subset(sorted(random.Random(seed + 1).sample(range(len(val)), limit)))


def mix_sources(config: DataConfig, tokenizer: Any, seed: int
                ) -> tuple[TokenizedSplit, dict[str, Any]]:
    """data.sources tokenized one by one (each with its format and system prompt, each cached)
    and mixed in proportion to their weights: as many rows as the scarcest source allows without
    repeating one, each source's drawn with the seed. (mixture, counts; "sources": rows each.)"""
    loaded = []
    for source in config.sources:
        settings = config.model_copy(update={"path": source.path, "format": source.format,
                                             "system_prompt": source.system_prompt,
                                             "sources": []})
        paths = resolve_data_paths(source.path, config.cache_dir)
        loaded.append((", ".join(map(str, paths)), *load_tokenized(paths, tokenizer, settings)))
    total_weight = sum(source.weight for source in config.sources)
    shares = [source.weight / total_weight for source in config.sources]
    size = min(len(split) / share for (_, split, _), share in zip(loaded, shares, strict=True))
    parts, counts, stats = [], {}, {}
    for number, ((name, split, source_stats), share) in enumerate(
            zip(loaded, shares, strict=True)):
        take = min(len(split), max(1, int(size * share)))
        chosen = sorted(random.Random(seed * 1_000_003 + number).sample(range(len(split)), take))
        parts.append(split.subset(chosen))
        counts[name] = counts.get(name, 0) + take
        log.info("data source %d (%s, weight %g): %s of %s samples", number, name,
                 config.sources[number].weight, f"{take:,}", f"{len(split):,}")
        for key, value in source_stats.items():
            stats[key] = stats.get(key, 0) + value
    mixture = TokenizedSplit(Rows.concat([part.input_ids for part in parts]),
                             Rows.concat([part.labels for part in parts]))
    return mixture, {**stats, "sources": counts}


def build_datasets(config: DataConfig, tokenizer: Any, seed: int,
                   load: Callable[[list[Path], Any, DataConfig], tuple[Any, dict[str, int]]]
                   | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """(train, validation, counts for the log) of data.path (and data.val_path), the files
    tokenized by `load` (default: for supervised fine-tuning); the validation split capped at
    data.val_max_samples."""
    load = load or load_tokenized
    if config.sources:
        data, stats = mix_sources(config, tokenizer, seed)
        paths = [Path(name) for name in stats["sources"]]
    else:
        paths = resolve_data_paths(config.path, config.cache_dir)
        data, stats = load(paths, tokenizer, config)
        stats["sources"] = {", ".join(map(str, paths)): len(data)}
    if config.val_path:
        train = data
        val, val_stats = load(resolve_data_paths(config.val_path, config.cache_dir), tokenizer,
                              config)
        stats = {k: v + val_stats.get(k, 0) if isinstance(v, int) else v
                 for k, v in stats.items()}
    else:
        train, val = split_validation(data, config.val_fraction, seed)
    if len(train) == 0:
        raise UserError(f"{config.path}: the training split is empty after holding out "
                        f"data.val_fraction={config.val_fraction}; lower it or add data")
    held_out = len(val)
    val = cap_validation(val, config.val_max_samples, seed)
    if len(val) < held_out:
        log.info("validation: %d of the %d held-out samples are evaluated, the same ones each "
                 "time (data.val_max_samples=%d; null evaluates all)", len(val), held_out,
                 config.val_max_samples)
    stats.update(train=len(train), val=len(val), held_out=held_out,
                 source=", ".join(map(str, paths)))
    return train, val, stats
