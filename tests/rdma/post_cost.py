#!/usr/bin/env python3
"""What one RDMA WRITE post costs: pyverbs from Python versus libibverbs from C, on one QP
that rdmasock.rdma_setup set up (two endpoints in this process, connected to each other).

    post_cost.py [--count N] [--size BYTES] [--json FILE]
    post_cost.py --calibrate          # only the CPU yardstick (run it on the host too)

Variants, each with inline off and on, signaling every 16th WRITE:
  pyverbs-new     a new SGE + SendWR per post, then qp.post_send (the naive way; it also leaks
                  64 bytes per post in pyverbs 44)
  pyverbs-reuse   one SGE + SendWR, fields updated per post, qp.post_send
  endpoint        rdmasock.rdma_setup.Endpoint.post_write (bounds checks + pyverbs-reuse)
  cffi-call       one cffi call per post into C that calls ibv_post_send
  c-loop          the whole loop in C: ibv_post_send per message (what a C data path pays)
"post" is the time inside the post call only (Python timer overhead subtracted), "total" the
loop time per message including completion polling."""
import argparse
import json
import os
import sys
import time

import common
from common import Buffer
import native_post
from rdmasock import rdma_setup


def calibrate():
    """A fixed pure-Python workload (ms): the guest/host ratio scales the figures."""
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        x = 0
        for i in range(300000):
            x += i & 7
        dt = (time.perf_counter() - t0) * 1e3
        best = dt if best is None else min(best, dt)
    return best


def timer_overhead():
    pc = time.perf_counter_ns
    n = 20000
    t0 = pc()
    for _ in range(n):
        a = pc()
        b = pc()
    return (pc() - t0) / n / 2          # one timed region costs about two reads; keep half each side


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--calibrate", action="store_true")
    a = ap.parse_args()
    cal = calibrate()
    if a.calibrate:
        print(json.dumps({"python_loop_ms": round(cal, 2)}))
        return 0

    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR
    ffi, lib = native_post.load()
    A, B = rdma_setup.Endpoint(), rdma_setup.Endpoint()
    src, ring, dummy = Buffer(1 << 16), Buffer(1 << 16), Buffer(4096)
    A.register_source(src.addr, src.size)
    A.register_ring(dummy.addr, dummy.size)
    B.register_ring(ring.addr, ring.size)
    B.register_source(dummy.addr, dummy.size, name="source")
    pa, pb = A.local_params(), B.local_params()
    A.connect(pb)
    B.connect(pa)
    nat = A.native()
    qp, cq = nat["qp"], nat["send_cq"]
    lkey = nat["source"]["lkey"]
    rkey, raddr = A.peer.ring_rkey, A.peer.ring_addr
    size, N, SIG = a.size, a.count, 16
    window = A.sq_depth - 2
    ovh = timer_overhead()
    pc = time.perf_counter_ns
    wr_ids = ffi.new("uint64_t[16]")
    stats = ffi.new("int[16]")

    def reap_py(state, block):
        while True:
            n, wcs = A.cq.poll(num_entries=16)
            for w in wcs[:n]:
                assert w.status == 0, w.status
                state[0] = w.wr_id + 1
            if not block or n:
                return

    def reap_c(state, block):
        while True:
            n = lib.rs_poll(cq, 16, wr_ids, stats)
            for i in range(n):
                assert stats[i] == 0, stats[i]
                state[0] = wr_ids[i] + 1
            if not block or n:
                return

    def run(kind, inline):
        flags_base = e.IBV_SEND_INLINE if inline else 0
        sge = SGE(src.addr, size, lkey)
        wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=0)
        wr.sg_list = sge
        wr.set_wr_rdma(rkey, raddr)
        reap = reap_c if kind == "cffi-call" else reap_py
        state = [0]
        in_post = 0
        t_start = pc()
        for i in range(N):
            sig = i % SIG == SIG - 1 or i == N - 1
            flags = flags_base | (e.IBV_SEND_SIGNALED if sig else 0)
            off = (i * 64) & 0x7FFF
            while i - state[0] >= window:
                reap(state, True)
            if kind == "pyverbs-new":
                t0 = pc()
                w = SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                           sg=[SGE(src.addr + off, size, lkey)], send_flags=flags)
                w.set_wr_rdma(rkey, raddr + off)
                A.qp.post_send(w)
                in_post += pc() - t0
            elif kind == "pyverbs-reuse":
                t0 = pc()
                sge.addr = src.addr + off
                wr.wr_id = i
                wr.send_flags = flags
                wr.set_wr_rdma(rkey, raddr + off)
                A.qp.post_send(wr)
                in_post += pc() - t0
            elif kind == "endpoint":
                t0 = pc()
                A.post_write(off, size, off, inline=inline, signaled=sig, wr_id=i)
                in_post += pc() - t0
            elif kind == "cffi-call":
                t0 = pc()
                rc = lib.rs_post_write(qp, src.addr + off, size, lkey, raddr + off, rkey, flags, i)
                in_post += pc() - t0
                assert rc == 0, rc
            if sig:
                reap(state, False)
        while state[0] < N:
            reap(state, True)
        total = pc() - t_start
        sge.close()
        return (in_post - N * 2 * ovh) / N / 1e3, total / N / 1e3

    def run_c(inline):
        post_ns = ffi.new("uint64_t *")
        total_ns = ffi.new("uint64_t *")
        rc = lib.rs_write_loop(qp, cq, src.addr, lkey, raddr, rkey, size, int(inline), N, SIG, window,
                               post_ns, total_ns)
        assert rc == 0, rc
        return post_ns[0] / N / 1e3, total_ns[0] / N / 1e3

    results = {"count": N, "size": size, "signal_every": SIG, "max_inline": A.max_inline,
               "device": A.choice.device, "python_loop_ms": round(cal, 2),
               "timer_overhead_ns": round(ovh, 1), "us_per_post": {}}
    kinds = ["pyverbs-new", "pyverbs-reuse", "endpoint", "cffi-call", "c-loop"]
    samples = {}
    for rep in range(a.rounds + 1):          # round 0 warms up (imports, page faults)
        for inline in (False, True):
            for kind in kinds:
                post, total = run_c(inline) if kind == "c-loop" else run(kind, inline)
                if rep:
                    samples.setdefault("%s inline=%s" % (kind, "on" if inline else "off"), []).append((post, total))
    med = lambda xs: sorted(xs)[len(xs) // 2]
    for k, v in samples.items():
        results["us_per_post"][k] = {"post": round(med([p for p, _ in v]), 2),
                                     "total": round(med([t for _, t in v]), 2)}
    results["rounds"] = a.rounds
    # The data really arrived: the last WRITE of the C loop put src[0:size] at ring[0:size].
    assert bytes(ring.map[0:size]) == bytes(src.map[0:size])
    print("post cost, %d B RDMA WRITE, %d per variant, median of %d rounds, device %s, python loop %.1f ms"
          % (size, N, a.rounds, A.choice.device, cal))
    for k, v in results["us_per_post"].items():
        print("  %-26s post %8.2f us   total %8.2f us/msg" % (k, v["post"], v["total"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    A.close()
    B.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
