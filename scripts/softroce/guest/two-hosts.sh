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
modprobe rdma_rxe
modprobe veth
ip link set lo up

# TCP/IP between the two hosts
ip netns add rs-h1
ip netns add rs-h2
ip link add rs-ip1 type veth peer name rs-ip2
for h in 1 2; do
  ip link set rs-ip$h netns rs-h$h
  ip -n rs-h$h link set lo up
  ip -n rs-h$h addr add 10.48.0.$h/24 dev rs-ip$h
  ip -n rs-h$h link set rs-ip$h up
done

# RoCE link in the initial namespace
ip link add rs-roce1 type veth peer name rs-roce2
sysctl -qw net.ipv4.conf.all.rp_filter=0
for h in 1 2; do
  o=$((3 - h))
  sysctl -qw net.ipv4.conf.rs-roce$h.rp_filter=0 net.ipv4.conf.rs-roce$h.accept_local=1
  ip addr add 10.47.0.$h/24 dev rs-roce$h
  ip link set rs-roce$h up
  ip rule add pref 10$h oif rs-roce$h lookup 10$h
  ip route add 10.47.0.$o dev rs-roce$h src 10.47.0.$h table 10$h
done
for h in 1 2; do
  o=$((3 - h))
  ip neigh replace 10.47.0.$o lladdr "$(cat /sys/class/net/rs-roce$o/address)" dev rs-roce$h nud permanent
done
ip rule add pref 1000 lookup local
ip rule del pref 0 lookup local
for h in 1 2; do rdma link add rxe-h$h type rxe netdev rs-roce$h; done

# The GID of an IPv4 address appears asynchronously: wait for index 1 (up to 10 s).
for h in 1 2; do
  n=0
  until grep -q ':ffff:0a2f:000'$h /sys/class/infiniband/rxe-h$h/ports/1/gids/1 2>/dev/null; do
    n=$((n + 1)); [ $n -lt 100 ] || { echo "two-hosts.sh: no RoCE GID on rxe-h$h" >&2; exit 1; }
    sleep 0.1
  done
  export SOFTROCE_H${h}_NS=rs-h$h SOFTROCE_H${h}_IP=10.48.0.$h SOFTROCE_H${h}_DEV=rxe-h$h \
         SOFTROCE_H${h}_GID_INDEX=1 SOFTROCE_H${h}_ROCE_IP=10.47.0.$h
done
exec "$@"
