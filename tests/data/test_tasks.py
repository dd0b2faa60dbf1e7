"""Task files for `cpudist eval --task` (cpudist.data.tasks): the three forms and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpudist.data.tasks import load_task
from cpudist.errors import UserError
from tests.helpers import REPO, write_jsonl

MC = {"question": "What do bees make?", "choices": ["Milk", "Honey", "Silk"], "answer": 1}


def test_the_shipped_tasks_read() -> None:
    mc = load_task(REPO / "configs/tasks/chatterbot-trivia-mc.jsonl")
    assert mc.kind == "multiple_choice" and len(mc.items) == 30 and not mc.harness
    assert all(len(item.choices) == 4 and 0 <= item.gold < 4 for item in mc.items)
    qa = load_task(REPO / "configs/tasks/chatterbot-trivia-qa.jsonl")
    assert qa.kind == "qa" and len(qa.items) == 20 and all(item.answers for item in qa.items)


def test_answer_by_index_or_text_and_query_key(tmp_path: Path) -> None:
    task = load_task(write_jsonl(tmp_path / "t.jsonl", [
        MC, {**MC, "answer": "Honey"}, {"query": "Q?", "choices": ["a", "b"], "answer": "0"}]))
    assert [item.gold for item in task.items] == [1, 1, 0]
    assert task.items[2].question == "Q?" and task.items[1].where.endswith("t.jsonl:2")
    qa = load_task(write_jsonl(tmp_path / "qa.jsonl", [{"question": "Q?", "answer": ["x", "y"]}]))
    assert qa.items[0].answers == ["x", "y"]


@pytest.mark.parametrize(("line", "needle"), [
    ('{"question": "Q?", "choices": ["a", "b"], "answer": 2}', "not an index of the 2 choices"),
    ('{"question": "Q?", "choices": ["a", "b"], "answer": "c"}', "'c' is not one of the choices"),
    ('{"question": "Q?", "choices": ["a"], "answer": 0}', "at least two"),
    ('{"choices": ["a", "b"], "answer": 0}', "no \"question\""),
    ('{"question": "Q?", "answer": ""}', "\"answer\" must be"),
    ('{"question": "Q?", "answer": "x"}', "keep one kind of item per file"),
    ('{"question": "Q?", "choices": ["a", "b"], "answer": 0', "malformed JSON"),
])
def test_a_bad_item_names_file_and_line(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "task.jsonl"
    path.write_text(json.dumps(MC) + "\n" + line + "\n")
    with pytest.raises(UserError) as caught:
        load_task(path)
    assert f"{path}:2" in str(caught.value) and needle in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


def _yaml(tmp_path: Path, extra: str = "", data: str = "data.jsonl") -> Path:
    write_jsonl(tmp_path / "data.jsonl", [
        {"q": "What do bees make?", "options": ["Milk", "Honey"], "label": 1},
        {"q": "Which planet is red?", "options": ["Mars", "Venus"], "label": 0}])
    path = tmp_path / "task.yaml"
    path.write_text(f"task: bees\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    f"    test: {data}\noutput_type: multiple_choice\n"
                    'doc_to_text: "Question: {{q}}\\nAnswer:"\ndoc_to_choice: options\n'
                    f"doc_to_target: label\n{extra}")
    return path


def test_a_harness_yaml_task(tmp_path: Path) -> None:
    task = load_task(_yaml(tmp_path, "target_delimiter: ' '\nmetric_list:\n  - metric: acc\n"))
    assert task.name == "bees" and task.harness and task.delimiter == " "
    assert task.items[0].question == "Question: What do bees make?\nAnswer:"
    assert task.items[0].choices == ["Milk", "Honey"] and task.items[0].gold == 1
    # doc_to_choice as a template rendering a list, doc_to_target as a template of the text.
    path = _yaml(tmp_path)
    path.write_text(path.read_text().replace("doc_to_choice: options",
                                             "doc_to_choice: \"{{options}}\"")
                    .replace("doc_to_target: label", "doc_to_target: \"{{options[label]}}\""))
    assert [item.gold for item in load_task(path).items] == [1, 0]


@pytest.mark.parametrize(("extra", "data", "needle"), [
    ("num_fewshot: 5\n", "data.jsonl", "task.yaml:10: key 'num_fewshot' is not supported"),
    ("", "missing.jsonl", "data file missing.jsonl not found"),
    ("metric_list:\n  - metric: bleu\n", "data.jsonl", "metric 'bleu'"),
])
def test_a_harness_yaml_refuses_what_it_cannot_do(tmp_path: Path, extra: str, data: str,
                                                  needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        load_task(_yaml(tmp_path, extra, data))


def test_a_harness_template_naming_a_missing_field(tmp_path: Path) -> None:
    path = _yaml(tmp_path)
    path.write_text(path.read_text().replace("{{q}}", "{{question}}"))
    with pytest.raises(UserError, match=r"task.yaml:7: doc_to_text fails on .*data.jsonl:1 "
                                        r"\('question' is undefined\)"):
        load_task(path)
