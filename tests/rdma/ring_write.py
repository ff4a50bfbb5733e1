#!/usr/bin/env python3
"""One side of the ring test: PARAMS exchange over TCP (rdmasock.rdma_setup), then the client
RDMA-WRITEs COUNT framed messages into the server's ring, one WRITE per message (inline when
small, selective signaling), the server verifies every message (sequence, footer, content)
and returns credit by RDMA WRITE into the client's credit word; a digest over TCP closes it.

    ring_write.py server --bind ADDR --port PORT [--count N] [--ring BYTES]
    ring_write.py client --connect ADDR --port PORT [--count N] [--ring BYTES]

Device/port/GID: RDMASOCK_RDMA_DEVICE / _PORT / _GID_INDEX, else rdmasock.devices.choose().
Exit status 0 and a last line "PASS ..." when everything matched."""
import argparse
import sys
import time

import common
from common import Buffer, log
from rdmasock import rdma_setup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("server", "client"))
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--connect", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--count", type=int, default=1500)
    ap.add_argument("--ring", type=int, default=1 << 15)
    ap.add_argument("--max-size", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=4)
    a = ap.parse_args()

    ep = rdma_setup.Endpoint()
    log("%s on %s port %d GID %d (%s), max_inline %d" % (
        a.role, ep.choice.device, ep.choice.port, ep.choice.gid_index,
        rdma_setup.devices.gid_pretty(ep.choice.gid), ep.max_inline))
    lens = common.sizes(a.count, a.seed, a.max_size)
    if a.role == "server":
        ring = Buffer(a.ring)
        csrc = Buffer(4096)
        ep.register_ring(ring.addr, ring.size)
        ep.register_source(csrc.addr, csrc.size)
        ls = common.listen(a.bind, a.port)
        sock, peer = ls.accept()
        common.exchange(ep, sock, server=True)
        rx = common.RingReceiver(ep, ring, csrc, a.ring)
        got = []
        t0 = time.perf_counter()
        for seq, n in enumerate(lens):
            data = rx.recv()
            if data != common.payload(seq, n):
                raise AssertionError("message %d: %d bytes differ from the expected %d" % (seq, len(data), n))
            got.append(data)
        rx._credit(force=True)
        dt = time.perf_counter() - t0
        theirs = common.recv_exact(sock, 64).decode()
        ours = common.digest(got)
        sock.sendall(b"OK" if theirs == ours else b"NO")
        assert theirs == ours, "digest mismatch"
        assert ep.qp_state() == 3, "QP left RTS"
        log("PASS server: %d messages, %d bytes verified in %.2f s, ring %d B wrapped %d times"
            % (len(got), sum(lens), dt, a.ring, rx.head // a.ring))
    else:
        src = Buffer(a.ring)
        credit = Buffer(4096)
        ep.register_source(src.addr, src.size)
        ep.register_credit(credit.addr, 8)
        sock = common.connect(a.connect, a.port)
        common.exchange(ep, sock, server=False)
        tx = common.RingSender(ep, a.ring, src, credit)
        t0 = time.perf_counter()
        for seq, n in enumerate(lens):
            tx.send(common.payload(seq, n))
        tx.flush()
        dt = time.perf_counter() - t0
        sock.sendall(common.digest(common.payload(s, n) for s, n in enumerate(lens)).encode())
        verdict = common.recv_exact(sock, 2)
        assert verdict == b"OK", verdict
        log("PASS client: %d messages in %.2f s (%.0f msg/s), %d inline, %d credit waits, %d posts"
            % (a.count, dt, a.count / dt, tx.inline_posts, tx.credit_waits, tx.posted))
    ep.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
