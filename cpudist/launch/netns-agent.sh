#!/bin/sh
# MPI launch agent for fake multi-node runs on one machine (cpudist.launch.netns,
# `cpudist fake-cluster`).
#
# MPI calls its remote-shell agent like ssh:
#   netns-agent.sh [ssh options] HOST COMMAND...
# and this runs COMMAND inside the network namespace named HOST, in a fresh UTS namespace whose
# hostname is HOST, so each fake node looks like its own machine (its own hostname, its own
# interfaces) while sharing this machine's files and CPUs.
#
#   Open MPI: mpirun --mca plm_rsh_agent /path/netns-agent.sh --hostfile H ...
#   MPICH/Intel MPI (hydra): mpiexec -launcher ssh -launcher-exec /path/netns-agent.sh -f H ...
#     (MPICH also needs -genv UCX_TLS tcp,self to really use the veth)
#
# Run mpirun itself inside the first namespace (the root namespace has no link to the fake nodes).
# COMMAND is joined into one string and run by sh, exactly as ssh runs a remote command.
# Needs root, iproute2 (ip) and util-linux (unshare).
while [ $# -gt 0 ]; do
  case "$1" in
    # ssh options MPI may pass: the flag-only ones, then those that take a value.
    -x|-n|-q|-T|-t) shift ;;
    -o|-p|-l) shift 2 ;;
    *) break ;;
  esac
done
host="$1"; shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"
