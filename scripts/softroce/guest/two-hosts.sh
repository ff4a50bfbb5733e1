#!/bin/sh
# Guest side of `run.sh --topology two-hosts`: two "hosts" in one guest, then exec CMD (in the
# initial network namespace).  Each host is a network namespace with its own TCP/IP stack and
# its own abstract UNIX socket namespace (so rdmasock's same-host rendezvous cannot see the
# other side and `shm` is impossible between them), and each has its own Soft-RoCE device.
#
#   host  namespace  IP (TCP, in the namespace)   rdma device  RoCE netdev / IP (initial ns)
#   1     rs-h1      rs-ip1  10.48.0.1/24          rxe-h1       rs-roce1  10.47.0.1  GID ::ffff:10.47.0.1
#   2     rs-h2      rs-ip2  10.48.0.2/24          rxe-h2       rs-roce2  10.47.0.2  GID ::ffff:10.47.0.2
#
# The RoCE GID of each device is at index 1 (index 0 is the netdev's IPv6 link-local GID).
# Run each side with `ip netns exec rs-h1 CMD1` / `ip netns exec rs-h2 CMD2`, choosing the
# device with RDMASOCK_RDMA_DEVICE=rxe-h1 / rxe-h2.  All of this is exported to CMD as
# SOFTROCE_H{1,2}_{NS,IP,DEV,GID_INDEX,ROCE_IP}.
#
# Why the RoCE link is a second veth pair in the initial namespace: Linux 6.1's rdma_rxe opens
# its UDP port 4791 sockets and does its route lookups in the initial network namespace only
# (namespace support came in much later kernels), so an rxe device on a netdev inside a
# namespace sends nothing (the first WRITE completes with IBV_WC_LOC_QP_OP_ERR).  Both RoCE
# addresses are therefore local to the initial namespace; policy routing (lookup by output
# interface before the "local" table), static neighbour entries, rp_filter=0 and accept_local=1
# make their packets really cross the veth pair instead of being short-cut through `lo`.
set -e
modprobe -a rdma_rxe veth
# Every process start is slow under TCG: one `ip -batch` for the links, addresses and routes,
# sysctls through /proc.
ip -batch - <<EOB
link set lo up
netns add rs-h1
netns add rs-h2
link add rs-ip1 type veth peer name rs-ip2
link set rs-ip1 netns rs-h1
link set rs-ip2 netns rs-h2
link add rs-roce1 type veth peer name rs-roce2
addr add 10.47.0.1/24 dev rs-roce1
addr add 10.47.0.2/24 dev rs-roce2
link set rs-roce1 up
link set rs-roce2 up
rule add pref 101 oif rs-roce1 lookup 101
rule add pref 102 oif rs-roce2 lookup 102
route add 10.47.0.2 dev rs-roce1 src 10.47.0.1 table 101
route add 10.47.0.1 dev rs-roce2 src 10.47.0.2 table 102
rule add pref 1000 lookup local
rule del pref 0 lookup local
EOB
read -r mac1 < /sys/class/net/rs-roce1/address
read -r mac2 < /sys/class/net/rs-roce2/address
ip -batch - <<EOB
neigh replace 10.47.0.2 lladdr $mac2 dev rs-roce1 nud permanent
neigh replace 10.47.0.1 lladdr $mac1 dev rs-roce2 nud permanent
EOB
for h in 1 2; do
  ip -n rs-h$h -batch - <<EOB
link set lo up
addr add 10.48.0.$h/24 dev rs-ip$h
link set rs-ip$h up
EOB
done
echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter
for h in 1 2; do
  echo 0 > /proc/sys/net/ipv4/conf/rs-roce$h/rp_filter
  echo 1 > /proc/sys/net/ipv4/conf/rs-roce$h/accept_local
done
rdma link add rxe-h1 type rxe netdev rs-roce1
rdma link add rxe-h2 type rxe netdev rs-roce2

# The GID of an IPv4 address appears asynchronously: wait for index 1 (up to 10 s).
for h in 1 2; do
  n=0
  while :; do
    gid=
    read -r gid < /sys/class/infiniband/rxe-h$h/ports/1/gids/1 2>/dev/null || true
    case "$gid" in *:ffff:0a2f:000$h) break ;; esac
    n=$((n + 1)); [ $n -lt 100 ] || { echo "two-hosts.sh: no RoCE GID on rxe-h$h" >&2; exit 1; }
    sleep 0.1
  done
  export SOFTROCE_H${h}_NS=rs-h$h SOFTROCE_H${h}_IP=10.48.0.$h SOFTROCE_H${h}_DEV=rxe-h$h \
         SOFTROCE_H${h}_GID_INDEX=1 SOFTROCE_H${h}_ROCE_IP=10.47.0.$h
done
exec "$@"
