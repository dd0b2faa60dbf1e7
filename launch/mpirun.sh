#!/bin/sh
# Launch cpudist on N ranks with the MPI you have (Open MPI, MPICH or Intel MPI):
#
#   launch/mpirun.sh NP [HOSTFILE] [launch options] -- train configs/quickstart.yaml key=value ...
#
# This is `cpudist launch` (docs/OPERATIONS.md): it finds the MPI (the venv's own mpirun first,
# then PATH), binds each rank to its own cores, sets its threads and allocator, and converts
# HOSTFILE to that MPI's syntax. Set MPIRUN to pick the launcher (e.g. MPIRUN=mpiexec.hydra after
# `source /opt/intel/oneapi/setvars.sh`), CPUDIST_PYTHON to pick the Python (default: python3 on
# PATH, i.e. the active venv), CPUDIST_DRY_RUN=1 to print the mpirun command instead of running it.
# Other `cpudist launch` options (--threads-per-rank, --allocator, --mpi-arg) go before '--'.
set -eu
[ $# -ge 1 ] || { echo "usage: $0 NP [HOSTFILE] [launch options] -- COMMAND ..." >&2; exit 2; }
np="$1"; shift
case "${1:-}" in
  ''|-*) set -- -np "$np" "$@" ;;
  *) hf="$1"; shift; set -- -np "$np" --hostfile "$hf" "$@" ;;  # second word: a hostfile
esac
[ -n "${MPIRUN:-}" ] && set -- --mpirun "$MPIRUN" "$@"
[ "${CPUDIST_DRY_RUN:-0}" = 1 ] && set -- --dry-run "$@"
exec "${CPUDIST_PYTHON:-python3}" -m cpudist.cli launch "$@"
