"""The command line: every command's --help is instant (no torch import), and section.key=value
overrides may stand anywhere among a command's flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cpudist.cli import COMMANDS
from cpudist.commands.common import split_settings
from cpudist.errors import UserError
from tests.helpers import cpudist_cmd, run

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
