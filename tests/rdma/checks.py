#!/usr/bin/env python3
"""Quick single-process checks (one interpreter start is seconds under TCG, so they share one):

  devices  rdmasock.devices: the report sees the device, usable() is true, choose() picks an
           ACTIVE port with a RoCE v2 / IB GID (with RDMASOCK_RDMA_DEVICE honoured)
  params   PARAMS round trip and rejection of malformed input
  memlock  (only when asked) low RLIMIT_MEMLOCK without CAP_IPC_LOCK: refused with a reason
  native   a C helper (tests/rdma/native_post.py) posts RDMA WRITEs with libibverbs on the QP
           shim/rs_verbs.c created, through Endpoint.native(); the data arrives; the async event fd
           is found and quiet
"""
import os
import struct
import sys

import common
from common import Buffer, log
from rdmasock import devices, rdma_setup


def check_devices():
    rep = devices.rdma_report()
    print(devices.format_report(rep), flush=True)
    assert rep["pyverbs"]["available"], rep["pyverbs"]
    assert rep["usable"], rep["reason"]
    sel = rep["selected"]
    want = os.environ.get("RDMASOCK_RDMA_DEVICE")
    if want:
        assert sel["device"] == want, (sel, want)
    assert sel["gid_type"] in ("RoCE v2", "IB"), sel
    dev = next(d for d in rep["devices"] if d["name"] == sel["device"])
    port = next(p for p in dev["ports"] if p["port"] == sel["port"])
    assert port["state"] == "ACTIVE", port
    assert dev["max_inline_data"] and dev["max_inline_data"] >= 64, dev
    ok, why = devices.usable()
    assert ok, why
    # an impossible request is refused with a reason, not an exception from pyverbs
    try:
        devices.choose(device="no-such-device")
        raise AssertionError("choose() accepted a missing device")
    except devices.RdmaUnavailable as exc:
        assert exc.reason == "no_device", exc
    if os.environ.get("SOFTROCE_GUEST"):
        # rxe on lo: index 0 is the link-local GID, index 1 ::ffff:127.0.0.1 must win
        if sel["device"] == "rxe0":
            assert sel["gid_index"] == 1 and sel["gid"] == "::ffff:127.0.0.1", sel
    log("PASS devices")


def check_params():
    ep = rdma_setup.Endpoint()
    try:
        ring, cred = Buffer(8192), Buffer(4096)
        ep.register_ring(ring.addr, ring.size)
        ep.register_credit(cred.addr, 8)
        raw = ep.local_params()
        assert len(raw) == rdma_setup.PARAMS_SIZE == 88
        p = rdma_setup.Endpoint.parse_params(raw)
        assert p.qpn == ep.qp_num and p.psn == ep.psn and p.ring_addr == ring.addr
        assert p.ring_len == 8192 and p.credit_addr == cred.addr and p.credit_len == 8
        assert p.gid == bytes(ep.choice.gid) and p.ring_rkey == ep.region("ring").rkey
        for bad in (raw[:-1], b"XXXX" + raw[4:], raw[:4] + b"\x01" + raw[5:],
                    raw[:12] + struct.pack(">I", 1 << 24) + raw[16:]):
            try:
                rdma_setup.Endpoint.parse_params(bad)
                raise AssertionError("accepted bad params %r" % bad[:20])
            except rdma_setup.RdmaUnavailable as exc:
                assert exc.reason == "bad_params"
        # the QP allows remote write and read, no atomics; which memory a peer may read
        # or write is decided per region (the ring: write only; the counters: read only)
        e = __import__("pyverbs.enums", fromlist=["x"])
        flags = ep.qp_access_flags()
        assert flags == e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ, flags
    finally:
        ep.close()
    log("PASS params")


def check_native():
    import native_post
    ffi, lib = native_post.load()
    a, b = rdma_setup.Endpoint(), rdma_setup.Endpoint()
    src, ring, dummy = Buffer(1 << 16), Buffer(1 << 16), Buffer(4096)
    a.register_source(src.addr, src.size)
    a.register_ring(dummy.addr, dummy.size)
    b.register_ring(ring.addr, ring.size)
    b.register_source(dummy.addr, dummy.size)
    pa, pb = a.local_params(), b.local_params()
    a.connect(pb)
    b.connect(pa)
    nat = a.native()
    assert nat["qp_num"] == a.qp_num
    wr_ids, stats = ffi.new("uint64_t[16]"), ffi.new("int[16]")
    for i in range(64):
        off = i * 512
        src.map[off:off + 300] = bytes([i]) * 300
        flags = lib.RS_SIGNALED | (lib.RS_INLINE if i % 2 else 0)
        n = 200 if i % 2 else 300
        rc = lib.rs_post_write(nat["qp"], src.addr + off, n, nat["source"]["lkey"],
                               a.peer.ring_addr + off, a.peer.ring_rkey, flags, i)
        assert rc == 0, rc
        got = 0
        for _ in range(200000):
            got = lib.rs_poll(nat["send_cq"], 16, wr_ids, stats)
            if got:
                break
            os.sched_yield()
        assert got == 1 and stats[0] == 0 and wr_ids[0] == i, (got, stats[0], wr_ids[0])
        assert bytes(ring.map[off:off + n]) == bytes([i]) * n
    post_ns, total_ns = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    rc = lib.rs_write_loop(nat["qp"], nat["send_cq"], src.addr, nat["source"]["lkey"], a.peer.ring_addr,
                           a.peer.ring_rkey, 64, 1, 500, 16, 200, post_ns, total_ns)
    assert rc == 0, rc
    fd = a.async_fd()
    assert fd > 2 and a.async_events() == []
    log("native: 64 checked WRITEs + 500 looped, %.1f us per post in C; async fd %d" % (post_ns[0] / 500 / 1e3, fd))
    a.close()
    b.close()
    log("PASS native")


def check_memlock():
    """Run with a low RLIMIT_MEMLOCK and without CAP_IPC_LOCK (run_inner.py arranges it):
    usable() says no and why, and registering a ring fails with reason "memlock"."""
    ml = devices.memlock_limit()
    assert not ml["cap_ipc_lock"] and ml["soft"] is not None and ml["soft"] <= 128 * 1024, ml
    ok, why = devices.usable(ring_bytes=256 * 1024)
    assert not ok and "memlock" in why, why
    print("usable() ->", ok, why, flush=True)
    ep = rdma_setup.Endpoint()
    try:
        ring = Buffer(256 * 1024)
        try:
            ep.register_ring(ring.addr, ring.size)
            raise AssertionError("registered 256 KiB with memlock limit %s" % ml["soft"])
        except devices.RdmaUnavailable as exc:
            assert exc.reason == "memlock", exc
            print("register_ring ->", exc, flush=True)
    finally:
        ep.close()
    log("PASS memlock")


if __name__ == "__main__":
    which = sys.argv[1:] or ["devices", "params", "native"]
    for w in which:
        globals()["check_" + w]()
