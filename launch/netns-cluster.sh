#!/bin/sh
# Fake cluster on one machine: N network namespaces ("nodes") joined by a private link, for testing
# multi-node launches without a cluster (needs root and iproute2).
#
#   launch/netns-cluster.sh up N [PREFIX]   create PREFIX0..PREFIX(N-1) (default PREFIX: node)
#   launch/netns-cluster.sh down [PREFIX]   remove them (and everything this script made for them)
#
# Node i gets address 10.250.0.(i+1)/24 on an interface named $IFNAME (default cpd0). Every node
# uses the SAME interface name, so one `--mca btl_tcp_if_include cpd0` / GLOO_SOCKET_IFNAME=cpd0
# (dist.interface=cpd0) is right on all of them. N=2: one veth pair, one end in each node. N>2:
# each node's veth ends on a bridge that lives in its own namespace PREFIXbr, so the machine's own
# (root) network namespace is never touched. Loopback is up in every node, and the node names
# resolve inside the nodes through /etc/netns/PREFIXi/hosts (which `ip netns exec` mounts).
#
# Start MPI inside the first node, with the launch agent next to this script:
#   ip netns exec node0 mpirun --mca plm_rsh_agent launch/netns-agent.sh --hostfile H ...
# The nodes share this machine's cores, which MPI cannot see: give the ranks OMP_WAIT_POLICY=PASSIVE
# (cpudist launch forwards it when set), or spinning OpenMP threads make every step ~10x slower.
set -eu
IFNAME="${IFNAME:-cpd0}"
SUBNET=10.250.0

die() { echo "netns-cluster.sh: $*" >&2; exit 2; }

nodes_of() {  # existing namespaces named PREFIX<digits>
  ip netns list | awk '{print $1}' | grep -E "^$1[0-9]+\$" || true
}

up() {
  n="$1"; prefix="$2"
  case "$n" in ''|*[!0-9]*) die "up N: N must be a number (got '$n')" ;; esac
  [ "$n" -ge 2 ] && [ "$n" -le 200 ] || die "up N: N must be between 2 and 200"
  [ -z "$(nodes_of "$prefix")" ] || die "namespaces ${prefix}* exist already: run 'down $prefix' first"
  hosts="127.0.0.1 localhost"
  i=0
  while [ "$i" -lt "$n" ]; do hosts="$hosts
$SUBNET.$((i + 1)) $prefix$i"; i=$((i + 1)); done
  i=0
  while [ "$i" -lt "$n" ]; do
    ns="$prefix$i"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    mkdir -p "/etc/netns/$ns"
    printf '%s\n' "$hosts" > "/etc/netns/$ns/hosts"
    echo "$ns" > "/etc/netns/$ns/hostname"
    i=$((i + 1))
  done
  # Temporary names in the root namespace are made unique per run (15 chars max for a link name).
  tag="$$"
  if [ "$n" -eq 2 ]; then
    ip link add "cpa$tag" type veth peer name "cpb$tag"
    ip link set "cpa$tag" netns "${prefix}0"
    ip link set "cpb$tag" netns "${prefix}1"
    ip -n "${prefix}0" link set "cpa$tag" name "$IFNAME"
    ip -n "${prefix}1" link set "cpb$tag" name "$IFNAME"
  else
    br="${prefix}br"
    ip netns add "$br"
    ip -n "$br" link set lo up
    ip -n "$br" link add br0 type bridge
    ip -n "$br" link set br0 up
    i=0
    while [ "$i" -lt "$n" ]; do
      ip link add "cpa$tag" type veth peer name "cpb$tag"
      ip link set "cpa$tag" netns "$prefix$i"
      ip link set "cpb$tag" netns "$br"
      ip -n "$prefix$i" link set "cpa$tag" name "$IFNAME"
      ip -n "$br" link set "cpb$tag" name "p$i" master br0 up
      i=$((i + 1))
    done
  fi
  i=0
  while [ "$i" -lt "$n" ]; do
    ip -n "$prefix$i" addr add "$SUBNET.$((i + 1))/24" dev "$IFNAME"
    ip -n "$prefix$i" link set "$IFNAME" up
    i=$((i + 1))
  done
  echo "up: $(nodes_of "$prefix" | tr '\n' ' ')on $IFNAME, $SUBNET.1-$SUBNET.$n"
}

down() {
  prefix="$1"
  for ns in $(nodes_of "$prefix") "${prefix}br"; do
    # Deleting a namespace deletes its veth ends (and so the peers in the other namespaces).
    if ip netns list | awk '{print $1}' | grep -qx "$ns"; then ip netns delete "$ns"; fi
    if [ -f "/etc/netns/$ns/hosts" ]; then
      rm -f "/etc/netns/$ns/hosts" "/etc/netns/$ns/hostname"
      rmdir "/etc/netns/$ns" 2>/dev/null || true
    fi
  done
  rmdir /etc/netns 2>/dev/null || true
}

[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces)"
command -v ip >/dev/null 2>&1 || die "needs iproute2 ('ip'): apt-get install iproute2"
case "${1:-}" in
  up) [ $# -ge 2 ] || die "usage: $0 up N [PREFIX]"; up "$2" "${3:-node}" ;;
  down) down "${2:-node}" ;;
  *) die "usage: $0 up N [PREFIX] | down [PREFIX]" ;;
esac
