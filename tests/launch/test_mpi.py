"""`cpudist launch`: the mpirun command line for each MPI flavour, without running MPI (plus one
real single-host Open MPI run, marked mpi)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpudist.errors import UserError
from cpudist.launch import hostfile as hf
from cpudist.launch import mpi as launcher
from cpudist.launch.mpi import MpiInfo, build_command
from tests.helpers import REPO, cli_in_process, venv_mpirun

OMPI = MpiInfo("openmpi", "/opt/mpi/bin/mpirun", "mpirun (Open MPI) 5.0.11")
MPICH = MpiInfo("mpich", "/opt/mpich/bin/mpiexec", "HYDRA build details:")
INTEL = MpiInfo("intel", "/opt/intel/bin/mpiexec.hydra", "Intel(R) MPI Library 2021.13")
PY = "/venv/bin/python"
PROGRAM = ["train", "cfg.yaml", "train.max_steps=3"]


def pairs(cmd: list[str], flag: str) -> list[str]:
    """Values following each occurrence of `flag`."""
    return [cmd[i + 1] for i, arg in enumerate(cmd) if arg == flag]


def tail(cmd: list[str]) -> list[str]:
    return cmd[cmd.index(PY):]


# --------------------------------------------------------------------------- flavour detection


@pytest.mark.parametrize(
    ("text", "flavour"),
    [
        ("mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/",
         "openmpi"),
        ("mpirun (Open MPI) 4.1.4", "openmpi"),
        ("HYDRA build details:\n    Version: 4.0.2\n", "mpich"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.13 Build 20240701", "intel"),
        ("something else 1.0", None),
    ],
)
def test_parse_version(text: str, flavour: str | None) -> None:
    assert launcher.parse_version(text) == flavour


def test_detect_mpi_runs_version(tmp_path: Path) -> None:
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\necho '    Version: 4.3.0'\n")
    fake.chmod(0o755)
    info = launcher.detect_mpi(str(fake))
    assert info == MpiInfo("mpich", str(fake), "HYDRA build details:")
    assert info.hydra


def test_detect_mpi_unknown_is_user_error(tmp_path: Path) -> None:
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'not an mpi'\n")
    fake.chmod(0o755)
    with pytest.raises(UserError, match="does not look like Open MPI"):
        launcher.detect_mpi(str(fake))
    with pytest.raises(UserError, match="not found"):
        launcher.detect_mpi(str(tmp_path / "missing-mpirun"))


# --------------------------------------------------------------------------- Open MPI


def test_openmpi_single_node_binds_cores_per_rank() -> None:
    cmd = build_command(OMPI, 4, PROGRAM, python=PY, cores_per_node=16, as_root=False)
    assert cmd[:3] == [OMPI.mpirun, "-np", "4"]
    assert pairs(cmd, "--map-by") == ["slot:PE=4"]
    assert pairs(cmd, "--bind-to") == ["core"]
    exports = pairs(cmd, "-x")
    assert "OMP_NUM_THREADS=4" in exports
    assert "KMP_AFFINITY=granularity=fine,compact,1,0" in exports
    assert "KMP_BLOCKTIME=1" in exports
    assert "--allow-run-as-root" not in cmd and "--oversubscribe" not in cmd
    assert not any(e.startswith("OMP_WAIT_POLICY") for e in exports)  # own cores: spin is fine
    assert tail(cmd) == [PY, "-m", "cpudist.cli", *PROGRAM]


def test_openmpi_root_and_forwarded_env() -> None:
    cmd = build_command(OMPI, 2, PROGRAM, python=PY, cores_per_node=8, as_root=True,
                        forward=["PATH", "PYTHONPATH"])
    assert "--allow-run-as-root" in cmd
    exports = pairs(cmd, "-x")
    assert "PATH" in exports and "PYTHONPATH" in exports


def test_openmpi_more_ranks_than_cores_unbinds_and_oversubscribes() -> None:
    cmd = build_command(OMPI, 4, PROGRAM, python=PY, cores_per_node=2)
    assert pairs(cmd, "--bind-to") == ["none"]
    assert "--map-by" not in cmd
    assert "--oversubscribe" in cmd
    exports = pairs(cmd, "-x")
    assert "OMP_NUM_THREADS=1" in exports
    # compact pinning without a per-rank mask would stack every rank on the same cores
    assert not any(e.startswith("KMP_AFFINITY") for e in exports)
    # ranks share cores: OpenMP threads must not spin-wait
    assert "OMP_WAIT_POLICY=PASSIVE" in exports


def test_users_omp_wait_policy_is_forwarded_not_overridden() -> None:
    cmd = build_command(OMPI, 4, PROGRAM, python=PY, cores_per_node=2,
                        forward=["PATH", "OMP_WAIT_POLICY"])
    exports = pairs(cmd, "-x")
    assert "OMP_WAIT_POLICY" in exports
    assert "OMP_WAIT_POLICY=PASSIVE" not in exports
    cmd = build_command(INTEL, 4, PROGRAM, python=PY, cores_per_node=2, forward=["OMP_WAIT_POLICY"])
    assert pairs(cmd, "-genvlist") == ["OMP_WAIT_POLICY"]
    assert "OMP_WAIT_POLICY" not in {cmd[i + 1] for i, a in enumerate(cmd) if a == "-genv"}


def test_openmpi_threads_override_that_does_not_fit() -> None:
    # 2 ranks x 4 threads on 4 cores: cannot bind, must not fail to map
    cmd = build_command(OMPI, 2, PROGRAM, python=PY, cores_per_node=4, threads_per_rank=4)
    assert pairs(cmd, "--bind-to") == ["none"]
    assert "OMP_NUM_THREADS=4" in pairs(cmd, "-x")
    assert tail(cmd)[-1] == "dist.threads_per_rank=4"


def test_threads_override_not_duplicated_and_only_for_train() -> None:
    cmd = build_command(OMPI, 1, ["train", "c.yaml", "dist.threads_per_rank=3"], python=PY,
                        cores_per_node=8, threads_per_rank=2)
    assert tail(cmd).count("dist.threads_per_rank=3") == 1
    assert not any(a == "dist.threads_per_rank=2" for a in cmd)
    cmd = build_command(OMPI, 1, ["bench"], python=PY, cores_per_node=8, threads_per_rank=2)
    assert tail(cmd) == [PY, "-m", "cpudist.cli", "bench"]


def test_openmpi_hostfile_ranks_per_node() -> None:
    hosts = hf.parse_text("n1 slots=2\nn2 slots=2\nn3 slots=2\nn4 slots=2\n")
    cmd = build_command(OMPI, 8, PROGRAM, python=PY, cores_per_node=56, hostfile="h",
                        hosts=hosts)
    assert pairs(cmd, "--hostfile") == ["h"]
    assert pairs(cmd, "--map-by") == ["slot:PE=28"]
    assert "OMP_NUM_THREADS=28" in pairs(cmd, "-x")
    assert "--oversubscribe" not in cmd
    # more ranks than slots: oversubscribe, fewer cores each
    cmd = build_command(OMPI, 12, PROGRAM, python=PY, cores_per_node=56, hostfile="h",
                        hosts=hosts)
    assert "--oversubscribe" in cmd
    assert pairs(cmd, "--map-by") == ["slot:PE=18"]


def test_allocator_preload_keeps_existing_ld_preload() -> None:
    cmd = build_command(OMPI, 1, PROGRAM, python=PY, cores_per_node=2, allocator="jemalloc",
                        preload="/usr/lib/libjemalloc.so.2", ld_preload="/opt/other.so")
    exports = pairs(cmd, "-x")
    assert "LD_PRELOAD=/usr/lib/libjemalloc.so.2:/opt/other.so" in exports
    assert "MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1" in exports
    cmd = build_command(OMPI, 1, PROGRAM, python=PY, cores_per_node=2, allocator="tcmalloc",
                        preload="/usr/lib/libtcmalloc.so.4")
    exports = pairs(cmd, "-x")
    assert "LD_PRELOAD=/usr/lib/libtcmalloc.so.4" in exports
    assert not any(e.startswith("MALLOC_CONF") for e in exports)


def test_mpi_args_go_before_the_program() -> None:
    cmd = build_command(OMPI, 2, PROGRAM, python=PY, cores_per_node=2,
                        mpi_args=["--mca", "plm_rsh_agent", "agent.sh"])
    assert cmd[cmd.index("--mca"):cmd.index(PY)] == ["--mca", "plm_rsh_agent", "agent.sh"]


def test_empty_program_and_bad_np() -> None:
    with pytest.raises(UserError, match="nothing to run"):
        build_command(OMPI, 2, [], python=PY, cores_per_node=2)
    with pytest.raises(UserError, match="at least one rank"):
        build_command(OMPI, 0, PROGRAM, python=PY, cores_per_node=2)


# --------------------------------------------------------------------------- hydra


def test_mpich_uses_ppn_genv_and_bind() -> None:
    hosts = hf.parse_text("a:2\nb:2\n")
    cmd = build_command(MPICH, 4, PROGRAM, python=PY, cores_per_node=8, hostfile="h.hydra",
                        hosts=hosts, as_root=True, forward=["PATH"])
    assert cmd[:5] == [MPICH.mpirun, "-n", "4", "-ppn", "2"]
    assert pairs(cmd, "-f") == ["h.hydra"]
    assert pairs(cmd, "-bind-to") == ["core:4"]
    genv = {cmd[i + 1]: cmd[i + 2] for i, a in enumerate(cmd) if a == "-genv"}
    assert genv["OMP_NUM_THREADS"] == "4"
    assert genv["I_MPI_PIN_DOMAIN"] == "4"
    assert genv["KMP_BLOCKTIME"] == "1"
    assert pairs(cmd, "-genvlist") == ["PATH"]
    # Open MPI-only flags never reach hydra
    for flag in ("--allow-run-as-root", "--oversubscribe", "-x", "--map-by", "-np"):
        assert flag not in cmd
    assert tail(cmd) == [PY, "-m", "cpudist.cli", *PROGRAM]


def test_intel_pins_with_domain_not_bind_to() -> None:
    cmd = build_command(INTEL, 2, PROGRAM, python=PY, cores_per_node=8)
    assert "-bind-to" not in cmd
    genv = {cmd[i + 1]: cmd[i + 2] for i, a in enumerate(cmd) if a == "-genv"}
    assert genv["I_MPI_PIN_DOMAIN"] == "4"
    cmd = build_command(INTEL, 4, PROGRAM, python=PY, cores_per_node=2)
    genv = {cmd[i + 1]: cmd[i + 2] for i, a in enumerate(cmd) if a == "-genv"}
    assert genv["I_MPI_PIN"] == "0" and "I_MPI_PIN_DOMAIN" not in genv
    assert genv["OMP_WAIT_POLICY"] == "PASSIVE"


def test_prepare_hostfile_converts_to_the_mpi_syntax(tmp_path: Path) -> None:
    src = tmp_path / "h"
    src.write_text("a slots=2\nb slots=1\n")
    path, hosts = launcher.prepare_hostfile(str(src), MPICH, str(tmp_path))
    assert path != str(src) and hf.parse(path).syntax == "hydra"
    assert hosts.total_slots == 3
    path, _ = launcher.prepare_hostfile(str(src), OMPI, str(tmp_path))
    assert path == str(src)  # already right: used as is


# --------------------------------------------------------------------------- CLI


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cpudist.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def fake_mpi(tmp_path: Path, banner: str) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    fake = tmp_path / "mpirun"
    fake.write_text(f"#!/bin/sh\necho '{banner}'\n")
    fake.chmod(0o755)
    return str(fake)


def test_cli_dry_run_prints_a_shell_quoted_command(tmp_path: Path) -> None:
    fake = fake_mpi(tmp_path, "mpirun (Open MPI) 5.0.11")
    done = run_cli("launch", "-np", "2", "--mpirun", fake, "--allocator", "none",
                   "--cores-per-node", "4", "--dry-run", "--",
                   "train", "my config.yaml", "train.max_steps=2")
    assert done.returncode == 0, done.stderr
    cmd = shlex.split(done.stdout.strip())
    assert cmd[:3] == [fake, "-np", "2"]
    assert pairs(cmd, "--map-by") == ["slot:PE=2"]
    assert cmd[-5:] == ["-m", "cpudist.cli", "train", "my config.yaml", "train.max_steps=2"]
    assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)


@pytest.mark.parametrize("where", ["launch", "command"])
def test_quiet_given_to_launch_reaches_the_ranks_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    fake = fake_mpi(tmp_path, "mpirun (Open MPI) 5.0.11")
    program = ["train", "--quiet", "c.yaml"] if where == "command" else ["train", "c.yaml"]
    done = cli_in_process(capsys, ["launch", "--quiet", "-np", "2", "--mpirun", fake,
                                   "--allocator", "none", "--cores-per-node", "4", "--dry-run",
                                   "--", *program])
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout.strip())[-4:] == ["cpudist.cli", "train", "--quiet", "c.yaml"]


def test_cli_dry_run_converts_hostfile_for_hydra(tmp_path: Path) -> None:
    fake = fake_mpi(tmp_path, "HYDRA build details:")
    done = run_cli("launch", "-np", "4", "--mpirun", fake, "--hostfile",
                   "hostfiles/cluster-4node.openmpi", "--allocator", "none", "--dry-run",
                   "--", "train", "c.yaml")
    assert done.returncode == 0, done.stderr
    assert "node01:2" in done.stderr  # the converted hostfile is shown
    cmd = shlex.split(done.stdout.strip())
    assert cmd[:5] == [fake, "-n", "4", "-ppn", "2"]


def test_cli_user_errors(tmp_path: Path) -> None:
    fake = fake_mpi(tmp_path, "mpirun (Open MPI) 5.0.11")
    done = run_cli("launch", "-np", "2", "--mpirun", fake, "--dry-run")
    assert done.returncode == 2 and "nothing to run" in done.stderr
    done = run_cli("launch", "-np", "2", "--mpirun", fake, "--hostfile", "nope", "--dry-run",
                   "--", "train", "c.yaml")
    assert done.returncode == 2 and "nope: hostfile not found" in done.stderr


def test_launcher_reads_no_launcher_variables() -> None:
    # Design rule: cpudist.runtime.cluster alone reads OMPI_*/PMI_*/SLURM_*.
    for path in (REPO / "cpudist" / "launch").glob("*.py"):
        source = path.read_text()
        for prefix in ("OMPI_", "PMI_", "SLURM_", "PMIX_"):
            assert f'"{prefix}' not in source and f"'{prefix}" not in source, path


def test_wrapper_scripts_dry_run(tmp_path: Path) -> None:
    fake = fake_mpi(tmp_path, "mpirun (Open MPI) 5.0.11")
    env = {**os.environ, "CPUDIST_DRY_RUN": "1", "CPUDIST_PYTHON": sys.executable, "MPIRUN": fake}
    done = subprocess.run(["sh", "launch/mpirun.sh", "2", "hostfiles/localhost", "--allocator",
                           "none", "--", "train", "c.yaml"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    cmd = shlex.split(done.stdout.strip())
    assert cmd[:3] == [fake, "-np", "2"] and pairs(cmd, "--hostfile") == ["hostfiles/localhost"]
    # The same wrapper with an MPICH (hydra) launcher: hydra's flags and a converted hostfile.
    env["MPIRUN"] = fake_mpi(tmp_path / "hydra", "HYDRA build details:")
    done = subprocess.run(["sh", "launch/mpirun.sh", "2", "hostfiles/localhost", "--", "train",
                           "c.yaml"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    cmd = shlex.split(done.stdout.strip())
    assert cmd[:5] == [env["MPIRUN"], "-n", "2", "-ppn", "2"] and "-f" in cmd


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_slurm_sbatch_dry_run() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(CPUDIST_DRY_RUN="1", SLURM_CPUS_PER_TASK="6", SLURM_JOB_ID="4242",
               CPUDIST_PYTHON=sys.executable)
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    done = subprocess.run(["bash", "launch/slurm.sbatch", "my cfg.yaml", "train.max_steps=3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "MASTER_PORT=24242" in lines[0]
    # The ranks' environment is what cpudist says a bound rank of 6 threads needs.
    asked = run_cli("env", "--shell", "--threads-per-rank", "6", env=env)
    assert asked.returncode == 0 and "export OMP_NUM_THREADS=6" in asked.stdout
    assert lines[1:-1] == asked.stdout.strip().splitlines()
    cmd = shlex.split(lines[-1])
    assert cmd[0] == "srun" and "--cpu-bind=cores" in cmd
    assert cmd[-7:] == [sys.executable, "-m", "cpudist.cli", "train", "my cfg.yaml",
                        "train.max_steps=3", "dist.threads_per_rank=6"]
    done = subprocess.run(["bash", "launch/slurm.sbatch"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr


# --------------------------------------------------------------------------- real Open MPI


@pytest.mark.mpi
@pytest.mark.skipif(venv_mpirun() is None, reason="no mpirun (pip install 'cpudist[mpi]')")
def test_real_launch_runs_every_rank_bound() -> None:
    """The command that build_command makes is accepted by the real mpirun and binds ranks."""
    mpirun = venv_mpirun()
    assert mpirun is not None
    if launcher.parse_version(subprocess.run([mpirun, "--version"], capture_output=True,
                                             text=True).stdout) != "openmpi":
        pytest.skip("mpirun here is not Open MPI")
    # 2 ranks, each running a cpudist command this module owns; -np 3 > cores also works.
    for np in (2, 3):
        done = run_cli("launch", "-np", str(np), "--mpirun", mpirun, "--allocator", "none",
                       "--", "hostfile", "check", "hostfiles/localhost")
        assert done.returncode == 0, done.stderr + done.stdout
        assert done.stdout.count("1 host(s), 2 slot(s) in total") == np
