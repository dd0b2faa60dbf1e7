"""The short form of the soak test (tests/scripts/soak.py): a 2-rank run under
`cpudist launch --restarts`, ranks SIGKILLed at random steps, ends with every step logged once,
the uninterrupted run's adapter bit for bit, and no process left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import mpirun_cmd
from tests.scripts.soak import soak

pytestmark = [pytest.mark.slow, pytest.mark.mpi]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the run's processes in /proc")
def test_soak_short_form(tiny_llama: Path, chat_file: Path, tmp_path: Path) -> None:
    mpirun_cmd(2)  # skips without Open MPI
    seed = int(os.environ.get("CPUDIST_SOAK_SEED", "7"))
    result = soak(tmp_path, seed=seed, kills=2, restarts=3, steps=12, save_every=2,
                  model=tiny_llama, data=chat_file, timeout=600)
    print(result)
    assert result["failures"] == [], f"replay: python -m tests.scripts.soak --seed {seed}"
    assert result["kills"] == result["restarts"] == 2
