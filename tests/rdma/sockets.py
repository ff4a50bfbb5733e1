"""rdmasock sockets over the `rdma` transport, inside the Soft-RoCE VM (run by run_inner.py).

    sockets.py two_hosts        Python API between namespaces rs-h1 and rs-h2 (RDMASOCK_PEERS):
                                transport rdma on both sides (never shm), 64 B ping-pong,
                                a random-size stream each way with SHA-256, EOF both ways,
                                RoCE packets counted on the veth
    sockets.py qp_error         the sender's QP forced to ERR mid-stream (one namespace): the
                                stream goes on over TCP, complete, both sides say rdma_failed
    sockets.py qp_error_at_answer  the same, the QP failing as the handshake ends (its C
                                connection attached, the preamble not yet over)
    sockets.py link_down        the RoCE link of rs-h1 goes down mid-stream (two hosts; TCP
                                stays): likewise
    sockets.py qp_error_duplex  an echo server and a client that sends and receives in two
                                threads; the client's QP forced to ERR mid-stream: everything
                                echoed back exactly, over TCP after the failure
    sockets.py bad_resync       bad input on the fallback path, written raw on the peer's TCP
                                socket: garbage doorbell byte, corrupt RESYNC frame, a resume
                                offset past what was delivered, the stream ending inside the
                                frame or inside the resent bytes (each a clear EPROTO, data
                                before it intact); and a well-formed frame from this "second
                                implementation" (docs/PROTOCOL.md 9.10) is followed exactly
    sockets.py dead_peer        rs-h1 loses every link while rs-h2 waits in recv: keepalive
    sockets.py credit_probe     a sender blocked on a full ring; the RoCE link goes down while
                                the reader reads nothing: the sender's probe finds the link
                                dead and moves the connection to TCP within seconds; then the
                                reader reads, and the stream arrives complete
    sockets.py device_delete    `rdma link delete rxe-h1` mid-stream, then a new connection
    sockets.py fallback REASON  set-up failures (memlock, no device): plain TCP with REASON

Roles (`_server`, `_client`, `_streamer`, `_sink`) run in the namespaces; they print
RESULT {json} lines.  Every wait is bounded; children are stopped by PID."""
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from common import recv_exact  # noqa: E402

PY = sys.executable
PORT = 18700


def result(**kv):
    print("RESULT " + json.dumps(kv, sort_keys=True), flush=True)


def log(msg):
    print("[sockets] " + msg, flush=True)


def prng_stream(seed, n):
    return random.Random(seed).randbytes(n)


def send_random_writes(s, blob, seed):
    rnd, i = random.Random(seed), 0
    while i < len(blob):
        n = rnd.choice((1, 7, 64, 500, 4096, 65536, 300000))
        s.sendall(blob[i:i + n])
        i += n


# ---------------------------------------------------------------- roles (in a namespace)
def role_server(bind, port):
    import rdmasock
    srv = rdmasock.create_server((bind, port))
    print("LISTENING", flush=True)
    c, _ = srv.accept()
    c.settimeout(60)
    n = int.from_bytes(recv_exact(c, 4), "big")
    out = {"role": "server", "transport": c.transport, "reason": c.fallback_reason}
    for _ in range(n):                                    # ping-pong: echo
        c.sendall(recv_exact(c, 64))
    size = int.from_bytes(recv_exact(c, 8), "big")       # client -> server stream
    h, got = hashlib.sha256(), 0
    while got < size:
        d = c.recv(min(1 << 20, size - got))
        if not d:
            break
        h.update(d)
        got += len(d)
    c.sendall(h.digest())
    blob = prng_stream(2, size)                           # server -> client stream
    send_random_writes(c, blob, 3)
    c.shutdown(1)
    out["eof"] = c.recv(10) == b""
    out["got"] = got
    c.close()
    srv.close()
    result(**out)


def role_client(host, port, n_ping, size):
    import rdmasock
    c = rdmasock.create_connection((host, port), timeout=60)
    c.sendall(n_ping.to_bytes(4, "big"))
    msg = b"p" * 64
    t0 = time.monotonic()
    for _ in range(n_ping):
        c.sendall(msg)
        assert recv_exact(c, 64) == msg
    out = {"role": "client", "transport": c.transport, "reason": c.fallback_reason,
           "pingpong_us": round((time.monotonic() - t0) / max(1, n_ping) * 1e6, 1)}
    blob = prng_stream(1, size)
    c.sendall(size.to_bytes(8, "big"))
    t0 = time.monotonic()
    send_random_writes(c, blob, 4)
    out["digest_ok"] = recv_exact(c, 32) == hashlib.sha256(blob).digest()
    out["up_mb_s"] = round(size / (time.monotonic() - t0) / 1e6, 1)
    want = prng_stream(2, size)
    got = bytearray()
    while True:
        d = c.recv(1 << 20)
        if not d:
            break
        got += d
    out["down_ok"] = bytes(got) == want
    c.close()
    result(**out)


def role_streamer(host, port, seconds):
    """Sends a seeded stream until an error or `seconds`; reports how it ended."""
    import rdmasock
    if os.environ.get("RDMASOCK_TEST_QP_ERR_AT_ANSWER"):
        force_qp_error_at_answer()
    c = rdmasock.create_connection((host, port), timeout=30)
    c.sendall(random.Random(7).randbytes(16384))
    out = {"role": "streamer"}
    print("CONNECTED", flush=True)
    after = os.environ.get("RDMASOCK_TEST_QP_ERR_AFTER")
    if after:
        force_qp_error_after(float(after), c)
    rnd, sent, end = random.Random(7), 16384, time.monotonic() + seconds
    rnd.randbytes(16384)
    try:
        while time.monotonic() < end:
            c.sendall(rnd.randbytes(16384))
            sent += 16384
        c.shutdown(1)
        out["ended"] = "clean"
        out["eof"] = c.recv(10) == b""
    except OSError as exc:
        out["ended"], out["errno"], out["error"] = "error", exc.errno, str(exc)
    out.update(sent=sent, transport=c.transport, reason=c.fallback_reason)
    c.close()
    result(**out)


def role_sink(bind, port):
    """Accepts one connection; checks what arrives is an exact prefix of the seeded stream."""
    import rdmasock
    srv = rdmasock.create_server((bind, port))
    print("LISTENING", flush=True)
    c, _ = srv.accept()
    c.settimeout(120)
    print("ACCEPTED", flush=True)
    rnd, got, ok = random.Random(7), 0, True
    pending = b""
    t0 = time.monotonic()
    out = {}
    try:
        while True:
            d = c.recv(1 << 20)
            if not d:
                out["ended"] = "eof"
                break
            pending += d
            while len(pending) >= 16384:
                ok = ok and pending[:16384] == rnd.randbytes(16384)
                pending = pending[16384:]
            got += len(d)
    except OSError as exc:
        out["ended"], out["errno"], out["error"] = "error", exc.errno, str(exc)
    if pending:
        ok = ok and pending == rnd.randbytes(16384)[:len(pending)]
    out.update(role="sink", transport=c.transport, reason=c.fallback_reason)
    out.update(got=got, prefix_ok=ok, seconds=round(time.monotonic() - t0, 1))
    c.close()
    srv.close()
    result(**out)


def force_qp_error_after(seconds, sock):
    """A QP can only be moved to ERR by its own process: a thread does it to ours, `seconds`
    after the connection is on its ring (a loaded host may answer the handshake late).
    Returns an event that cancels it."""
    cancel = threading.Event()

    def qp_to_error():
        from rdmasock import transport_rdma
        end = time.monotonic() + 60
        while sock.transport != "rdma" and time.monotonic() < end and not cancel.wait(0.01):
            pass
        if cancel.wait(seconds):
            return
        for side in list(transport_rdma._sides.values()):
            side.ep.force_error()
        print("QP_ERR", flush=True)
    threading.Thread(target=qp_to_error, daemon=True).start()
    return cancel


def force_qp_error_at_answer():
    """The QP moved to ERR the moment the handshake has set it up, before the connection
    carried a record (between attaching the C connection and ending the preamble)."""
    from rdmasock import transport_rdma, upgrade
    after_answer = upgrade.after_answer

    def failing_first(side, outcome, fd):
        for s in list(transport_rdma._sides.values()):
            s.ep.force_error()
        print("QP_ERR", flush=True)
        return after_answer(side, outcome, fd)
    upgrade.after_answer = failing_first


def role_echo_server(bind, port):
    """Echoes everything back until EOF, then closes."""
    import rdmasock
    srv = rdmasock.create_server((bind, port))
    print("LISTENING", flush=True)
    c, _ = srv.accept()
    c.settimeout(120)
    got, out = 0, {"role": "echo"}
    try:
        while True:
            d = c.recv(1 << 16)
            if not d:
                break
            c.sendall(d)
            got += len(d)
        c.shutdown(1)
        out["ended"] = "eof"
    except OSError as exc:
        out["ended"], out["errno"], out["error"] = "error", exc.errno, str(exc)
    out.update(got=got, transport=c.transport, reason=c.fallback_reason)
    c.close()
    srv.close()
    result(**out)


def role_duplex_client(host, port, seconds):
    """One thread sends a seeded stream of mixed-size writes, another reads the echo and
    compares; the QP is forced to ERR mid-stream."""
    import rdmasock
    c = rdmasock.create_connection((host, port), timeout=120)
    c.sendall(b"x" * 100)
    recv_exact(c, 100)
    print("CONNECTED", flush=True)
    qp_error = force_qp_error_after(float(os.environ.get("RDMASOCK_TEST_QP_ERR_AFTER", "2")), c)
    out = {"role": "duplex"}
    box = {"sent": 100}

    sizes = (1, 9, 200, 1500, 4096, 30000, 70000, 200000)

    def chunks():                       # the writes, in order (randbytes of a sum != sum of randbytes)
        rnd, data = random.Random(11), random.Random(12)
        while True:
            yield data.randbytes(rnd.choice(sizes))

    def sender():
        end = time.monotonic() + seconds
        try:
            for chunk in chunks():
                if time.monotonic() >= end:
                    break
                c.sendall(chunk)
                box["sent"] += len(chunk)
            c.shutdown(1)
        except OSError as exc:
            box["error"] = str(exc)
    t = threading.Thread(target=sender)
    t.start()
    want, pending, got, ok = chunks(), bytearray(), 0, True
    try:
        while True:
            d = c.recv(1 << 18)
            if not d:
                break
            while len(pending) < len(d):
                pending += next(want)
            ok = ok and d == pending[:len(d)]
            del pending[:len(d)]
            got += len(d)
        out["ended"] = "eof"
    except OSError as exc:
        out["ended"], out["errno"], out["error"] = "error", exc.errno, str(exc)
    t.join(60)
    qp_error.set()
    out.update(sent=box["sent"] - 100, got=got, echo_ok=ok, send_error=box.get("error"),
               transport=c.transport, reason=c.fallback_reason)
    c.close()
    result(**out)


def role_waiter(host, port):
    """Connects and waits in recv for data that never comes; reports how the wait ended."""
    import rdmasock
    c = rdmasock.create_connection((host, port), timeout=None)
    c.sendall(random.Random(7).randbytes(100))
    c.recv(0)                                             # the handshake is over after this
    out = {"role": "waiter", "transport": c.transport, "reason": c.fallback_reason}
    print("CONNECTED", flush=True)
    t0 = time.monotonic()
    try:
        d = c.recv(100)
        out["ended"] = "eof" if not d else "data"
    except OSError as exc:
        out["ended"], out["errno"], out["error"] = "error", exc.errno, str(exc)
    out["seconds"] = round(time.monotonic() - t0, 1)
    result(**out)


# More than the reader takes in while it does not read (its ring, and its holder's
# tcp_wmem maximum + tcp_rmem default, shim/rs_hold.c): the sender ends up blocked.
PROBE_TOTAL = 16 << 20


def role_filler(bind, port):
    """Accepts one connection and sends PROBE_TOTAL seeded bytes with one blocking sendall
    (in a thread); prints MOVED <CLOCK_MONOTONIC> as soon as the connection is on TCP."""
    import rdmasock
    srv = rdmasock.create_server((bind, port))
    print("LISTENING", flush=True)
    c, _ = srv.accept()
    c.recv(1)                                             # the handshake is over after this
    out = {"role": "filler", "transport_before": c.transport}
    print("ACCEPTED", flush=True)

    def send():
        try:
            c.sendall(random.Random(7).randbytes(PROBE_TOTAL))
            c.shutdown(1)
            out["ended"] = "clean"
        except OSError as exc:
            out["ended"], out["errno"], out["error"] = "error", exc.errno, str(exc)
    t = threading.Thread(target=send)
    t.start()
    end = time.monotonic() + 120
    while t.is_alive() and c.transport != "tcp" and time.monotonic() < end:
        time.sleep(0.05)
    if c.transport == "tcp":
        print("MOVED %.3f" % time.monotonic(), flush=True)
    t.join(120)
    out.update(transport=c.transport, reason=c.fallback_reason)
    c.close()
    srv.close()
    result(**out)


def role_lazy_reader(host, port, done):
    """Connects and reads nothing until the file `done` exists; then reads to EOF and
    checks the stream."""
    import rdmasock
    c = rdmasock.create_connection((host, port), timeout=None)
    c.sendall(b"x")
    c.recv(0)
    print("CONNECTED", flush=True)

    def wait_file(path):
        end = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.05)
    got = bytearray()
    wait_file(done)
    c.settimeout(60)
    out = {"role": "lazy_reader"}
    try:
        while True:
            d = c.recv(1 << 20)
            if not d:
                break
            got += d
        out["ended"] = "eof"
    except OSError as exc:
        out["ended"], out["errno"], out["error"] = "error", exc.errno, str(exc)
    out.update(got=len(got), stream_ok=bytes(got) == random.Random(7).randbytes(PROBE_TOTAL),
               transport=c.transport, reason=c.fallback_reason)
    c.close()
    result(**out)


def case_credit_probe():
    ip1 = os.environ["SOFTROCE_H1_IP"]
    done = "/tmp/rs-credit-probe.done"
    if os.path.exists(done):
        os.unlink(done)
    srv = Proc(in_ns("1", "_filler", ip1, PORT + 4), ns_env("1"))
    if not srv.wait_line("LISTENING", 30):
        srv.finish(5)
        return False
    rd = Proc(in_ns("2", "_lazy_reader", ip1, PORT + 4, done), ns_env("2"))
    try:
        ok = check(rd.wait_line("CONNECTED", 60) and srv.wait_line("ACCEPTED", 30), "connected")
        time.sleep(2)                                     # the filler fills the ring and waits for credit
        log("ip link set rs-roce1 down (RoCE path of rs-h1; TCP path stays up)")
        subprocess.run(["ip", "link", "set", "rs-roce1", "down"], check=True)
        t_down = time.monotonic()
        # probe interval (1 s) + READ timeout (RDMASOCK_RDMA_TIMEOUT, 5 s) + slack for the VM
        moved = srv.wait_line("MOVED", 30)
        line = [l for l in srv.lines if l.startswith("MOVED ")]
        after = float(line[0].split()[1]) - t_down if line else None
        ok &= check(moved, "the blocked sender moved to TCP while the reader read nothing (%s s after "
                    "the link went down)" % (None if after is None else round(after, 1)))
    finally:
        open(done, "w").close()
        subprocess.run(["ip", "link", "set", "rs-roce1", "up"])
    r, s = rd.finish(120), srv.finish(60)
    ok &= check(r and s, "both roles reported")
    if not ok:
        return False
    ok &= check(s["transport_before"] == "rdma", "the connection was on rdma")
    ok &= check(s["ended"] == "clean" and r["ended"] == "eof" and r["stream_ok"],
                "the whole stream arrived exactly (%d of %d bytes)" % (r["got"], PROBE_TOTAL))
    ok &= check((s["transport"], s["reason"]) == (r["transport"], r["reason"]) == ("tcp", "rdma_failed"),
                "both sides tcp/rdma_failed (filler %s/%s, reader %s/%s)"
                % (s["transport"], s["reason"], r["transport"], r["reason"]))
    return ok


# ---------------------------------------------------------------- orchestration (root ns)
class Proc:
    def __init__(self, argv, env):
        argv = [str(a) for a in argv]
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines = []
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line.rstrip())

    def wait_line(self, prefix, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(l.startswith(prefix) for l in self.lines):
                return True
            if self.p.poll() is not None and not self.t.is_alive():
                return False
            time.sleep(0.05)
        return False

    def finish(self, timeout):
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)
        self.t.join(5)
        for l in self.lines:
            print("    " + l, flush=True)
        res = [json.loads(l[7:]) for l in self.lines if l.startswith("RESULT ")]
        return res[-1] if res else None


def ns_env(h, extra=None):
    e = dict(os.environ)
    other = "2" if h == "1" else "1"
    e.update(RDMASOCK_TRANSPORTS="rdma", RDMASOCK_RDMA_DEVICE=os.environ["SOFTROCE_H%s_DEV" % h],
             RDMASOCK_PEERS=os.environ["SOFTROCE_H%s_IP" % other])
    e.update(extra or {})
    return e


def in_ns(h, *args):
    return ["ip", "netns", "exec", os.environ["SOFTROCE_H%s_NS" % h], PY, __file__] + [str(a) for a in args]


def roce_rx():
    with open("/sys/class/net/rs-roce2/statistics/rx_packets") as f:
        return int(f.read())


def check(cond, what):
    log(("ok   " if cond else "FAIL ") + what)
    return bool(cond)


def case_two_hosts():
    ip1 = os.environ["SOFTROCE_H1_IP"]
    before = roce_rx()
    srv = Proc(in_ns("1", "_server", ip1, PORT), ns_env("1"))
    if not srv.wait_line("LISTENING", 30):
        srv.finish(5)
        return False
    cli = Proc(in_ns("2", "_client", ip1, PORT, 2000, 3 << 20), ns_env("2"))
    c, s = cli.finish(240), srv.finish(60)
    crossed = roce_rx() - before
    ok = check(c and s, "both roles reported")
    if not ok:
        return False
    ok &= check(c["transport"] == s["transport"] == "rdma", "transport rdma on both sides (%s/%s, %s/%s)"
                % (c["transport"], c["reason"], s["transport"], s["reason"]))
    ok &= check(c["digest_ok"] and c["down_ok"] and s["eof"], "streams intact both ways, EOF seen")
    ok &= check(crossed > 1000, "%d RoCE packets crossed rs-roce1 -> rs-roce2" % crossed)
    log("ping-pong %.1f us per round trip, upload %.1f MB/s" % (c["pingpong_us"], c["up_mb_s"]))
    return ok


def _stream_fault(two_hosts, action, expect="complete", settle=3.0, seconds=12):
    """A streamer sends to a sink; `action()` runs mid-stream.  Checks the sink saw an exact
    prefix of the stream and how each side ended: expect "complete" (on rdma throughout),
    "fallback" (complete, and both sides now report tcp with reason rdma_failed) or
    "error" (both sides failed with an rdmasock error)."""
    if two_hosts:
        ip1 = os.environ["SOFTROCE_H1_IP"]
        sink = Proc(in_ns("1", "_sink", ip1, PORT), ns_env("1"))
        start = lambda: Proc(in_ns("2", "_streamer", ip1, PORT, seconds), ns_env("2"))
    else:
        env = dict(os.environ, RDMASOCK_TRANSPORTS="rdma", RDMASOCK_RDMA_DEVICE=os.environ.get("SOFTROCE_DEVICE", ""))
        sink = Proc([PY, __file__, "_sink", "127.0.0.1", PORT], env)
        start = lambda: Proc([PY, __file__, "_streamer", "127.0.0.1", PORT, seconds], env)
    if not sink.wait_line("LISTENING", 30):
        sink.finish(5)
        return False
    st = start()
    ok = check(st.wait_line("CONNECTED", 60), "streamer connected")
    time.sleep(settle)
    info = action(st) if ok else None
    a, b = st.finish(seconds + 60), sink.finish(60)
    ok &= check(a and b, "both roles reported")
    if not ok:
        return False
    want = ("tcp", "rdma_failed") if expect == "fallback" else ("rdma", None)
    ok &= check((a["transport"], a["reason"]) == (b["transport"], b["reason"]) == want,
                "transport and reason %s on both sides (streamer %s/%s, sink %s/%s)"
                % (want, a["transport"], a["reason"], b["transport"], b["reason"]))
    # `sent` counts whole sendall calls: the one that failed may have delivered part of its 16 KiB
    ok &= check(b["prefix_ok"] and b["got"] <= a["sent"] + 16384,
                "sink got an exact prefix: %d bytes, %d sent by completed calls" % (b["got"], a["sent"]))
    if expect == "error":
        ok &= check(a["ended"] == "error" and b["ended"] == "error",
                    "both sides ended with an error: streamer %s (%s) / sink %s (%s)"
                    % (a.get("errno"), a.get("error"), b.get("errno"), b.get("error")))
        ok &= check("rdmasock" in (a.get("error") or "") and "rdmasock" in (b.get("error") or ""),
                    "the errors say what failed")
    else:
        ok &= check(a["ended"] == "clean" and b["ended"] == "eof" and b["got"] == a["sent"],
                    "stream complete: %d bytes, clean end" % b["got"])
    return ok, info


def case_qp_error_duplex():
    env = dict(os.environ, RDMASOCK_TRANSPORTS="rdma", RDMASOCK_RDMA_DEVICE=os.environ.get("SOFTROCE_DEVICE", ""),
               RDMASOCK_TEST_QP_ERR_AFTER="2")
    srv = Proc([PY, __file__, "_echo", "127.0.0.1", PORT + 3], env)
    if not srv.wait_line("LISTENING", 30):
        srv.finish(5)
        return False
    cli = Proc([PY, __file__, "_duplex", "127.0.0.1", PORT + 3, 8], env)
    c, s = cli.finish(150), srv.finish(60)
    ok = check(c and s, "both roles reported")
    if not ok:
        return False
    ok &= check(any(l == "QP_ERR" for l in cli.lines), "the client's QP was forced to ERR mid-stream")
    ok &= check(c["ended"] == "eof" and s["ended"] == "eof" and not c["send_error"],
                "both ended cleanly (client %s %s, echo %s %s)" % (c["ended"], c.get("error") or c["send_error"] or "",
                                                                   s["ended"], s.get("error", "")))
    ok &= check(c["echo_ok"] and c["got"] == c["sent"] == s["got"] - 100,
                "every byte echoed back exactly once, in order: sent %d, echoed %d, received %d"
                % (c["sent"], s["got"] - 100, c["got"]))
    ok &= check((c["transport"], c["reason"]) == (s["transport"], s["reason"]) == ("tcp", "rdma_failed"),
                "both sides now tcp with reason rdma_failed (%s/%s, %s/%s)"
                % (c["transport"], c["reason"], s["transport"], s["reason"]))
    return ok


def _resync_check(salt, resume):
    """The RESYNC frame's check word: rs_footer(salt, resume, 0xE5E5E5E5) (PROTOCOL.md 9.10)."""
    m = (1 << 64) - 1
    lw = 0xE5E5E5E5
    x = salt ^ ((resume * 0x9E3779B97F4A7C15) & m) ^ ((lw << 32) | lw)
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & m
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & m
    x ^= x >> 33
    f = (x & 0xFFFFFFFF) ^ (x >> 32)
    return f or 0x5A5A5A5A


def resync_frame(salt, resume, check=None):
    c = _resync_check(salt, resume) if check is None else check
    return bytes([0xE5, 1, 0, 0]) + c.to_bytes(4, "little") + resume.to_bytes(8, "little")


def _rdma_pair():
    """A connected pair of rdmasock sockets over rdma on loopback: (raw writer side, reader)."""
    import rdmasock
    srv = rdmasock.create_server(("127.0.0.1", 0))
    box = {}
    t = threading.Thread(target=lambda: box.update(s=srv.accept()[0]))
    t.start()
    a = rdmasock.create_connection(srv.getsockname(), timeout=30)
    t.join(30)
    srv.close()
    b = box["s"]
    b.settimeout(20)
    return a, b


def case_bad_resync():
    """Each sub-case: A sends 3000 bytes over rdma, B reads them all, then bytes written raw on
    A's TCP socket (past rdmasock, as a broken or foreign peer would) reach B's doorbell
    channel.  B must report a clear EPROTO (or, for the well-formed frame, go on exactly)."""
    os.environ.update(RDMASOCK_TRANSPORTS="rdma", RDMASOCK_RDMA_DEVICE=os.environ.get("SOFTROCE_DEVICE", ""))
    import rdmasock
    head = random.Random(5).randbytes(3000)
    ok = True

    def run(name, raw, expect, then_shut=False):
        nonlocal ok
        a, b = _rdma_pair()
        try:
            good = a.transport == b.transport == "rdma"
            a.sendall(head)
            good &= recv_exact(b, len(head)) == head
            salt, delivered = b._conn.salt, b._conn.rx.bytes
            data = raw(salt, delivered)
            os.write(a.fileno(), data)
            if then_shut:
                _socket_shutdown_wr(a)
            try:
                got = b""
                while len(got) < 64:
                    d = b.recv(64 - len(got))
                    if not d:
                        break
                    got += d
                outcome = ("data", got)
            except OSError as exc:
                outcome = ("error", exc.errno, str(exc))
            if expect[0] == "data":
                good &= outcome[0] == "data" and outcome[1] == expect[1] and b.transport == "tcp" \
                    and b.fallback_reason == "rdma_failed"
            else:
                good &= outcome[0] == "error" and outcome[1] == 71 and expect[1] in outcome[2]
            ok &= check(good, "%s: %s" % (name, outcome if outcome[0] == "error" else ("data", len(outcome[1]))))
        finally:
            a.close()
            b.close()

    tail = b"after the resync: plain TCP from here on, 64 bytes exactly......."[:64]
    run("garbage doorbell byte", lambda salt, n: b"\xd7\x42", ("error", "garbage byte 0x42"))
    run("corrupt RESYNC frame", lambda salt, n: resync_frame(salt, n, check=0x12345678) + tail,
        ("error", "corrupt RESYNC frame"))
    run("resume offset past the delivered bytes", lambda salt, n: resync_frame(salt, n + 100) + tail,
        ("error", "resumes at byte %d, but 3000" % 3100))
    run("stream ends inside the frame", lambda salt, n: b"\xc7" + resync_frame(salt, n)[:5],
        ("error", "ended inside the peer's RESYNC frame (5 of 16"), then_shut=True)
    run("stream ends inside the resent bytes", lambda salt, n: resync_frame(salt, n - 1000) + head[2000:2400],
        ("error", "(600 still to come)"), then_shut=True)
    # A well-formed frame resuming 1000 bytes back: those are dropped, the tail follows exactly.
    run("well-formed frame from a second implementation",
        lambda salt, n: b"\xd7\xc7" + resync_frame(salt, n - 1000) + head[2000:] + tail, ("data", tail))
    return ok


def _socket_shutdown_wr(sock):
    import socket
    s = socket.socket(fileno=os.dup(sock.fileno()))
    try:
        s.shutdown(socket.SHUT_WR)
    finally:
        s.close()


def _streamer_qp_error(setting, value, seconds):
    """The streamer forces its own QP to ERR as `setting` (an environment variable) says."""
    os.environ[setting] = value
    try:
        res = _stream_fault(False, lambda st: None, expect="fallback", settle=0.5, seconds=seconds)
    finally:
        del os.environ[setting]
    return res[0] if isinstance(res, tuple) else res


def case_qp_error():
    # RDMASOCK_TEST_QP_ERR_AFTER seconds after the connection is on rdma
    return _streamer_qp_error("RDMASOCK_TEST_QP_ERR_AFTER", "2", 10)


def case_qp_error_at_answer():
    # as its handshake ends, while its writes still go as preamble frames
    return _streamer_qp_error("RDMASOCK_TEST_QP_ERR_AT_ANSWER", "1", 6)


def case_link_down():
    def down(st):
        log("ip link set rs-roce1 down (RoCE path of rs-h1; TCP path stays up)")
        subprocess.run(["ip", "link", "set", "rs-roce1", "down"], check=True)
    try:
        res = _stream_fault(True, down, expect="fallback")
    finally:
        subprocess.run(["ip", "link", "set", "rs-roce1", "up"])
    return res[0] if isinstance(res, tuple) else res


def case_device_delete():
    box = {}

    def delete(st):
        log("rdma link delete rxe-h1 (in the background: it waits for open contexts)")
        box["p"] = subprocess.Popen(["rdma", "link", "delete", "rxe-h1"])
        box["t0"] = time.monotonic()
    res = _stream_fault(True, delete, expect="complete", seconds=8)
    ok = res[0] if isinstance(res, tuple) else res
    p = box.get("p")
    if p is None:
        return False
    try:
        p.wait(30)
        ok &= check(p.returncode == 0, "the delete finished %.1f s after it began, once the connection closed"
                    % (time.monotonic() - box["t0"]))
    except subprocess.TimeoutExpired:
        p.kill()
        return check(False, "rdma link delete still blocked 30 s after the connection closed")
    # A new connection from rs-h1 finds no device: plain TCP with a reason, data intact.
    ip1 = os.environ["SOFTROCE_H1_IP"]
    srv = Proc(in_ns("1", "_server", ip1, PORT + 1), ns_env("1"))
    if not srv.wait_line("LISTENING", 30):
        srv.finish(5)
        return False
    cli = Proc(in_ns("2", "_client", ip1, PORT + 1, 50, 1 << 20), ns_env("2"))
    c, s = cli.finish(120), srv.finish(30)
    ok &= check(c and s and c["transport"] == s["transport"] == "tcp", "after the delete: plain TCP (%s)"
                % ((s or {}).get("reason"),))
    ok &= check(c and s and s["reason"] == "rdma_unavailable" and c["digest_ok"] and c["down_ok"],
                "server's reason rdma_unavailable, data intact")
    subprocess.run(["rdma", "link", "add", "rxe-h1", "type", "rxe", "netdev", "rs-roce1"])
    return ok


def case_dead_peer():
    ip1 = os.environ["SOFTROCE_H1_IP"]
    extra = {"RDMASOCK_KEEPALIVE": "1,1,2"}
    srv = Proc(in_ns("1", "_sink", ip1, PORT + 2), ns_env("1", extra))
    if not srv.wait_line("LISTENING", 30):
        srv.finish(5)
        return False
    w = Proc(in_ns("2", "_waiter", ip1, PORT + 2), ns_env("2", extra))
    ok = check(w.wait_line("CONNECTED", 60) and srv.wait_line("ACCEPTED", 30), "connected")
    time.sleep(1)
    log("rs-h1 loses every link (TCP veth in its namespace, RoCE veth): its process lives on")
    subprocess.run(["ip", "-n", os.environ["SOFTROCE_H1_NS"], "link", "set", "rs-ip1", "down"], check=True)
    subprocess.run(["ip", "link", "set", "rs-roce1", "down"], check=True)
    try:
        r = w.finish(40)
    finally:
        subprocess.run(["ip", "-n", os.environ["SOFTROCE_H1_NS"], "link", "set", "rs-ip1", "up"])
        subprocess.run(["ip", "link", "set", "rs-roce1", "up"])
        srv.p.kill()
        srv.finish(10)
    ok &= check(r is not None and r["transport"] == "rdma", "waiter was on rdma")
    ok &= check(r is not None and r["ended"] == "error" and r["errno"] == 110 and r["seconds"] < 30,
                "the waiting recv failed with ETIMEDOUT (keepalive) after %s s: %s"
                % ((r or {}).get("seconds"), (r or {}).get("error")))
    return ok


def case_fallback(reason):
    """Set-up failures: the connection stays plain TCP, says why, and carries data."""
    env = dict(os.environ, RDMASOCK_TRANSPORTS="rdma")
    env["RDMASOCK_RDMA_DEVICE"] = "no-such-dev" if reason == "rdma_unavailable" else os.environ.get("SOFTROCE_DEVICE", "")
    srv = Proc([PY, __file__, "_server", "127.0.0.1", PORT + 3], env)
    if not srv.wait_line("LISTENING", 30):
        srv.finish(5)
        return False
    argv = [PY, __file__, "_client", "127.0.0.1", PORT + 3, 20, 1 << 20]
    if reason == "memlock":
        # root keeps CAP_IPC_LOCK (the limit would not apply) unless it leaves the bounding set
        inner = "ulimit -l 64 && exec " + " ".join(str(a) for a in argv)
        argv = ["setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock", "sh", "-c", inner]
    c, s = Proc(argv, env).finish(120), srv.finish(30)
    ok = check(c and s, "both roles reported")
    if not ok:
        return False
    ok &= check(c["transport"] == "tcp" and c["reason"] == reason, "client: tcp, reason %s (%s)" % (c["reason"], reason))
    ok &= check(s["transport"] == "tcp", "server: tcp (%s)" % s["reason"])
    ok &= check(c["digest_ok"] and c["down_ok"] and s["eof"], "data intact both ways")
    return ok


def main():
    cmd = sys.argv[1]
    a = sys.argv[2:]
    if cmd == "_server":
        return role_server(a[0], int(a[1]))
    if cmd == "_client":
        return role_client(a[0], int(a[1]), int(a[2]), int(a[3]))
    if cmd == "_streamer":
        return role_streamer(a[0], int(a[1]), float(a[2]))
    if cmd == "_sink":
        return role_sink(a[0], int(a[1]))
    if cmd == "_waiter":
        return role_waiter(a[0], int(a[1]))
    if cmd == "_echo":
        return role_echo_server(a[0], int(a[1]))
    if cmd == "_filler":
        return role_filler(a[0], int(a[1]))
    if cmd == "_lazy_reader":
        return role_lazy_reader(a[0], int(a[1]), a[2])
    if cmd == "_duplex":
        return role_duplex_client(a[0], int(a[1]), float(a[2]))
    ok = {"two_hosts": case_two_hosts, "qp_error": case_qp_error, "qp_error_at_answer": case_qp_error_at_answer,
          "link_down": case_link_down,
          "qp_error_duplex": case_qp_error_duplex, "bad_resync": case_bad_resync,
          "dead_peer": case_dead_peer, "device_delete": case_device_delete,
          "credit_probe": case_credit_probe}[cmd]() if cmd != "fallback" \
        else case_fallback(a[0])
    log("%s %s" % (cmd, "PASS" if ok else "FAIL"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
