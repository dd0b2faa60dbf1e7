#!/bin/sh
# MPICH / Intel MPI (hydra) launch of cpudist.
#
#   launch/mpiexec-hydra.sh NP [HOSTFILE] -- train configs/quickstart.yaml key=value ...
#
# Uses MPIEXEC (default: mpiexec.hydra, else mpiexec, on PATH: load your Intel MPI / MPICH
# environment first, e.g. `source /opt/intel/oneapi/setvars.sh` or `pip install 'cpudist[mpich]'`).
# cpudist launch adds -ppn, -genv OMP_NUM_THREADS/I_MPI_PIN_DOMAIN and converts an Open MPI
# hostfile ("host slots=N") to hydra's "host:N". CPUDIST_DRY_RUN=1 prints the command only.
# Fake nodes (netns-cluster.sh): add --mpi-arg=-launcher --mpi-arg=ssh --mpi-arg=-launcher-exec
# --mpi-arg="$PWD/launch/netns-agent.sh" --mpi-arg=-genv --mpi-arg=UCX_TLS --mpi-arg=tcp,self
set -eu
[ $# -ge 1 ] || { echo "usage: $0 NP [HOSTFILE] [launch options] -- COMMAND ..." >&2; exit 2; }
np="$1"; shift
case "${1:-}" in
  ''|-*) set -- -np "$np" "$@" ;;
  *) hf="$1"; shift; set -- -np "$np" --hostfile "$hf" "$@" ;;  # second word: a hostfile
esac
py="${CPUDIST_PYTHON:-python3}"
mpiexec_bin="${MPIEXEC:-$(command -v mpiexec.hydra || command -v mpiexec || true)}"
[ -n "$mpiexec_bin" ] || { echo "$0: no mpiexec.hydra/mpiexec on PATH" >&2; exit 2; }
dry=""; [ "${CPUDIST_DRY_RUN:-0}" = 1 ] && dry="--dry-run"
exec "$py" -m cpudist.cli launch --mpirun "$mpiexec_bin" $dry "$@"
