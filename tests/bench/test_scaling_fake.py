"""`cpudist scaling --fake-nodes N --link ...`: the bench over loopback and on shaped fake nodes,
one JSON row per node count; its one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpudist.errors import UserError
from cpudist.launch import netns
from tests.helpers import REPO, cpudist_cmd, run, venv_mpirun


def _as_unprivileged(cmd: list[str]) -> list[str]:
    """cmd as a user who is not root (it already is one when the tests do not run as root)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not found: cannot drop root for this check")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]


def test_fake_nodes_without_root_is_one_line() -> None:
    done = subprocess.run(_as_unprivileged([sys.executable, "-m", "cpudist.cli", "scaling",
                                            "--fake-nodes", "2", "--link", "100mbit,5ms"]),
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "HOME": "/tmp"})
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: a fake cluster needs root (network namespaces); run as root "
                           "[exit 2: "), line


def test_a_bad_link_is_one_line_naming_the_part() -> None:
    done = run([*cpudist_cmd(), "scaling", "--fake-nodes", "2", "--link", "100mbit,5sec"],
               timeout=120)
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --link '100mbit,5sec': delay '5sec' is not a time like 5ms "
                           "(units us, ms, s) [exit 2: "), line


@pytest.mark.netns
@pytest.mark.mpi
@pytest.mark.slow
def test_fake_nodes_rows_against_loopback(tiny_qwen: Path, tmp_path: Path) -> None:
    try:
        netns.check_can_run()  # not root, no right to make namespaces, no iproute2
    except UserError as exc:
        pytest.skip(str(exc))
    if venv_mpirun() is None:
        pytest.skip("no Open MPI mpirun next to this Python (pip install 'cpudist[mpi]')")
    rows_file = tmp_path / "rows.json"
    proc = subprocess.Popen(
        [*cpudist_cmd(), "scaling", "--fake-nodes", "2", "--link", "200mbit", "--predict",
         f"model.path={tiny_qwen}", f"data.cache_dir={tmp_path / 'data-cache'}", "--steps", "2",
         "--warmup", "1", "--seq-len", "32", "--batch-size", "2", "--dtype", "float32",
         "--allocator", "none", "--total-threads", "2", "--out", str(tmp_path / "out"),
         "--json", str(rows_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert not netns.nodes_of(f"cpds{proc.pid}n")  # its cluster is gone
    one, two = json.loads(rows_file.read_text())
    assert (one["nodes"], two["nodes"]) == (1, 2)
    assert one["efficiency"] == 1.0  # one node is the loopback run itself
    assert two["link"] == "200mbit" and two["batch_per_rank"] == 2
    assert two["threads_per_rank"] == 1  # the 2 threads shared by the 2 nodes
    for key in ("tokens_per_s", "loopback_tokens_per_s", "efficiency", "predicted_tokens_per_s"):
        assert two[key] > 0, key
    assert len(two["compute_s_per_rank"]) == len(two["wait_for_slowest_s"]) == 2
    # The gradients crossed the fake link: each node sent at least its share of every step's.
    assert two["comm_mb_per_step"] > 0
    assert two["link_mb_per_node_step"] >= two["comm_mb_per_step"] * 0.9
    assert "| 2 | 200mbit |" in (tmp_path / "out" / "fake-nodes.md").read_text()
