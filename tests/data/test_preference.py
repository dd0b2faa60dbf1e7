"""The preference format and its tokenization: rows read as strings or chat messages, bad rows
refused with file:line, truncation keeping the prompt's end and the answers' starts, drops counted,
and a format that does not fit the objective refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpudist.config import DataConfig
from cpudist.data.formats import PreferencePair, preference
from cpudist.data.preference import load_pairs, pair_columns, tokenize_pair, truncate_pair
from cpudist.data.tokenize import places
from cpudist.errors import UserError
from tests.helpers import cli_in_process, tiny_overrides, write_jsonl


def test_rows_read_as_strings_or_messages() -> None:
    assert preference({"prompt": "Q?", "chosen": "A", "rejected": "B"}, "f:1") == \
        PreferencePair("Q?", "A", "B")
    user = [{"role": "user", "content": "Q?"}]
    as_trl = {"prompt": user, "chosen": [{"role": "assistant", "content": "A"}],
              "rejected": [{"role": "assistant", "content": "B"}]}
    assert preference(as_trl, "f:1") == PreferencePair(user, "A", "B")
    # A string prompt with answers as messages is a user turn.
    mixed = {**as_trl, "prompt": "Q?"}
    assert preference(mixed, "f:1") == PreferencePair(user, "A", "B")


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "Q", "chosen": "A"}, "f.jsonl:3: data.format=preference needs fields prompt, chosen "
                                     "and rejected; missing rejected"),
    ({"prompt": "Q", "rejected": "B", "chosen": None}, "missing chosen"),
    ({"prompt": 3, "chosen": "A", "rejected": "B"}, "f.jsonl:3: 'prompt' must be a string or a list"),
    ({"prompt": "Q", "chosen": [{"role": "user", "content": "A"}], "rejected": "B"},
     "f.jsonl:3: 'chosen' must be a string or a list of one assistant message"),
])
def test_bad_rows_are_one_line_errors(row: dict, message: str) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as error:
        preference(row, "f.jsonl:3")
    assert "\n" not in str(error.value)


def test_truncation_keeps_the_prompts_end_and_the_answers_starts() -> None:
    prompt, chosen, rejected = list(range(10)), [100 + i for i in range(8)], [200 + i for i in range(3)]
    assert truncate_pair(prompt, chosen, rejected, 20) == (prompt, chosen, rejected)
    # 10 + 8 > 16: the prompt keeps its last 8 (what the longer answer leaves, at least half).
    assert truncate_pair(prompt, chosen, rejected, 16) == (prompt[2:], chosen, rejected)
    # A long answer takes no more than half: the prompt keeps its last 6, the answers 6 each.
    assert truncate_pair(prompt, chosen, rejected, 12) == (prompt[4:], chosen[:6], rejected)
    assert truncate_pair(prompt[:2], chosen, rejected, 6) == (prompt[:2], chosen[:4], rejected)


def test_chat_pairs_tokenize_as_sft_does(tokenizer_dir: Path) -> None:
    """The answer's tokens are its assistant turn's, end of turn included; the prompt ends with the
    template's generation prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    pair = PreferencePair([{"role": "user", "content": "What do bees make?"}], "Honey.", "Cheese.")
    prompt, chosen, rejected = tokenize_pair(tokenizer, pair)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(chosen) == "Honey.<|im_end|>\n"
    assert tokenizer.decode(rejected) == "Cheese.<|im_end|>\n"
    plain_prompt, plain_chosen, _ = tokenize_pair(tokenizer, PreferencePair("Bees make", " honey",
                                                                            " cheese"))
    assert tokenizer.decode(plain_prompt) == "Bees make"
    assert plain_chosen[-1] == tokenizer.eos_token_id


def test_drops_and_truncation_are_counted(tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = DataConfig(format="preference", max_length=24)
    long = "word " * 40
    rows = [{"prompt": "Q1", "chosen": "A", "rejected": "B"},
            {"prompt": "Q2", "chosen": "same", "rejected": "same"},
            {"prompt": long, "chosen": "A", "rejected": "B"},
            {"prompt": "Q3 " * 8, "chosen": long, "rejected": "B"}]
    columns, stats = pair_columns(places(rows, "p.jsonl"), tokenizer, config)
    assert stats == {"samples": 4, "truncated": 1, "dropped_long_prompt": 1, "dropped_identical": 1}
    assert len(columns["prompt"]) == 2
    assert all(len(p) + len(c) <= 24 for p, c in zip(columns["prompt"], columns["chosen"], strict=True))
    path = write_jsonl(tmp_path / "p.jsonl", rows[1:3])
    with pytest.raises(UserError, match=r"p.jsonl: no usable pair \(1 prompts fill data.max_length=24, "
                                        r"1 pairs have identical answers\)"):
        load_pairs(path, tokenizer, config.model_copy(update={"cache_dir": str(tmp_path / "c")}))


def test_objective_and_format_must_fit(tiny_llama: Path, chat_file: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Q", "chosen": "A", "rejected": "B"}] * 8)
    sft = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, pairs, tmp_path / "a",
                                                           data__format="preference",
                                                           train__objective="sft")])
    assert sft.returncode == 2
    assert "train.objective=sft cannot train on data.format=preference" in sft.stderr
    assert "(its records are for dpo or orpo)" in sft.stderr
    dpo = cli_in_process(capsys, ["train", *tiny_overrides(tiny_llama, chat_file, tmp_path / "b",
                                                           train__objective="dpo")])
    assert dpo.returncode == 2
    assert "train.objective=dpo cannot train on data.format=chat" in dpo.stderr
