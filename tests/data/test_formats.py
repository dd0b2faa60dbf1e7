"""Chat data in every shape and container cpudist.data reads gives the same tokens and labels."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import datasets
import pyarrow.parquet
import pytest
from transformers import AutoTokenizer

from cpudist.config import DataConfig
from cpudist.data.tokenize import IGNORE, TokenizedSplit, build_datasets, load_tokenized
from cpudist.errors import UserError
from tests.helpers import REPO, write_jsonl

CONVERSATIONS = [
    [("system", "You answer in one short sentence."), ("user", "What do bees make?"),
     ("assistant", "Bees make honey."), ("user", "And spiders?"),
     ("assistant", "Spiders make silk.")],
    [("user", "Who wrote Hamlet?"), ("assistant", "William Shakespeare wrote Hamlet.")],
    [("user", "天空是什么颜色的？"), ("assistant", "晴天时天空是蓝色的。")],
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def messages_rows() -> list[dict]:
    return [{"messages": [{"role": r, "content": c} for r, c in conv]} for conv in CONVERSATIONS]


def sharegpt_rows() -> list[dict]:
    return [{"conversations": [{"from": SHAREGPT_ROLE[r], "value": c} for r, c in conv]}
            for conv in CONVERSATIONS]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _load(path: Path, tokenizer, tmp_path: Path) -> TokenizedSplit:  # noqa: ANN001
    data, stats = load_tokenized(path, tokenizer, DataConfig(format="chat", max_length=512,
                                                             cache_dir=str(tmp_path / "cache")))
    assert stats["samples"] == len(CONVERSATIONS) and stats["dropped_no_labels"] == 0
    return data


@pytest.fixture
def reference(tokenizer, tmp_path: Path) -> TokenizedSplit:  # noqa: ANN001
    return _load(write_jsonl(tmp_path / "ref.jsonl", messages_rows()), tokenizer, tmp_path)


def test_reference_labels_only_the_assistant_turns(reference: TokenizedSplit, tokenizer) -> None:  # noqa: ANN001
    answers = ["".join(tokenizer.decode([t for t, lab in zip(ids, labels, strict=True)
                                         if lab != IGNORE]))
               for ids, labels in zip(reference.input_ids, reference.labels, strict=True)]
    assert answers == ["Bees make honey.<|im_end|>\nSpiders make silk.<|im_end|>\n",
                       "William Shakespeare wrote Hamlet.<|im_end|>\n",
                       "晴天时天空是蓝色的。<|im_end|>\n"]
    # The conversation's own system message replaces the template's default one.
    first = tokenizer.decode(reference.input_ids[0])
    assert "You answer in one short sentence." in first and "SmolLM" not in first


def _json_list(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return path


def _json_data(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"data": rows}, ensure_ascii=False), encoding="utf-8")
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _saved_dataset(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _saved_dataset_dict(path: Path, rows: list[dict]) -> Path:
    # The "train" split is the one read, whatever other splits the directory holds.
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:1]),
                          "train": datasets.Dataset.from_list(rows)}).save_to_disk(str(path))
    return path


WRITERS = {"jsonl": lambda p, r: write_jsonl(p.with_suffix(".jsonl"), r),
           "json-list": lambda p, r: _json_list(p.with_suffix(".json"), r),
           "json-data": lambda p, r: _json_data(p.with_suffix(".json"), r),
           "parquet": lambda p, r: _parquet(p.with_suffix(".parquet"), r),
           "datasets-dir": _saved_dataset, "datasetdict-dir": _saved_dataset_dict}


@pytest.mark.parametrize("shape", ["messages", "sharegpt"])
@pytest.mark.parametrize("container", sorted(WRITERS))
def test_every_shape_and_container_gives_the_same_tokens(
        shape: str, container: str, reference: TokenizedSplit, tokenizer, tmp_path: Path) -> None:  # noqa: ANN001
    rows = messages_rows() if shape == "messages" else sharegpt_rows()
    path = WRITERS[container](tmp_path / f"{shape}-{container}", rows)
    data = _load(path, tokenizer, tmp_path)
    assert data.input_ids == reference.input_ids
    assert data.labels == reference.labels


def test_sharegpt_turns_with_extra_fields_in_parquet(reference: TokenizedSplit, tokenizer,  # noqa: ANN001
                                                     tmp_path: Path) -> None:
    # Real ShareGPT dumps carry extra per-turn keys (e.g. weight); Arrow fills them in as null.
    rows = sharegpt_rows()
    rows[1]["conversations"][1]["weight"] = 1.0
    data = _load(_parquet(tmp_path / "extra.parquet", rows), tokenizer, tmp_path)
    assert data.input_ids == reference.input_ids and data.labels == reference.labels


def test_a_separate_validation_file_may_be_another_container(tokenizer, tmp_path: Path) -> None:  # noqa: ANN001
    train = write_jsonl(tmp_path / "train.jsonl", messages_rows() * 3)
    val = _saved_dataset(tmp_path / "val-dir", sharegpt_rows())
    config = DataConfig(path=str(train), val_path=str(val), max_length=512,
                        cache_dir=str(tmp_path / "cache"))
    train_split, val_split, stats = build_datasets(config, tokenizer, seed=0)
    assert (len(train_split), len(val_split)) == (9, 3)
    assert val_split.input_ids == train_split.input_ids[:3]


@pytest.mark.parametrize("rows, container, message", [
    ([{"conversations": [{"from": "robot", "value": "hi"}]}], "jsonl", r":1: 'conversations'"),
    ([{"conversations": [{"role": "user", "content": "hi"}]}], "parquet", r"record 1"),
    ([{"messages": "not a list"}], "json-list", "'messages' must be a list"),
    ([{"prompt": "hi", "completion": "there"}], "datasets-dir", "found \\['completion', 'prompt'\\]"),
])
def test_malformed_chat_rows_name_the_record(rows: list[dict], container: str, message: str,
                                             tokenizer, tmp_path: Path) -> None:  # noqa: ANN001
    path = WRITERS[container](tmp_path / "bad", rows)
    with pytest.raises(UserError, match=message):
        load_tokenized(path, tokenizer, DataConfig(cache_dir=str(tmp_path / "cache")))


def test_a_directory_that_is_not_a_saved_dataset(tokenizer, tmp_path: Path) -> None:  # noqa: ANN001
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="not a saved datasets directory"):
        load_tokenized(tmp_path / "folder", tokenizer, DataConfig(cache_dir=str(tmp_path / "c")))


def _cut_short(data: bytes) -> bytes:
    return data[: len(data) // 2]  # as a copy interrupted half-way


def _corrupt_pages(data: bytes) -> bytes:
    # A third of the way into ~20 kB of column pages: the footer stays whole, so only reading
    # the compressed pages finds the damage.
    middle = len(data) // 3
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 400]) + data[middle + 400:]


def _incompressible_rows() -> list[dict]:
    """Chat rows of hex digests: the pages stay large after compression."""
    def text(n: int) -> str:
        return hashlib.sha256(str(n).encode()).hexdigest() * 8

    return [{"messages": [{"role": "user", "content": text(i)},
                          {"role": "assistant", "content": text(-i)}]} for i in range(100)]


@pytest.mark.parametrize("damage", [_cut_short, _corrupt_pages, lambda _: b"id,text\n1,hello\n"],
                         ids=["cut-short", "corrupt-pages", "csv-named-parquet"])
def test_a_damaged_parquet_file_is_one_line_naming_it(damage, tokenizer,  # noqa: ANN001
                                                      tmp_path: Path) -> None:
    path = _parquet(tmp_path / "chat.parquet", _incompressible_rows())
    path.write_bytes(damage(path.read_bytes()))
    if damage is _corrupt_pages:
        assert pyarrow.parquet.read_metadata(path).num_rows == 100  # the footer is whole
    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append  # type: ignore[method-assign]
    logging.getLogger("datasets").addHandler(handler)
    try:
        with pytest.raises(UserError) as info:
            load_tokenized(path, tokenizer, DataConfig(cache_dir=str(tmp_path / "cache")))
    finally:
        logging.getLogger("datasets").removeHandler(handler)
    message = str(info.value)
    assert message.startswith(f"{path}: not a readable parquet file (") and "\n" not in message
    assert message.endswith("); copy or export it again")
    # The one line is all the user sees: datasets logs no error of its own beside it.
    assert not [r for r in said if r.levelno >= logging.WARNING], [r.getMessage() for r in said]


def test_json_that_is_not_a_list(tokenizer, tmp_path: Path) -> None:  # noqa: ANN001
    path = tmp_path / "one.json"
    path.write_text(json.dumps(messages_rows()[0]))
    with pytest.raises(UserError, match="must be a list of objects"):
        load_tokenized(path, tokenizer, DataConfig(cache_dir=str(tmp_path / "c")))


def test_chinese_quickstart_config_reads_the_chinese_corpus(tokenizer, tmp_path: Path) -> None:  # noqa: ANN001
    from cpudist.config import load_config

    config = load_config(REPO / "configs" / "chinese-quickstart.yaml",
                         [f"data.cache_dir={tmp_path / 'cache'}"])
    assert config.output.dir != load_config(None).output.dir  # never mixes with the quickstart
    train, val, stats = build_datasets(config.data, tokenizer, config.train.seed)
    assert len(train) + len(val) == stats["samples"] - stats["dropped_no_labels"] > 100
    assert len(val) == round(config.data.val_fraction * (len(train) + len(val)))
    answers = [tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE])
               for ids, labels in zip(val.input_ids, val.labels, strict=True)]
    chinese = sum(any("\u4e00" <= ch <= "\u9fff" for ch in answer) for answer in answers)
    assert chinese > 0.9 * len(answers)
