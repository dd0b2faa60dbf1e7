"""Data at scale: files read in shards by a pool of workers give the tokens one process gives;
a bad row stops every worker and leaves no cache; validation is a fixed, capped subset."""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import threading
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cpudist.config import DataConfig, load_config
from cpudist.data import shards
from cpudist.data.read import resolve_data_paths
from cpudist.data.tokenize import build_datasets, load_tokenized
from cpudist.errors import UserError
from cpudist.files import file_lock, shared_filesystem
from tests.helpers import write_jsonl


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def rows(count: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}." + " Yes." * (i % 7)}]}
            for i in range(count)]


@pytest.fixture
def small_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards of a few hundred bytes and chunks of a few rows: a small file makes many."""
    monkeypatch.setattr(shards, "MIN_SHARD_BYTES", 600)
    monkeypatch.setattr(shards, "CHUNK_ROWS", 3)
    monkeypatch.setattr(shards, "SHARD_ROWS", 7)


def _config(tmp_path: Path, name: str, **settings: object) -> DataConfig:
    return DataConfig(max_length=64, cache_dir=str(tmp_path / name), **settings)


def test_two_workers_give_the_tokens_of_one_in_the_same_order(
        small_shards: None, tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture,  # noqa: ANN001
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", rows(120))
    assert len(shards.plan_shards([path], 2)) > 4
    monkeypatch.setattr(shards, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="cpudist"):
        one, one_stats = load_tokenized(path, tokenizer, _config(tmp_path, "one", tokenize_workers=1))
        two, two_stats = load_tokenized(path, tokenizer, _config(tmp_path, "two", tokenize_workers=2))
    assert len(one) == len(two) == 120
    assert one.input_ids == two.input_ids and one.labels == two.labels
    assert {**one_stats, "cache_hit": 0} == {**two_stats, "cache_hit": 0}
    assert len(list((tmp_path / "two").glob("*/*.arrow"))) > 4  # the pool wrote several shards
    said = caplog.text
    assert "rows/s" in said and "eta" in said and "on this node's filesystem" in said
    again, stats = load_tokenized(path, tokenizer, _config(tmp_path, "two", tokenize_workers=2))
    assert stats["cache_hit"] == 1 and again.input_ids == one.input_ids


@pytest.mark.parametrize("where", ["near-the-end", "middle-shard"])
def test_a_bad_row_stops_every_worker_and_leaves_no_cache(
        where: str, small_shards: None, tokenizer, tmp_path: Path) -> None:  # noqa: ANN001
    good = rows(150)
    lines = [json.dumps(row) for row in good]
    bad_line = len(lines) - 1 if where == "near-the-end" else len(lines) // 2
    lines[bad_line - 1] = '{"messages": [{"role": "user", "content": "cut'
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert len(shards.plan_shards([path], 2)) > 4
    config = _config(tmp_path, "cache", tokenize_workers=2)
    with pytest.raises(UserError, match=rf"^{path}:{bad_line}: malformed JSON"):
        load_tokenized(path, tokenizer, config)
    assert multiprocessing.active_children() == []
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [next(
        (tmp_path / "cache").glob("*.lock")).name]  # the lock only: no cache, no temporary
    # A row that parses but does not fit the format is named the same way, from a worker.
    lines[bad_line - 1] = json.dumps({"prompt": "no messages here"})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=rf"^{path}:{bad_line}: data.format=chat needs"):
        load_tokenized(path, tokenizer, config)
    assert multiprocessing.active_children() == []


def test_several_files_and_a_glob_read_in_order(small_shards: None, tokenizer,  # noqa: ANN001
                                                tmp_path: Path) -> None:
    import datasets

    first = write_jsonl(tmp_path / "a-1.jsonl", rows(20))
    datasets.Dataset.from_list(rows(30)[20:]).to_parquet(str(tmp_path / "a-2.parquet"))
    whole = write_jsonl(tmp_path / "whole.jsonl", rows(30))
    listed = [str(first), str(tmp_path / "a-2.parquet")]
    assert resolve_data_paths(str(tmp_path / "a-*"), "unused") == [Path(p) for p in listed]
    reference, _ = load_tokenized(whole, tokenizer, _config(tmp_path, "ref"))
    for path in (listed, str(tmp_path / "a-*")):
        train, val, stats = build_datasets(
            _config(tmp_path, "both", path=path, val_fraction=0.0, tokenize_workers=2),
            tokenizer, seed=0)
        assert train.input_ids == reference.input_ids and len(val) == 0
        assert stats["source"] == ", ".join(listed)
    with pytest.raises(UserError, match="no file matches"):
        resolve_data_paths(str(tmp_path / "nothing-*.jsonl"), "unused")


def test_validation_is_a_capped_subset_fixed_by_the_seed(tokenizer, tmp_path: Path,  # noqa: ANN001
                                                         caplog: pytest.LogCaptureFixture) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", rows(60))

    def val_ids(seed: int, cap: int | None) -> list[list[int]]:
        config = _config(tmp_path, "cache", path=str(path), val_fraction=0.5,
                         val_max_samples=cap)
        return list(build_datasets(config, tokenizer, seed)[1].input_ids)

    with caplog.at_level(logging.INFO, logger="cpudist"):
        capped = val_ids(1, 8)
    assert "8 of the 30 held-out samples are evaluated" in caplog.text
    assert len(capped) == 8 and capped == val_ids(1, 8)
    assert all(row in val_ids(1, None) for row in capped)  # drawn from the held-out samples
    assert capped != val_ids(2, 8)
    assert len(val_ids(1, 100)) == 30


def test_a_waiting_process_says_so(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    said: list[str] = []
    with open(lock, "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: file_lock(lock, lambda: said.append("waiting"))
                                  .__enter__())
        waiter.start()
        waiter.join(0.5)
        assert said == ["waiting"] and waiter.is_alive()
        fcntl.flock(holder, fcntl.LOCK_UN)
    waiter.join(5)
    assert not waiter.is_alive()


def test_a_network_filesystem_is_told_apart(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\nserver:/export /shared nfs4 rw 0 0\n")
    assert shared_filesystem(Path("/shared/cache/data"), str(mounts)) == "nfs4"
    assert shared_filesystem(Path("/sharedx/cache"), str(mounts)) is None
    assert shared_filesystem(Path("/home/me"), str(mounts)) is None


def test_a_mixture_takes_each_source_by_its_weight(tokenizer, tmp_path: Path,  # noqa: ANN001
                                                   caplog: pytest.LogCaptureFixture) -> None:
    chat = write_jsonl(tmp_path / "chat.jsonl", rows(40))
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": f"Say {i}", "output": f"{i}."} for i in range(40)])

    def mixture(seed: int) -> tuple[list[str], dict]:
        config = _config(tmp_path, "cache", val_fraction=0.0, sources=[
            {"path": str(chat), "format": "chat", "weight": 3.0, "system_prompt": "Be brief."},
            {"path": str(alpaca), "format": "alpaca", "weight": 1.0}])
        train, _, stats = build_datasets(config, tokenizer, seed)
        return [tokenizer.decode(ids) for ids in train.input_ids], stats

    with caplog.at_level(logging.INFO, logger="cpudist"):
        texts, stats = mixture(seed=1)
    # 40 chat rows are 3/4 of a mixture of 53: 13 alpaca rows of 40 join them.
    assert stats["sources"] == {str(chat): 40, str(alpaca): 13}
    assert "data source 1 (" in caplog.text and "13 of 40 samples" in caplog.text
    assert sum("Be brief." in text for text in texts) == 40
    assert sum("### Instruction" in text or "Say " in text for text in texts) == 13
    assert mixture(seed=1)[0] == texts and mixture(seed=2)[0] != texts
    with pytest.raises(UserError, match=r"data.sources\[0\] format=preference"):
        load_config(None, [f"data.sources=[{{path: {chat}, format: preference}}]"])
