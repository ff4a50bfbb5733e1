#!/usr/bin/env python3
"""Fault probes on Soft-RoCE: what a QP/CQ does when things break.  Each probe prints
observations as JSON ("OBSERVED {...}") and asserts only what rdmasock relies on
(docs/RDMA.md, "Failure behaviour").

    faults.py qp_error          QP forced to ERR; remote access error; peer QP destroyed
    faults.py device_events     netdev down/up, then `rdma link delete` of the device, under
                                a streaming QP (needs root; makes its own dummy netdev + rxe)
"""
import json
import os
import select
import subprocess
import sys
import time

import common
from common import Buffer, log
from rdmasock import rdma_setup, devices


def observed(name, **kv):
    print("OBSERVED " + json.dumps(dict(probe=name, **kv), sort_keys=True), flush=True)


def pair(device=None, gid_index=None):
    a = rdma_setup.Endpoint(device=device, gid_index=gid_index)
    b = rdma_setup.Endpoint(device=device, gid_index=gid_index)
    bufs = []
    for ep in (a, b):
        ring, src, credit = Buffer(1 << 16), Buffer(1 << 16), Buffer(4096)
        ep.register_ring(ring.addr, ring.size)
        ep.register_source(src.addr, src.size)
        ep.register_credit(credit.addr, 8)
        bufs.append((ring, src, credit))
    pa, pb = a.local_params(), b.local_params()
    a.connect(pb)
    b.connect(pa)
    return a, b, bufs


def outcome(ep, src_off, n, dst_off, timeout=30.0, **kw):
    """Post one signaled WRITE; return what happened: ('post_error', msg) or
    ('completion', status, seconds) or ('timeout', seconds)."""
    t0 = time.monotonic()
    try:
        ep.post_write(src_off, n, dst_off, signaled=True, **kw)
    except rdma_setup.RdmaError as exc:
        return ["post_error", str(exc)]
    while time.monotonic() - t0 < timeout:
        cs = ep.poll(4)
        if cs:
            return ["completion", cs[0].status, rdma_setup.wc_status_str(cs[0].status), round(time.monotonic() - t0, 3)]
        os.sched_yield()
    return ["timeout", timeout]


def qp_error():
    e = __import__("pyverbs.enums", fromlist=["x"])
    # 1. A's QP forced into the error state.
    a, b, bufs = pair()
    (ra, sa, _), (rb, sb, _) = bufs
    sa.map[0:64] = b"A" * 64
    first = outcome(a, 0, 64, 0)
    assert first[:2] == ["completion", 0], first
    a.force_error()
    sa.map[0:64] = b"B" * 64
    after = outcome(a, 0, 64, 4096, timeout=10)
    landed = bytes(rb.map[4096:4160]) != bytes(64)
    peer_state = b.qp_state()
    back = outcome(b, 0, 64, 0, timeout=60)        # B writes to A, whose QP is in ERR
    observed("qp_forced_error", post_after_error=after, write_landed=landed,
             a_state=a.qp_state(), peer_state_after=peer_state, peer_write_to_errored_qp=back,
             peer_state_end=b.qp_state())
    assert not landed, "a WRITE posted on a QP in ERR reached the peer"
    assert after[0] == "post_error" or (after[0] == "completion" and after[1] != 0), after
    a.close(); b.close()

    # 2. Remote access error: a WRITE beyond the peer's ring (bad rkey would do the same).
    a, b, bufs = pair()
    (ra, sa, _), (rb, sb, _) = bufs
    p = a.peer
    a._remote["ring"] = (p.ring_addr, p.ring_len + 8192, p.ring_rkey)   # lie about the length
    bad = outcome(a, 0, 64, p.ring_len + 4096, timeout=30)
    time.sleep(0.5)
    st_a, st_b = a.qp_state(), b.qp_state()
    back = outcome(b, 0, 64, 0, timeout=60)
    observed("remote_access_error", requester=bad, requester_state=st_a, responder_state=st_b,
             responder_write_back=back)
    assert bad[0] == "completion" and bad[1] == e.IBV_WC_REM_ACCESS_ERR, bad
    assert st_a == e.IBV_QPS_ERR, st_a
    a.close(); b.close()

    # 3. The peer QP disappears (process died / QP destroyed) without any message.
    a, b, bufs = pair()
    b.close()                                      # its QP, memory regions and PD
    dead = outcome(a, 0, 64, 0, timeout=120)
    observed("peer_qp_destroyed", requester=dead, requester_state=a.qp_state())
    assert dead[0] == "completion" and dead[1] in (e.IBV_WC_RETRY_EXC_ERR, e.IBV_WC_REM_INV_REQ_ERR,
                                                     e.IBV_WC_REM_OP_ERR, e.IBV_WC_RNR_RETRY_EXC_ERR), dead
    a.close(); b.close()
    log("PASS qp_error")


def _ensure_dummy_rxe(name="rxe-del", netdev="rs-dummy0", ip="10.49.0.1"):
    sh = lambda *c: subprocess.run(c, check=True, capture_output=True, text=True)
    subprocess.run(["modprobe", "dummy"], capture_output=True)
    sh("ip", "link", "add", netdev, "type", "dummy")
    sh("ip", "addr", "add", ip + "/24", "dev", netdev)
    sh("ip", "link", "set", netdev, "up")
    sh("rdma", "link", "add", name, "type", "rxe", "netdev", netdev)
    for _ in range(100):
        try:
            devices.choose(device=name)
            return
        except devices.RdmaUnavailable:
            time.sleep(0.1)
    raise RuntimeError("no GID on %s" % name)


def streamer(device):
    """Child: two endpoints on `device` (self-loopback), WRITE continuously, and report every
    async event and the first failure.  Commands on stdin: "close" releases everything."""
    a, b, bufs = pair(device=device)
    print("STREAMING", flush=True)
    n = 0
    failed = None
    t0 = time.monotonic()
    report = lambda **kv: print("CHILD " + json.dumps(dict(t=round(time.monotonic() - t0, 2), **kv)), flush=True)
    while time.monotonic() - t0 < 150:
        if failed is None:
            try:
                a.post_write((n * 64) % 32768, 64, (n * 64) % 32768, signaled=(n % 8 == 7), wr_id=n)
                n += 1
                bad = [c for c in a.poll(8) if c.status]
                if bad:
                    failed = ["completion_error", bad[0].status, rdma_setup.wc_status_str(bad[0].status)]
            except rdma_setup.RdmaError as exc:
                failed = ["post_error", str(exc)]
            if failed:
                report(failed=failed, writes=n, qp_state=_try(a.qp_state), port_state=_try(lambda: a.port_state()))
        try:
            evs = a.async_events()
        except Exception as exc:
            evs = ["async_events failed: %s" % exc]
        if evs:
            report(events=evs, writes=n, port_state=_try(lambda: a.port_state()), failed=failed)
        r, _, _ = select.select([sys.stdin], [], [], 0.002)
        if r:
            cmd = sys.stdin.readline().strip()
            if cmd == "status":
                report(writes=n, failed=failed, port_state=_try(lambda: a.port_state()))
            elif cmd == "reopen":                      # fresh QP pair on the same device
                a.close(); b.close()
                a, b, bufs = pair(device=device)
                failed = None
                report(reopened=True, writes=n)
            elif cmd in ("close", ""):
                break
    t1 = time.monotonic()
    a.close(); b.close()
    report(closed_in=round(time.monotonic() - t1, 2), writes=n)


def _try(fn):
    try:
        return fn()
    except Exception as exc:
        return "error: %s" % exc


def device_events():
    """Link down/up under a streaming QP, then `rdma link delete` of its device."""
    name, netdev = "rxe-del", "rs-dummy0"
    _ensure_dummy_rxe(name, netdev)
    child = subprocess.Popen([sys.executable, __file__, "_streamer", name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    lines = []
    t0 = time.monotonic()

    def collect(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            r, _, _ = select.select([child.stdout], [], [], 0.2)
            if r:
                line = child.stdout.readline()
                if not line:
                    return
                lines.append((round(time.monotonic() - t0, 2), line.strip()))

    def tell(cmd):
        child.stdin.write(cmd + "\n")
        child.stdin.flush()

    try:
        assert child.stdout.readline().startswith("STREAMING")
        collect(2)
        mark = lambda what: lines.append((round(time.monotonic() - t0, 2), "PARENT " + what))
        mark("ip link set %s down" % netdev)
        subprocess.run(["ip", "link", "set", netdev, "down"], check=True)
        collect(2)
        tell("status")
        collect(1)
        mark("ip link set %s up" % netdev)
        subprocess.run(["ip", "link", "set", netdev, "up"], check=True)
        collect(2)
        tell("status")
        collect(1)
        tell("reopen")
        collect(3)
        mark("rdma link delete %s" % name)
        t_del = time.monotonic()
        dele = subprocess.Popen(["rdma", "link", "delete", name], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        collect(5)
        blocked = dele.poll() is None
        mark("delete still running after 5 s: %s; telling the child to close" % blocked)
        tell("status")
        collect(1)
        tell("close")
        collect(2)
        try:
            out, _ = dele.communicate(timeout=60)
            del_rc, del_s = dele.returncode, round(time.monotonic() - t_del, 2)
        except subprocess.TimeoutExpired:
            dele.kill()
            out, del_rc, del_s = "", "still blocked after close", None
        rc_child = child.wait(30)
        observed("device_events", timeline=lines, delete_blocked_while_open=blocked, delete_rc=del_rc,
                 delete_output=out.strip(), delete_done_after_s=del_s, child_rc=rc_child,
                 device_gone=name not in devices._device_names())
        assert rc_child == 0 and del_rc == 0
        log("PASS device_events")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "_streamer":
        streamer(sys.argv[2])
    elif what == "qp_error":
        qp_error()
    elif what == "device_events":
        device_events()
    else:
        sys.exit(__doc__)
