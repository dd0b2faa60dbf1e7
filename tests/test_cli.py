"""The command line: every command's --help is instant (no torch import), and section.key=value
overrides may stand anywhere among a command's flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cpudist.cli import COMMANDS
from cpudist.commands.common import split_settings
from cpudist.errors import UserError
from tests.helpers import cli_in_process, cpudist_cmd, run

NO_TORCH = """
import sys
from cpudist.cli import main
try:
    main([{command!r}, "--help"])
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "transformers", "peft", "datasets") if m in sys.modules)
print("HEAVY", ",".join(heavy))
"""


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_imports_no_torch(command: str) -> None:
    done = subprocess.run([sys.executable, "-c", NO_TORCH.format(command=command)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"cpudist {command}" in done.stdout  # its own usage line
    assert done.stdout.strip().splitlines()[-1] == "HEAVY", done.stdout[-500:]


def test_top_level_help_lists_every_command() -> None:
    done = run([*cpudist_cmd(), "--help"], timeout=60)
    assert done.returncode == 0
    for command in COMMANDS:
        assert f"  {command} " in done.stdout, command


def test_unknown_command_is_refused() -> None:
    done = run([*cpudist_cmd(), "trian"], timeout=60)
    assert done.returncode == 2 and "invalid choice: 'trian'" in done.stderr


def test_overrides_stand_anywhere_among_the_flags() -> None:
    from cpudist.cli import command_parser

    parser, _ = command_parser("bench")
    args = parser.parse_intermixed_args(["model.path=/m", "--steps", "1", "lora.r=16",
                                         "cfg.yaml", "--preset", "qwen2.5-0.5b", "train.lr=1"])
    assert args.steps == 1 and args.preset == "qwen2.5-0.5b"
    assert split_settings(args.settings) == ("cfg.yaml", ["model.path=/m", "lora.r=16",
                                                          "train.lr=1"])


def test_more_than_one_config_file_is_an_error() -> None:
    with pytest.raises(UserError, match="more than one config file given"):
        split_settings(["a.yaml", "b.yaml"])
    done = run([*cpudist_cmd(), "train", "a.yaml", "b.yaml"], timeout=60)
    assert done.returncode == 2 and "more than one config file" in done.stderr


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import cpudist

    done = cli_in_process(capsys, ["--version"])
    assert done.returncode == 0 and done.stdout.strip() == f"cpudist {cpudist.__version__}"


def test_an_internal_error_exits_1_with_its_traceback_then_one_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug is exit class 1 (do not retry), told apart from bad input (2) by its last line."""
    from cpudist.commands import hostfile

    def broken(_args: object) -> int:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(hostfile, "run", broken)
    done = cli_in_process(capsys, ["hostfile", "check", "h"])
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "ZeroDivisionError: division by zero" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: the traceback above is a bug in cpudist or a library [exit 1: internal error (do "
        "not retry; report it with the --debug traceback)]")
