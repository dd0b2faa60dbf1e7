#!/bin/sh
# Open MPI launch of cpudist: N ranks, each bound to its own share of the cores.
#
#   launch/mpirun.sh NP [HOSTFILE] -- train configs/quickstart.yaml key=value ...
#
# HOSTFILE is optional (default: all ranks on this machine); either MPI syntax works, cpudist
# converts it. This is `cpudist launch` with the Open MPI from this venv (or PATH) made explicit;
# set CPUDIST_DRY_RUN=1 to print the mpirun command instead of running it, CPUDIST_PYTHON to pick
# the Python (default: python3 on PATH, i.e. the active venv) and MPIRUN to pick the mpirun.
# Other `cpudist launch` options (--threads-per-rank, --allocator, --mpi-arg) go before '--'.
set -eu
[ $# -ge 1 ] || { echo "usage: $0 NP [HOSTFILE] [launch options] -- COMMAND ..." >&2; exit 2; }
np="$1"; shift
case "${1:-}" in
  ''|-*) set -- -np "$np" "$@" ;;
  *) hf="$1"; shift; set -- -np "$np" --hostfile "$hf" "$@" ;;  # second word: a hostfile
esac
py="${CPUDIST_PYTHON:-python3}"
mpirun_bin="${MPIRUN:-$(dirname "$(command -v "$py")")/mpirun}"
[ -x "$mpirun_bin" ] || mpirun_bin="$(command -v mpirun || true)"
[ -n "$mpirun_bin" ] || { echo "$0: no mpirun found: pip install 'cpudist[mpi]'" >&2; exit 2; }
dry=""; [ "${CPUDIST_DRY_RUN:-0}" = 1 ] && dry="--dry-run"
exec "$py" -m cpudist.cli launch --mpirun "$mpirun_bin" $dry "$@"
