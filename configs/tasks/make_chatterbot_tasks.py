"""Rebuild the chatterbot trivia tasks of this folder from chatterbot-corpus==1.3.3 (english/trivia.yml).

    python configs/tasks/make_chatterbot_tasks.py

Multiple choice: the first 30 questions whose answer is at most five words; the three wrong
choices are other questions' answers, drawn with a fixed seed. QA: the first 20 answers of at most
two words. The corpus is part of chatterbot:english, the quickstart's training data: these tasks
measure whether a run learnt what it was shown (before/after), not generalisation.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import chatterbot_corpus
import yaml

HERE = Path(__file__).resolve().parent


def pairs() -> list[tuple[str, str]]:
    source = Path(chatterbot_corpus.__file__).parent / "data" / "english" / "trivia.yml"
    found = []
    for turn in yaml.safe_load(source.read_text())["conversations"]:
        if isinstance(turn, list) and len(turn) == 2 and turn[0].rstrip().endswith("?"):
            question, answer = (str(t).strip() for t in turn)
            if answer.rstrip(".") not in {a for _, a in found}:
                found.append((question, answer.rstrip(".")))
    return found


def main() -> None:
    rng = random.Random(0)
    short = [(q, a) for q, a in pairs() if len(a.split()) <= 5]
    answers = [a for _, a in short]
    with open(HERE / "chatterbot-trivia-mc.jsonl", "w") as out:
        for question, answer in short[:30]:
            wrong = rng.sample([a for a in answers if a != answer], 3)
            choices = [answer, *wrong]
            rng.shuffle(choices)
            out.write(json.dumps({"question": question, "choices": choices,
                                  "answer": choices.index(answer)}, ensure_ascii=False) + "\n")
    with open(HERE / "chatterbot-trivia-qa.jsonl", "w") as out:
        for question, answer in [(q, a) for q, a in short if len(a.split()) <= 2][:20]:
            out.write(json.dumps({"question": question, "answer": answer},
                                 ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
