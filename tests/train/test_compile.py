"""train.compile=true (Inductor over the decoder layers) trains to the same losses as eager, on
length-grouped chat batches of varying length (dynamic shapes), and says so in its log."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import cpudist_cmd, run, step_losses, tiny_overrides

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                       reason="torch.compile's CPU backend needs a C++ compiler (apt-get install g++)"),
]


def test_compiled_layers_train_like_eager(tiny_llama: Path, chat_file: Path, tmp_path: Path) -> None:
    losses = {}
    for compiled in (False, True):
        out = tmp_path / f"compile-{compiled}"
        done = run([*cpudist_cmd(), "train",
                    *tiny_overrides(tiny_llama, chat_file, out, train__compile=compiled)])
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("torch.compile: 2 decoder layers" in done.stdout) == compiled
        losses[compiled] = step_losses(out)
    eager, compiled_run = losses[False], losses[True]
    assert [s for s, _ in compiled_run] == [s for s, _ in eager] == [1, 2, 3, 4]
    assert [loss for _, loss in compiled_run] == pytest.approx([loss for _, loss in eager], rel=1e-4)
