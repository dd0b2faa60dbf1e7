"""train.compile: true (Inductor over the decoder layers) trains to the same losses as eager, on
length-grouped chat batches of varying length (dynamic shapes), and says so in its log; auto
compiles only big models on long runs where a compiler is present (decide_compile)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from cpudist.config import Config
from cpudist.errors import UserError
from cpudist.train.engine import (
    COMPILE_MIN_HIDDEN,
    COMPILE_MIN_STEPS,
    compiler_problem,
    decide_compile,
)
from tests.helpers import cpudist_cmd, make_tiny_model, run, step_losses, tiny_overrides


@pytest.fixture
def inductor_can_build() -> None:
    """Skips, with the reason, where Inductor's CPU backend cannot build its kernels: no C++
    compiler, or no Python headers (Python.h) to build them against."""
    problem = compiler_problem()
    if problem:
        pytest.skip(f"torch.compile's CPU backend cannot build here: {problem}")


needs_compiler = pytest.mark.usefixtures("inductor_can_build")


@pytest.mark.slow
@needs_compiler
def test_compiled_layers_train_like_eager(tiny_llama: Path, chat_file: Path, tmp_path: Path) -> None:
    # Processes of their own: compiling changes dynamo's settings for the whole process.
    losses = {}
    for compiled in (False, True):
        out = tmp_path / f"compile-{compiled}"
        done = run([*cpudist_cmd(), "train",
                    *tiny_overrides(tiny_llama, chat_file, out, train__compile=compiled)])
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("torch.compile: 2 decoder layers" in done.stdout) == compiled
        assert ("torch.compile: on (train.compile=true)" if compiled
                else "torch.compile: off (train.compile=false)") in done.stdout
        losses[compiled] = step_losses(out)
    eager, compiled_run = losses[False], losses[True]
    assert [s for s, _ in compiled_run] == [s for s, _ in eager] == [1, 2, 3, 4]
    assert [loss for _, loss in compiled_run] == pytest.approx([loss for _, loss in eager], rel=1e-4)


def _decide(setting: object, hidden: int = 896, steps: int = 500, compiler: str | None = None,
            **train: object) -> tuple[bool, str]:
    config = Config.model_validate({"train": {"compile": setting, **train}})
    return decide_compile(config, hidden, steps, lambda: compiler)


def test_auto_compiles_big_models_on_long_runs_only() -> None:
    assert Config().train.compile == "auto"
    assert _decide("auto")[0]
    assert _decide("auto", hidden=COMPILE_MIN_HIDDEN, steps=COMPILE_MIN_STEPS)[0]
    small, why = _decide("auto", hidden=576)  # SmolLM2-135M: compiled steps were slower
    assert not small and "hidden size 576" in why
    short, why = _decide("auto", steps=COMPILE_MIN_STEPS - 1)
    assert not short and "train.compile=true forces it" in why
    no_compiler, why = _decide("auto", compiler="no C++ compiler found (apt-get install g++)")
    assert not no_compiler and "g++" in why
    assert not _decide("auto", ipex=True)[0]
    quantized = Config.model_validate({"model": {"quantize": "int4"}})
    assert not decide_compile(quantized, 4096, 1000, lambda: None)[0]


def test_the_compiler_is_looked_for_only_when_the_answer_depends_on_it() -> None:
    # Importing Inductor to find the compiler takes over a second; small or short runs skip it.
    def no_asking() -> str | None:
        raise AssertionError("compiler looked for")

    for setting, hidden, steps in ((False, 4096, 1000), ("auto", 64, 1000), ("auto", 896, 10)):
        config = Config.model_validate({"train": {"compile": setting}})
        assert not decide_compile(config, hidden, steps, no_asking)[0]


def test_explicit_settings_win_and_a_missing_compiler_is_a_clear_error() -> None:
    assert _decide(True, hidden=64, steps=4) == (True, "train.compile=true")
    assert _decide(False) == (False, "train.compile=false")
    assert _decide(False, compiler="no C++ compiler found") == (False, "train.compile=false")
    with pytest.raises(UserError, match="train.compile=true: torch.compile cannot build here"):
        _decide(True, compiler="no C++ compiler found (apt-get install g++)")


# A run of `cpudist train` in which auto's step threshold is SHORT_RUN (the rule itself is tested
# above, without a model): the compiled path end to end without training 200 steps.
SHORT_RUN = 6
AUTO_WITH_A_SHORT_THRESHOLD = f"""
import sys
from cpudist.train import engine
engine.COMPILE_MIN_STEPS = {SHORT_RUN}
from cpudist.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@needs_compiler
def test_auto_compiles_a_long_run_of_a_wide_model(tokenizer_dir: Path, chat_file: Path,
                                                   tmp_path: Path) -> None:
    # The path auto takes for 0.5B-7B models on real runs, end to end: a one-layer model of
    # hidden size 768 (the threshold) on a run as long as the step threshold compiles and trains.
    # A process of its own: compiling changes dynamo's settings for the whole process.
    model = make_tiny_model("qwen2", tokenizer_dir, tmp_path / "wide", hidden_size=COMPILE_MIN_HIDDEN,
                            intermediate_size=256, num_hidden_layers=1, num_attention_heads=12,
                            num_key_value_heads=4)
    out = tmp_path / "auto"
    done = run([sys.executable, "-c", AUTO_WITH_A_SHORT_THRESHOLD, "train",
                *tiny_overrides(model, chat_file, out, train__max_steps=SHORT_RUN,
                                train__batch_size=2, train__eval_batches=1)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"torch.compile: on (auto: hidden size {COMPILE_MIN_HIDDEN}, {SHORT_RUN} steps)"
            in done.stdout)
    assert "torch.compile: 1 decoder layers" in done.stdout
    # auto lets a graph that fails to build run eager, with dynamo's warning; none may appear.
    assert "WON'T CONVERT" not in done.stdout + done.stderr
    losses = step_losses(out)
    assert [step for step, _ in losses] == list(range(1, SHORT_RUN + 1))
    assert all(math.isfinite(loss) for _, loss in losses)
