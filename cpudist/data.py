"""Datasets: read, format (alpaca / chat / text), tokenize once with prompt masking, batch per rank.

Token ids are cached on disk (keyed by the file, format, tokenizer and max_length) so every later run
and every rank reads them instead of tokenizing again. Batches are cut from one global order that
depends only on the seed and epoch, so any world size sees the same global batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cpudist.config import DataConfig
from cpudist.errors import UserError
from cpudist.jsonl import read_jsonl

log = logging.getLogger("cpudist")

IGNORE = -100
BUILTIN_CORPORA = {"chatterbot:english": "english", "chatterbot:chinese": "chinese"}


# --------------------------------------------------------------------------- reading


def _chatterbot_to_jsonl(language: str, target: Path) -> None:
    """Write the chatterbot-corpus QA pairs of one language as chat-format JSON lines."""
    import importlib.util

    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")  # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        raise UserError("data.path=chatterbot:* needs the chatterbot-corpus package: "
                        "pip install --no-deps 'chatterbot-corpus==1.3.3'")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / language
    seen: set[tuple[str, str]] = set()
    rows = []
    for file in sorted(folder.glob("*.yml")):
        doc = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
        for conversation in doc.get("conversations", []):
            if not isinstance(conversation, list):
                continue
            turns = [str(turn).strip() for turn in conversation]
            for question, answer in zip(turns[:-1], turns[1:], strict=False):
                if question and answer and (question, answer) not in seen:
                    seen.add((question, answer))
                    rows.append({"messages": [{"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}]})
    # Unique per process: nodes sharing a filesystem each hold only their own node's lock.
    tmp = target.with_name(f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows),
                   encoding="utf-8")
    tmp.replace(target)


def resolve_data_path(path: str, cache_dir: str) -> Path:
    if path in BUILTIN_CORPORA:
        from cpudist.model import file_lock

        target = Path(cache_dir) / f"chatterbot-{BUILTIN_CORPORA[path]}.jsonl"
        with file_lock(target.with_suffix(".lock")):
            if not target.exists():
                _chatterbot_to_jsonl(BUILTIN_CORPORA[path], target)
        return target
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise UserError(f"data file {path} not found (data.path); give a .jsonl, .json or .parquet "
                        "file, a saved datasets directory, or chatterbot:english")
    return resolved


def read_records(path: Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl / .json / .parquet file or a saved datasets directory."""
    import datasets

    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as exc:
            raise UserError(f"{path}: not a saved datasets directory ({exc})") from exc
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        return list(loaded)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return read_jsonl(path)
    if suffix == ".json":
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
    if suffix == ".parquet":
        return list(datasets.Dataset.from_parquet(str(path)))
    raise UserError(f"{path}: unsupported data file type '{suffix}'; use .jsonl, .json, .parquet "
                    "or a saved datasets directory")


# --------------------------------------------------------------------------- formatting

ALPACA_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"


def _messages(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """The conversation of a chat row: 'messages' (role/content) or ShareGPT 'conversations'."""
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise UserError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    if "conversations" in row:
        roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "system": "system", "model": "assistant"}
        turns = row["conversations"]
        try:
            return [{"role": roles[t["from"]], "content": str(t["value"])} for t in turns]
        except (KeyError, TypeError):
            raise UserError(f"{where}: 'conversations' must be a list of {{from, value}} objects "
                            f"with from in {sorted(roles)}") from None
    raise UserError(f"{where}: data.format=chat needs a 'messages' (or ShareGPT 'conversations') "
                    f"field; found {sorted(row)}")


def to_messages(row: dict[str, Any], fmt: str, where: str, system: str | None) -> list[dict] | None:
    """The row as a conversation (None for plain text rows)."""
    if fmt == "text":
        if "text" not in row:
            raise UserError(f"{where}: data.format=text needs a 'text' field; found {sorted(row)}")
        return None
    if fmt == "alpaca":
        missing = [key for key in ("instruction", "output") if key not in row]
        if missing:
            raise UserError(f"{where}: data.format=alpaca needs fields instruction and output "
                            f"(input optional); missing {', '.join(missing)}")
        prompt = str(row["instruction"])
        if row.get("input"):
            prompt += "\n\n" + str(row["input"])
        messages = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": str(row["output"])}]
    else:
        messages = _messages(row, where)
    if system and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list, list]:
    """Token ids and labels; only assistant turns (and their end-of-turn token) carry loss."""
    if tokenizer.chat_template is None:
        prompt = "\n\n".join(m["content"] for m in messages if m["role"] != "assistant")
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        prompt_ids = tokenizer(ALPACA_TEMPLATE.format(instruction=prompt),
                               add_special_tokens=True)["input_ids"]
        answer_ids = tokenizer("\n".join(answers), add_special_tokens=False)["input_ids"]
        answer_ids = answer_ids + [tokenizer.eos_token_id]
        return prompt_ids + answer_ids, [IGNORE] * len(prompt_ids) + answer_ids

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False,
                                             add_generation_prompt=generation_prompt)

    ids: list[int] = []
    labels: list[int] = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(index, generation_prompt=True)
        after = render(index + 1, generation_prompt=False)
        if not before.startswith(done) or not after.startswith(before):
            raise UserError("the tokenizer's chat template does not render conversations as "
                            "growing prefixes; use data.format=text or a standard chat template")
        prompt_ids = tokenizer(before[len(done):], add_special_tokens=not done)["input_ids"]
        answer_ids = tokenizer(after[len(before):], add_special_tokens=False)["input_ids"]
        ids += prompt_ids + answer_ids
        labels += [IGNORE] * len(prompt_ids) + answer_ids
        done = after
    return ids, labels


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


@dataclass
class TokenizeStats:
    samples: int
    truncated: int
    dropped_no_labels: int


def tokenize_records(records: list[dict[str, Any]], tokenizer: Any, config: DataConfig,
                     source: str) -> tuple[TokenizedSplit, TokenizeStats]:
    input_ids: list[list[int]] = []
    labels: list[list[int]] = []
    truncated = dropped = 0
    for number, row in enumerate(records, start=1):
        where = f"{source}:{number}" if source.endswith(".jsonl") else f"{source} (record {number})"
        if not isinstance(row, dict):
            raise UserError(f"{where}: each record must be an object")
        messages = to_messages(row, config.format, where, config.system_prompt)
        if messages is None:
            ids = tokenizer(str(row["text"]), add_special_tokens=True)["input_ids"]
            ids = ids + [tokenizer.eos_token_id]
            row_labels = list(ids)
        else:
            ids, row_labels = tokenize_conversation(tokenizer, messages)
        if len(ids) > config.max_length:
            truncated += 1
            ids, row_labels = ids[: config.max_length], row_labels[: config.max_length]
        if all(label == IGNORE for label in row_labels[1:]):
            dropped += 1
            continue
        input_ids.append(ids)
        labels.append(row_labels)
    return TokenizedSplit(input_ids, labels), TokenizeStats(len(records), truncated, dropped)


# --------------------------------------------------------------------------- cache and split


def _fingerprint(path: Path, config: DataConfig, tokenizer: Any) -> str:
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
    settings = [config.format, config.max_length, config.system_prompt, config.max_samples,
                tokenizer.chat_template or "", vocab, "v1"]
    digest.update(json.dumps(settings).encode())
    return digest.hexdigest()[:16]


def load_tokenized(path: Path, tokenizer: Any, config: DataConfig) -> tuple[TokenizedSplit, dict]:
    """Tokenize a file once (under a node-wide lock) and reuse the cached token ids afterwards."""
    import datasets

    from cpudist.model import file_lock

    cache = Path(config.cache_dir) / f"{path.stem}-{_fingerprint(path, config, tokenizer)}"
    with file_lock(cache.with_suffix(".lock")):
        if not (cache / "stats.json").exists():
            records = read_records(path)
            if config.max_samples is not None:
                records = records[: config.max_samples]
            if not records:
                raise UserError(f"{path}: the dataset is empty; it needs at least one record")
            split, stats = tokenize_records(records, tokenizer, config, str(path))
            if len(split) == 0:
                raise UserError(
                    f"{path}: no sample has a response token within data.max_length="
                    f"{config.max_length} ({stats.truncated} of {stats.samples} truncated); "
                    "raise data.max_length or shorten the prompts"
                )
            tmp = cache.with_name(f".{cache.name}.tmp-{socket.gethostname()}-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            datasets.Dataset.from_dict({"input_ids": split.input_ids, "labels": split.labels}
                                       ).save_to_disk(str(tmp))
            (tmp / "stats.json").write_text(json.dumps(stats.__dict__))
            if (cache / "stats.json").exists():  # another node on a shared filesystem won the race
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(cache, ignore_errors=True)  # a half-written leftover
                tmp.rename(cache)
    table = datasets.load_from_disk(str(cache))
    stats = json.loads((cache / "stats.json").read_text())
    return TokenizedSplit(table["input_ids"], table["labels"]), stats


def split_validation(data: TokenizedSplit, fraction: float, seed: int
                     ) -> tuple[TokenizedSplit, TokenizedSplit]:
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    n_val = int(round(len(order) * fraction)) if fraction > 0 else 0
    if fraction > 0 and len(order) > 1:
        n_val = max(1, n_val)
    val, train = sorted(order[:n_val]), sorted(order[n_val:])

    def pick(indices: list[int]) -> TokenizedSplit:
        return TokenizedSplit([data.input_ids[i] for i in indices], [data.labels[i] for i in indices])

    return pick(train), pick(val)


def build_datasets(config: DataConfig, tokenizer: Any, seed: int
                   ) -> tuple[TokenizedSplit, TokenizedSplit, dict[str, Any]]:
    """(train, validation, stats for the log)."""
    path = resolve_data_path(config.path, config.cache_dir)
    data, stats = load_tokenized(path, tokenizer, config)
    if config.val_path:
        train = data
        val, val_stats = load_tokenized(resolve_data_path(config.val_path, config.cache_dir),
                                        tokenizer, config)
        stats = {k: stats[k] + val_stats[k] for k in stats}
    else:
        train, val = split_validation(data, config.val_fraction, seed)
    if len(train) == 0:
        raise UserError(f"{config.path}: the training split is empty after holding out "
                        f"data.val_fraction={config.val_fraction}; lower it or add data")
    stats.update(train=len(train), val=len(val), source=str(path))
    return train, val, stats


# --------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None

    @property
    def label_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE).sum())

    @property
    def tokens(self) -> int:
        # Packed rows hold segment ids (1, 2, ...) in attention_mask, so count, never sum.
        return int((self.attention_mask > 0).sum())

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        kwargs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                  "labels": self.labels}
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids
        return kwargs


def collate(data: TokenizedSplit, indices: list[int], pad_id: int) -> Batch:
    """Right-padded batch of the given samples."""
    width = max(len(data.input_ids[i]) for i in indices)
    ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    labels = torch.full((len(indices), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(indices), width), dtype=torch.long)
    for row, index in enumerate(indices):
        length = len(data.input_ids[index])
        ids[row, :length] = torch.tensor(data.input_ids[index])
        labels[row, :length] = torch.tensor(data.labels[index])
        mask[row, :length] = 1
    return Batch(ids, mask, labels)


def pack(data: TokenizedSplit, indices: list[int], pad_id: int, max_length: int) -> Batch:
    """Several samples per row (first fit, in order); position ids restart at every sample.

    Attention stays inside each sample: the model sees a 4D block-diagonal causal mask built from
    the position ids (see loss.packed_attention_mask).
    """
    rows: list[list[int]] = []
    fill: list[int] = []
    for index in indices:
        length = len(data.input_ids[index])
        for row, used in enumerate(fill):
            if used + length <= max_length:
                rows[row].append(index)
                fill[row] += length
                break
        else:
            rows.append([index])
            fill.append(length)
    width = max(fill)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for row, members in enumerate(rows):
        offset = 0
        for segment, index in enumerate(members, start=1):
            length = len(data.input_ids[index])
            ids[row, offset : offset + length] = torch.tensor(data.input_ids[index])
            sample_labels = torch.tensor(data.labels[index])
            sample_labels[0] = IGNORE  # never predict a sample's first token from the previous one
            labels[row, offset : offset + length] = sample_labels
            mask[row, offset : offset + length] = segment  # segment ids; 0 = padding
            positions[row, offset : offset + length] = torch.arange(length)
            offset += length
    return Batch(ids, mask, labels, positions)


class GlobalBatches:
    """One global order of micro-batches per epoch, cut into each rank's share.

    Global micro-batch g holds batch_size * world samples; rank r takes the r-th slice. Every rank
    gets the same number of steps (the tail that does not fill a whole optimizer step is dropped).
    """

    def __init__(self, data: TokenizedSplit, batch_size: int, grad_accum: int, world: int,
                 seed: int, group_by_length: bool) -> None:
        self.data = data
        self.batch_size = batch_size
        self.grad_accum = grad_accum
        self.world = world
        self.seed = seed
        self.group_by_length = group_by_length
        self.global_micro = batch_size * world
        self.steps_per_epoch = len(data) // (self.global_micro * grad_accum)
        if self.steps_per_epoch == 0:
            raise UserError(
                f"the training split has {len(data)} samples, fewer than one global batch "
                f"(train.batch_size={batch_size} x train.grad_accum={grad_accum} x {world} ranks); "
                "lower the batch size or add data"
            )

    def epoch_order(self, epoch: int) -> list[list[int]]:
        """Global micro-batches (lists of sample indices) of an epoch, deterministic in seed."""
        rng = random.Random(self.seed * 100_003 + epoch)
        order = list(range(len(self.data)))
        rng.shuffle(order)
        usable = self.steps_per_epoch * self.grad_accum * self.global_micro
        order = order[:usable]
        batches = [order[i : i + self.global_micro] for i in range(0, usable, self.global_micro)]
        if self.group_by_length:
            # Sort within windows of 64 micro-batches by length, then shuffle the batches: similar
            # lengths share a batch (little padding) while the order stays random.
            lengths = self.data.lengths()
            window = 64 * self.global_micro
            grouped: list[int] = []
            for start in range(0, usable, window):
                grouped += sorted(order[start : start + window], key=lambda i: -lengths[i])
            batches = [grouped[i : i + self.global_micro] for i in range(0, usable, self.global_micro)]
            rng.shuffle(batches)
        return batches

    def step_batches(self, epoch: int, step_in_epoch: int, rank: int) -> list[list[int]]:
        """This rank's sample indices for each micro-step of one optimizer step."""
        batches = self.epoch_order(epoch)
        first = step_in_epoch * self.grad_accum
        lo, hi = rank * self.batch_size, (rank + 1) * self.batch_size
        return [batches[first + k][lo:hi] for k in range(self.grad_accum)]

    def global_step_batches(self, epoch: int, step_in_epoch: int) -> list[list[int]]:
        batches = self.epoch_order(epoch)
        first = step_in_epoch * self.grad_accum
        return batches[first : first + self.grad_accum]


def eval_batches(data: TokenizedSplit, batch_size: int, rank: int, world: int,
                 limit: int | None) -> Iterator[list[int]]:
    """This rank's share of the validation set (strided, so every sample is seen once overall)."""
    order = sorted(range(len(data)), key=lambda i: len(data.input_ids[i]))
    mine = order[rank::world]
    count = math.ceil(len(mine) / batch_size)
    if limit is not None:
        count = min(count, limit)
    for b in range(count):
        yield mine[b * batch_size : (b + 1) * batch_size]
