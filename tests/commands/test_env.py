"""`cpudist env` on this machine, and `cpudist env --shell` (a rank's environment)."""

from __future__ import annotations

import pytest

from cpudist.runtime.precision import choose_precision
from tests.helpers import cli_in_process


def test_env_command_reports_machine(capsys: pytest.CaptureFixture[str]) -> None:
    result = cli_in_process(capsys, ["env"])
    assert result.returncode == 0, result.stderr
    keys = [line.split("  ")[0] for line in result.stdout.splitlines()]
    for key in ("cpu", "isa", "dtype (auto)", "threads per rank", "torch", "transformers", "peft",
                "mpi library", "oneccl bindings", "ipex"):
        assert key in keys, key
    expected = choose_precision("auto").describe()
    assert any(line.startswith("dtype (auto)") and expected in line for line in result.stdout.splitlines())
    from cpudist.runtime.allocator import choose_allocator

    malloc = next(line for line in result.stdout.splitlines() if line.startswith("malloc"))
    assert (choose_allocator("auto")[0] or "glibc malloc") in malloc and "CPUDIST_ALLOCATOR=auto" in malloc
    from cpudist.train.engine import compiler_problem

    compile_line = next(line for line in result.stdout.splitlines()
                        if line.startswith("torch.compile (auto)"))
    assert ("can build" in compile_line) == (compiler_problem() is None), compile_line


def test_env_shell_prints_a_bound_ranks_environment(capsys: pytest.CaptureFixture[str]) -> None:
    result = cli_in_process(capsys, ["env", "--shell", "--threads-per-rank", "3", "--allocator",
                                     "none"])
    assert result.returncode == 0, result.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in result.stdout.splitlines())
    assert exports["OMP_NUM_THREADS"] == exports["MKL_NUM_THREADS"] == "3"
    assert exports["CPUDIST_ALLOCATOR"] == "none" and "LD_PRELOAD" not in exports
    assert "KMP_AFFINITY" in exports  # bound to its own cores
