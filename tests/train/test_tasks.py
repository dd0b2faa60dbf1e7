"""`cpudist eval --task`: the scoring math on a stub model whose answers are known, and the command
end to end on a tiny trained run (eval.json, report.html)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cpudist.cli import main
from cpudist.infer.tasks import (
    continuation_logprobs,
    exact_match,
    multiple_choice_scores,
    normalize_answer,
)
from tests.helpers import CHAT_ROWS, REPO, cpudist_in_process, tiny_overrides, write_jsonl

VOCAB = 5


def _next_token_model(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A stub LM: after token t it gives token (t + 1) % VOCAB probability 0.6 and every other
    token 0.1, so the log-likelihood of any continuation is known by hand."""
    probs = torch.full((*ids.shape, VOCAB), 0.1)
    probs.scatter_(-1, ((ids + 1) % VOCAB).unsqueeze(-1), 0.6)
    return probs.log()


def test_continuation_logprobs_are_the_known_sums() -> None:
    context = [0, 1]
    # [2, 3] follows the rule twice; [2, 2] once; [4] never.
    got = continuation_logprobs(_next_token_model, context, [[2, 3], [2, 2], [4]], pad_id=0)
    expected = [2 * math.log(0.6), math.log(0.6) + math.log(0.1), math.log(0.1)]
    assert got == pytest.approx(expected, abs=1e-6)
    # Right padding leaves each row's figure as it is alone.
    assert continuation_logprobs(_next_token_model, context, [[4]], 0) == pytest.approx(got[2:])


def test_acc_and_acc_norm() -> None:
    # Choice 0 is likelier in total, choice 1 per byte: acc takes 0, acc_norm takes 1.
    logprobs = [math.log(0.5), 2 * math.log(0.3)]
    choices = ["a", "bbbbbbbbbb"]
    assert multiple_choice_scores(logprobs, choices, gold=1) == {"acc": 0.0, "acc_norm": 1.0}
    assert multiple_choice_scores(logprobs, choices, gold=0) == {"acc": 1.0, "acc_norm": 0.0}
    # Byte length, not characters: "é" is two bytes.
    assert multiple_choice_scores([-2.0, -3.0], ["x", "éé"], gold=1)["acc_norm"] == 1.0


def test_exact_match_normalises_and_takes_the_first_line() -> None:
    assert normalize_answer("  The  Sperm-whale! ") == "spermwhale"
    assert exact_match("\nRichard Nixon.\nHe was president.", ["richard nixon"]) == 1.0
    assert exact_match("It was Richard Nixon", ["Richard Nixon"]) == 0.0
    assert exact_match("1963", ["1962", "1963"]) == 1.0


@pytest.fixture(scope="module")
def trained(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("task-eval")
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in CHAT_ROWS * 4]
    out = root / "run"
    assert cpudist_in_process(["train", *tiny_overrides(
        tiny_llama, write_jsonl(root / "chat.jsonl", rows), out, train__max_steps=8,
        train__lr=3e-2, output__plots="true")]) == 0
    mc = write_jsonl(root / "mc.jsonl", [
        {"question": q, "choices": [a, CHAT_ROWS[(i + 1) % len(CHAT_ROWS)][1]], "answer": 0}
        for i, (q, a) in enumerate(CHAT_ROWS)])
    return {"root": root, "out": out, "base": tiny_llama, "mc": mc}


def test_eval_task_writes_before_and_after_into_the_run(trained: dict,
                                                         capsys: pytest.CaptureFixture) -> None:
    out = trained["out"]
    assert main(["eval", "--adapter", str(out / "adapter"), "--task", str(trained["mc"])]) == 0
    printed = capsys.readouterr().out
    assert "mc acc: base" in printed and "-> adapter" in printed
    entry = json.loads((out / "eval.json").read_text())["tasks"]["mc"]
    assert entry["items"] == len(CHAT_ROWS) and entry["kind"] == "multiple_choice"
    assert set(entry["before"]) == set(entry["after"]) == {"acc", "acc_norm"}
    assert entry["adapter"] == str((out / "adapter").resolve())

    # "before" is the base alone: the same figures as evaluating the base without an adapter.
    alone = trained["root"] / "base-only.json"
    assert main(["eval", "--base", str(trained["base"]), "--task", str(trained["mc"]),
                 "--dtype", "float32", "--out", str(alone)]) == 0
    only = json.loads(alone.read_text())["tasks"]["mc"]
    assert only["before"] == entry["before"] and only["after"] is None

    # A second task joins the first in eval.json; report.html shows both, before and after.
    qa = write_jsonl(trained["root"] / "qa.jsonl", [{"question": q, "answer": a}
                                                     for q, a in CHAT_ROWS[:3]])
    assert main(["eval", "--adapter", str(out / "adapter"), "--task", str(qa),
                 "--max-new-tokens", "4"]) == 0
    tasks = json.loads((out / "eval.json").read_text())["tasks"]
    assert set(tasks) == {"mc", "qa"} and set(tasks["qa"]["after"]) == {"exact_match"}
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    assert "Task evaluation" in page and "acc_norm" in page and "exact_match" in page
    assert f"{100 * entry['after']['acc']:.1f}%" in page


def test_the_harness_yaml_and_a_bad_task_file_from_the_command_line(
        trained: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "eval.json"
    assert main(["eval", "--base", str(trained["base"]), "--task",
                 str(REPO / "configs/tasks/chatterbot-trivia-mc.yaml"), "--out", str(out),
                 "--dtype", "float32"]) == 0
    entry = json.loads(out.read_text())["tasks"]["chatterbot_trivia_mc"]
    assert entry["items"] == 30 and entry["prompt"] == "lm-evaluation-harness plain text"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Q?", "choices": ["a", "b"], "answer": 0}) + "\n"
                   + json.dumps({"question": "Q?", "choices": ["a", "b"], "answer": 5}) + "\n")
    capsys.readouterr()
    assert main(["eval", "--base", str(trained["base"]), "--task", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and f"{bad}:2" in err


def test_before_is_computed_by_the_base_alone(trained: dict) -> None:
    from cpudist.config import Config, DistConfig, ModelConfig
    from cpudist.infer.session import open_session
    from cpudist.infer.tasks import base_only
    from cpudist.runtime.process import start_process

    ids = torch.tensor([[1, 2, 3, 4, 5]])
    config = Config(model=ModelConfig(path=str(trained["base"]), dtype="float32"))
    with start_process(DistConfig()) as process:
        plain = open_session(config, process).model(input_ids=ids).logits
        session = open_session(config, process, str(trained["out"] / "adapter"))
        with torch.no_grad(), base_only(session):
            disabled = session.model(input_ids=ids).logits
        adapted = session.model(input_ids=ids).logits
    torch.testing.assert_close(disabled, plain)
    assert (adapted - plain).abs().max() > 1e-3
