#!/bin/sh
# Guest side of `run.sh --topology lo`: Soft-RoCE device rxe0 on the loopback, then exec CMD.
# GID index 0 is the link-local IPv6 one (fe80::...), index 1 is ::ffff:127.0.0.1 (RoCE v2).
set -e
modprobe rdma_rxe
ip link set lo up
rdma link add rxe0 type rxe netdev lo
export SOFTROCE_DEVICE=rxe0
exec "$@"
