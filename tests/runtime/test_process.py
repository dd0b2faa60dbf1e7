"""A rank's logging: every line another rank writes carries its rank, its own and libraries'."""

from __future__ import annotations

import logging

import pytest

from cpudist.runtime.cluster import Placement
from cpudist.runtime.process import configure_logging


def test_a_library_warning_without_a_handler_carries_the_rank(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A library logger's warning that reaches no handler (Python's last resort: the kernels
    package's at import, on rank 1 of every run with bitsandbytes installed) is prefixed, and
    its info lines stay quiet as before."""
    loggers = [logging.getLogger(name) for name in ("cpudist", "py.warnings")]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    before = logging.lastResort
    try:
        configure_logging(Placement(1, 2, 1, 2, "openmpi"))
        orphan = logging.Logger("kernels._internals.hf_hub")  # no parent: only the last resort
        orphan.warning("Skipping publisher trust check")
        orphan.info("an info line")
        assert capsys.readouterr().err == "[rank 1] Skipping publisher trust check\n"
    finally:
        logging.lastResort = before
        logging.captureWarnings(False)
        for lg, (handlers, level, propagate) in zip(loggers, saved, strict=True):
            lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
