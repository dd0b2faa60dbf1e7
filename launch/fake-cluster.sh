#!/bin/sh
# A fake cluster on this machine, to rehearse multi-node launches (root, iproute2):
#
#   launch/fake-cluster.sh up 2        # node0 node1: namespaces on a private link, 10.250.0.1-2
#   launch/fake-cluster.sh list
#   launch/fake-cluster.sh down        # remove them, and end anything still running inside
#
# Each node has its own address and host name on interface cpd0 and shares this machine's files
# and cores; MPI reaches them through the launch agent cpudist ships (cpudist/launch/netns-agent.sh).
# docs/OPERATIONS.md shows a whole training run across the fake nodes.
exec "${CPUDIST_PYTHON:-python3}" -m cpudist.cli fake-cluster "$@"
