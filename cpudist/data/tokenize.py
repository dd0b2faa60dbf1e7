"""Tokenizing once, with prompt masking, cached on disk; and the train/validation split.

Token ids are cached (keyed by the file, format, tokenizer and max_length) so every later run and
every rank reads them instead of tokenizing again.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cpudist.config import DataConfig
from cpudist.data.formats import Messages, to_sample
from cpudist.data.read import read_records, resolve_data_path
from cpudist.errors import UserError
from cpudist.files import file_lock, replacing

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


def _tokenize_conversation(tokenizer: Any, messages: Messages) -> tuple[list, list, bool]:
    """tokenize_conversation's ids and labels, and whether only the last answer carries loss."""
    if tokenizer.chat_template is None:
        prompt = ALPACA_TEMPLATE.format(
            instruction="\n\n".join(m["content"] for m in messages if m["role"] != "assistant"))
        answer = "\n".join(m["content"] for m in messages if m["role"] == "assistant")
        ids, labels = label_spans(tokenizer, prompt + answer, [(len(prompt), len(prompt + answer))],
                                   add_special_tokens=True)
        return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id], False

    def render(upto: int, generation_prompt: bool) -> str:
        return render_chat(tokenizer, messages[:upto], generation_prompt)

    answers = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
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
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    labels = [token if end > start and any(start < stop and end > begin for begin, stop in spans)
              else IGNORE
              for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)]
    return list(encoded["input_ids"]), labels


@dataclass
class TokenizedSplit:
    input_ids: list[list[int]]
    labels: list[list[int]]

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]

    def label_count(self, index: int) -> int:
        # Labels are shifted by one inside the loss: the first position never counts.
        return sum(1 for label in self.labels[index][1:] if label != IGNORE)

    def subset(self, indices: list[int]) -> TokenizedSplit:
        return TokenizedSplit([self.input_ids[i] for i in indices],
                              [self.labels[i] for i in indices])


@dataclass
class TokenizeStats:
    samples: int
    truncated: int
    dropped_no_labels: int
    # Conversations whose template rewrites earlier turns: only their last answer carries loss.
    last_answer_only: int


def tokenize_records(records: list[dict[str, Any]], tokenizer: Any, config: DataConfig,
                     source: str) -> tuple[TokenizedSplit, TokenizeStats]:
    input_ids: list[list[int]] = []
    labels: list[list[int]] = []
    truncated = dropped = last_only = 0
    for number, row in enumerate(records, start=1):
        where = f"{source}:{number}" if source.endswith(".jsonl") else f"{source} (record {number})"
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
    return TokenizedSplit(input_ids, labels), TokenizeStats(len(records), truncated, dropped, last_only)


_PROBE: Messages = [{"role": "user", "content": "Hello, what is 2 + 2?"},
                    {"role": "assistant", "content": " 4.\nDone."}]


def fingerprint(path: Path, config: DataConfig, tokenizer: Any, kind: str) -> str:
    """The cache key of a data file tokenized for `kind` (an objective's rows: sft, ...): the
    file's bytes (a directory's names, sizes and times), what the tokenizer does, the settings."""
    digest = hashlib.sha256()
    if path.is_dir():
        for file in sorted(path.rglob("*")):
            if file.is_file():
                digest.update(f"{file.name}:{file.stat().st_size}:{file.stat().st_mtime_ns}".encode())
    else:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())[:2000]) + str(len(tokenizer))
    # What the tokenizer does, not only what it holds: the same vocabulary and template can
    # tokenize differently (a BOS added or not, another normalizer). A cache keyed on vocabulary
    # alone kept serving rows that started with a doubled <|im_start|> after such a change.
    behaviour: list[Any] = [tokenizer(_PROBE[0]["content"], add_special_tokens=True)["input_ids"]]
    if tokenizer.chat_template is not None:
        behaviour.append(tokenize_conversation(tokenizer, _PROBE))
    settings = [kind, config.format, config.max_length, config.system_prompt, config.max_samples,
                tokenizer.chat_template or "", vocab, behaviour, "v5"]
    digest.update(json.dumps(settings).encode())
    return digest.hexdigest()[:16]


# Rows of a file as an objective tokenizes them: (records, tokenizer, data settings, the file's
# name for errors) -> (columns of equal length, counts for the log: "samples", ...). It raises a
# UserError naming the file when nothing usable is left.
RowTokenizer = Callable[[list[dict[str, Any]], Any, DataConfig, str],
                        tuple[dict[str, list[Any]], dict[str, int]]]


def load_columns(path: Path, tokenizer: Any, config: DataConfig, kind: str,
                 tokenize: RowTokenizer) -> tuple[Any, dict[str, int]]:
    """A file's rows tokenized once per node by `tokenize` (under a node-wide lock) and cached on
    disk as a datasets table; every later run and rank reads the cache. (table, counts)."""
    import datasets

    cache = Path(config.cache_dir) / f"{path.stem}-{fingerprint(path, config, tokenizer, kind)}"
    with file_lock(cache.with_suffix(".lock")):
        if not (cache / "stats.json").exists():
            records = read_records(path)
            if config.max_samples is not None:
                records = records[: config.max_samples]
            if not records:
                raise UserError(f"{path}: the dataset is empty; it needs at least one record")
            columns, stats = tokenize(records, tokenizer, config, str(path))
            # Another node on a shared filesystem may win the race: the same content either way.
            with replacing(cache) as tmp:
                datasets.Dataset.from_dict(columns).save_to_disk(str(tmp))
                (tmp / "stats.json").write_text(json.dumps(stats))
    return datasets.load_from_disk(str(cache)), json.loads((cache / "stats.json").read_text())


def _sft_columns(records: list[dict[str, Any]], tokenizer: Any, config: DataConfig, source: str
                 ) -> tuple[dict[str, list[Any]], dict[str, int]]:
    split, stats = tokenize_records(records, tokenizer, config, source)
    if len(split) == 0:
        raise UserError(f"{source}: no sample has a response token within data.max_length="
                        f"{config.max_length} ({stats.truncated} of {stats.samples} truncated); "
                        "raise data.max_length or shorten the prompts")
    return {"input_ids": split.input_ids, "labels": split.labels}, dict(stats.__dict__)


def load_tokenized(path: Path, tokenizer: Any, config: DataConfig) -> tuple[TokenizedSplit, dict]:
    """A file tokenized for supervised fine-tuning (prompt masked), cached (load_columns)."""
    table, stats = load_columns(path, tokenizer, config, "sft", _sft_columns)
    return TokenizedSplit(table["input_ids"], table["labels"]), stats


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


def build_datasets(config: DataConfig, tokenizer: Any, seed: int,
                   load: Callable[[Path, Any, DataConfig], tuple[Any, dict[str, int]]] | None = None
                   ) -> tuple[Any, Any, dict[str, Any]]:
    """(train, validation, counts for the log) of data.path (and data.val_path), each file
    tokenized by `load` (default: for supervised fine-tuning)."""
    load = load or load_tokenized
    path = resolve_data_path(config.path, config.cache_dir)
    data, stats = load(path, tokenizer, config)
    if config.val_path:
        train = data
        val, val_stats = load(resolve_data_path(config.val_path, config.cache_dir), tokenizer,
                              config)
        stats = {k: stats[k] + val_stats[k] for k in stats}
    else:
        train, val = split_validation(data, config.val_fraction, seed)
    if len(train) == 0:
        raise UserError(f"{config.path}: the training split is empty after holding out "
                        f"data.val_fraction={config.val_fraction}; lower it or add data")
    stats.update(train=len(train), val=len(val), source=str(path))
    return train, val, stats

