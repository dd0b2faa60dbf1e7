"""Reading a dataset: a .jsonl/.json/.parquet file, a saved datasets directory, or a built-in corpus."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cpudist.errors import UserError
from cpudist.files import file_lock, replacing

BUILTIN_CORPORA = {"chatterbot:english": "english", "chatterbot:chinese": "chinese"}
# The corpus's questions labelled by the topic file they come from (data.format=classification).
BUILTIN_TOPICS = {"chatterbot-topics:english": "english", "chatterbot-topics:chinese": "chinese"}
# Preference pairs made from a chatterbot corpus (data.format=preference): see _chatterbot_pairs.
BUILTIN_PAIRS = {"chatterbot-pairs:english": "english", "chatterbot-pairs:chinese": "chinese"}
BUILTIN_ALL = {**BUILTIN_CORPORA, **BUILTIN_TOPICS, **BUILTIN_PAIRS}


def _chatterbot_folder(language: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec("chatterbot_corpus")  # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        raise UserError("data.path=chatterbot:* needs the chatterbot-corpus package: "
                        "pip install --no-deps 'chatterbot-corpus==1.3.3'")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / language


def _chatterbot_to_jsonl(language: str, target: Path) -> None:
    """Write the chatterbot-corpus QA pairs of one language as chat-format JSON lines."""
    import yaml

    folder = _chatterbot_folder(language)
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
    with replacing(target) as tmp:  # unique per host: nodes may share a filesystem
        tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows),
                       encoding="utf-8")


def _chatterbot_topics(language: str, target: Path) -> None:
    """Write each conversation's opening question with its topic (the corpus file it is in:
    ai, food, sports, ...) as classification JSON lines. A question is written once per topic
    (the corpus repeats some, e.g. 1,050 tech-support conversations open with 10 questions),
    so that no held-out question was also trained on."""
    import yaml

    seen: set[tuple[str, str]] = set()
    rows = []
    for file in sorted(_chatterbot_folder(language).glob("*.yml")):
        doc = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
        for conversation in doc.get("conversations", []):
            if isinstance(conversation, list) and conversation and str(conversation[0]).strip():
                question = str(conversation[0]).strip()
                if (question, file.stem) not in seen:
                    seen.add((question, file.stem))
                    rows.append({"text": question, "label": file.stem})
    with replacing(target) as tmp:
        tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows),
                       encoding="utf-8")


def _chatterbot_pairs(corpus: Path, target: Path) -> None:
    """Preference pairs from a chatterbot corpus file: each question, its own answer as chosen and
    an answer to another question as rejected (drawn with a fixed seed among answers that differ
    from the question's own). Honest preferences, if easy ones: the rejected answer is fluent but
    off-topic."""
    import random

    rows = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
    answers = [row["messages"][1]["content"] for row in rows]
    rng = random.Random(0)
    pairs = []
    for row, chosen in zip(rows, answers, strict=True):
        rejected = chosen
        while rejected == chosen:
            rejected = answers[rng.randrange(len(answers))]
        pairs.append({"prompt": [row["messages"][0]], "chosen": chosen, "rejected": rejected})
    with replacing(target) as tmp:
        tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in pairs),
                       encoding="utf-8")


def resolve_data_path(path: str, cache_dir: str) -> Path:
    if path in BUILTIN_TOPICS:
        target = Path(cache_dir) / f"chatterbot-topics-{BUILTIN_TOPICS[path]}.jsonl"
        with file_lock(target.with_suffix(".lock")):
            if not target.exists():
                _chatterbot_topics(BUILTIN_TOPICS[path], target)
        return target
    if path in BUILTIN_PAIRS:
        language = BUILTIN_PAIRS[path]
        corpus = resolve_data_path(f"chatterbot:{language}", cache_dir)
        target = Path(cache_dir) / f"chatterbot-pairs-{language}.jsonl"
        with file_lock(target.with_suffix(".lock")):
            if not target.exists():
                _chatterbot_pairs(corpus, target)
        return target
    if path in BUILTIN_CORPORA:
        target = Path(cache_dir) / f"chatterbot-{BUILTIN_CORPORA[path]}.jsonl"
        with file_lock(target.with_suffix(".lock")):
            if not target.exists():
                _chatterbot_to_jsonl(BUILTIN_CORPORA[path], target)
        return target
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise UserError(f"data file {path} not found (data.path); give a .jsonl, .json or .parquet "
                        "file, a saved datasets directory, chatterbot:english, (topic "
                        "classification) chatterbot-topics:english or (preference pairs) "
                        "chatterbot-pairs:english")
    return resolved


def resolve_data_paths(path: str | list[str], cache_dir: str) -> list[Path]:
    """The files of data.path: one, a built-in corpus, a glob (data/*.jsonl, sorted), or a list
    of these, in order."""
    import glob

    paths: list[Path] = []
    for item in [path] if isinstance(path, str) else path:
        if any(char in item for char in "*?[") and item not in BUILTIN_ALL:
            matches = sorted(glob.glob(str(Path(item).expanduser())))
            if not matches:
                raise UserError(f"data.path {item}: no file matches that pattern")
            paths += [Path(match) for match in matches]
        else:
            paths.append(resolve_data_path(item, cache_dir))
    if not paths:
        raise UserError("data.path is an empty list; give at least one file")
    return paths


def read_records(path: Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl / .json / .parquet file or a saved datasets directory, all in memory (for
    small files such as `cpudist predict`'s; training reads them as a stream: cpudist.data.shards)."""
    from cpudist.data.shards import plan_shards, shard_rows

    return [row for shard in plan_shards([path], 1) for _, row in shard_rows(shard)]
