"""No new deadlock: programs that write before they read work as they do over TCP.

tests/bulk_echo.py's client writes 1 or 4 MiB to an echo server before it reads a byte
(the server echoes as it reads, so both sides end up writing at once), or keeps 64 MiB
flowing while a second thread reads.  Over plain TCP the kernel's socket buffers absorb
the write-first case up to what they hold (on the 2-CPU test hosts 6 MiB always, 8 MiB
only sometimes: larger sizes deadlock over TCP too); a ring holds 256 KiB.  Every pairing of plain sockets, the preload
library and rdmasock.socket must deliver the echo byte for byte, and a connection with
rdmasock on both ends must really have been upgraded and stay so: a full ring spills to
the socket's buffers (docs/PROTOCOL.md 6.9).  Against a peer that does not spill, a ring
that stalls moves to TCP with reason ring_stalled, never fails.  Also a proxy relaying
both ways at once between such programs."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = os.path.join(HERE, "bulk_echo.py")
SYS_PY = "/usr/bin/python3"
MODES = ["plain", "preload", "api"]
MiB = 1 << 20
SMALL = 320 << 10                          # a 256 KiB ring's worth and a little more
MOVED = ("ring_stalled", "peer_moved")     # a full ring moved to TCP, by this side or its peer


def _cmd(mode, *args):
    if mode == "preload":
        return [sys.executable, "-m", "rdmasock", "run", "--", SYS_PY, PROG] + [a if a != "MODE" else "plain" for a in args]
    if mode == "api":
        return [sys.executable, PROG] + [a if a != "MODE" else "api" for a in args]
    return [SYS_PY, PROG] + [a if a != "MODE" else "plain" for a in args]


class Server:
    def __init__(self, mode, role, log, *extra, env=None):
        env = dict(os.environ if env is None else env, RDMASOCK_LOG_FILE=log)
        self.errors = log + ".stderr"            # the programs' own complaints, kept for a failure
        with open(self.errors, "wb") as err:
            self.p = subprocess.Popen(_cmd(mode, role, "MODE", *extra), stdout=subprocess.PIPE,
                                      stderr=err, env=env)
        line = self.p.stdout.readline().split()
        if not line or line[0] != b"port":
            self.stop()
            raise RuntimeError("%s did not start: %r %r" % (role, line, open(self.errors).read()))
        self.port = int(line[1])

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


def _client(mode, port, size, log, duplex=False, late=0):
    env = dict(os.environ, RDMASOCK_LOG_FILE=log)
    r = subprocess.run(_cmd(mode, "client", "MODE", str(port), str(size)) + (["duplex"] if duplex else []) +
                       (["late", str(late)] if late else []),
                       capture_output=True, env=env, timeout=200)
    assert not r.stderr, r.stderr
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"], out
    return out


def _check_upgraded(cmode, smode, out, logs, spill=True):
    """Both ends run rdmasock: the connection was upgraded.  Where both spill, a full ring
    lends the socket's buffers and the connection stays on its ring; where one does not,
    a ring that stalled moves to TCP (ring_stalled), and nothing else may end it."""
    if "plain" in (cmode, smode):
        return
    text = "".join(open(l).read() for l in logs if os.path.exists(l))
    if cmode == "api":
        assert out["transport"] == "shm" or (not spill and out["fallback_reason"] in MOVED), out
    assert "transport=shm" in text or cmode == smode == "api", text
    for line in text.splitlines():
        if "transport=tcp" in line:
            assert not spill and any("reason=%s " % r in line for r in MOVED), line


@pytest.mark.parametrize("size,duplex", [(1 * MiB, False), (4 * MiB, False), (64 * MiB, True)],
                         ids=["1MiB-write-first", "4MiB-write-first", "64MiB-duplex"])
@pytest.mark.parametrize("cmode", MODES)
@pytest.mark.parametrize("smode", MODES)
def test_echo_write_before_read(tmp_path, smode, cmode, size, duplex):
    # 4 MiB, not 8, written before reading: over plain TCP on this host (default tcp_wmem and
    # tcp_rmem) the 8 MiB echo already waits forever, client and server both writing
    slog, clog = str(tmp_path / "server.log"), str(tmp_path / "client.log")
    srv = Server(smode, "server", slog)
    try:
        out = _client(cmode, srv.port, size, clog, duplex)
    finally:
        srv.stop()
    assert out["received"] == size
    _check_upgraded(cmode, smode, out, [slog, clog])


@pytest.mark.parametrize("mode", ["preload", "api"])
def test_proxy_relaying_both_ways(tmp_path, mode):
    """client -> proxy -> echo server, all three the same kind: the proxy blocks in
    sendall on one side while the other keeps writing to it."""
    logs = [str(tmp_path / n) for n in ("server.log", "proxy.log", "client.log")]
    srv = Server(mode, "server", logs[0])
    try:
        prx = Server(mode, "proxy", logs[1], str(srv.port))
        try:
            out = _client(mode, prx.port, 4 * MiB, logs[2])
        finally:
            prx.stop()
    finally:
        srv.stop()
    assert out["received"] == 4 * MiB
    _check_upgraded(mode, mode, out, logs)


@pytest.mark.parametrize("smode,cmode", [("preload", "preload"), ("api", "api"), ("preload", "api")])
def test_small_echo_writes_spill(tmp_path, smode, cmode):
    """The echo server answers 4 KiB at a time while the client writes 4 MiB before it
    reads: every answer spills on its own SPILL record (a thousand of them, which the
    ring keeps room for), and the connection stays on its ring."""
    slog, clog = str(tmp_path / "server.log"), str(tmp_path / "client.log")
    srv = Server(smode, "server", slog, env=dict(os.environ, BULK_ECHO_CHUNK="4096"))
    try:
        out = _client(cmode, srv.port, 4 * MiB, clog)
    finally:
        srv.stop()
    assert out["received"] == 4 * MiB
    _check_upgraded(cmode, smode, out, [slog, clog])


@pytest.mark.parametrize("smode,cmode", [("preload", "api"), ("api", "preload"), ("preload", "preload")])
def test_moves_repeated_on_one_server(tmp_path, smode, cmode):
    """Against a server that does not spill (RDMASOCK_SPILL=0, as a peer of an older
    version), a full ring moves to TCP.  The move races the writer's own waits (a poll for
    room while a blocking send naps, credit arriving as the ring stalls): many connections
    in a row, each byte-exact.  Once, a doorbell byte written after the RESYNC frame
    reached the application."""
    slog = str(tmp_path / "server.log")
    srv = Server(smode, "server", slog, env=dict(os.environ, RDMASOCK_SPILL="0"))
    try:
        for i in range(8):
            clog = str(tmp_path / ("client%d.log" % i))
            out = _client(cmode, srv.port, 4 * MiB, clog)
            assert out["received"] == 4 * MiB
            _check_upgraded(cmode, smode, out, [clog], spill=False)
    finally:
        srv.stop()
    assert not open(srv.errors).read()             # no echo failed on the server's side either
    text = open(slog).read()
    assert any("reason=%s " % r in text for r in MOVED) or smode == "api"


@pytest.mark.parametrize("smode,cmode", [("preload", "preload"), ("api", "preload"), ("preload", "api"), ("api", "api")])
def test_server_talks_late_to_an_early_writer(tmp_path, smode, cmode):
    """The client writes a little more than its ring holds from the moment it connects (the
    first bytes as preamble frames: its handshake is not over), then half-closes and reads;
    the server, which does not spill, reads nothing for a second, then writes 4 MiB before
    it reads, and answers with the digest of what it read.  Both directions arrive byte
    for byte.  (While the server sleeps, the holder takes the client's records in, so the
    client's ring does not stall here; the case of a ring that moves while its preamble is
    unread, which once failed the server's send with EPIPE, is the C test
    pre_moved_behind_preamble.)"""
    slog = str(tmp_path / "server.log")
    srv = Server(smode, "late", slog, str(4 * MiB), "1", env=dict(os.environ, RDMASOCK_SPILL="0"))
    try:
        for i in range(3):
            clog = str(tmp_path / ("client%d.log" % i))
            out = _client(cmode, srv.port, SMALL, clog, late=4 * MiB)
            assert out["received"] == 4 * MiB + 32
            _check_upgraded(cmode, smode, out, [clog], spill=False)
    finally:
        srv.stop()
    assert not open(srv.errors).read()


def test_duplex_on_a_busy_cpu(tmp_path):
    """A reader thread and a writer thread on one socket, on CPUs kept busy by two other
    processes: the writer's credit doorbell can be read by the reader going idle, and the
    writer must still see the room (it once slept to its 120 s timeout, 1 run in ~5)."""
    hogs = [subprocess.Popen([SYS_PY, "-c", "while True: pass"]) for _ in range(2)]
    try:
        slog = str(tmp_path / "server.log")
        srv = Server("preload", "server", slog)
        try:
            for i in range(3):
                out = _client("preload", srv.port, 64 * MiB, str(tmp_path / ("client%d.log" % i)), duplex=True)
                assert out["received"] == 64 * MiB
        finally:
            srv.stop()
        assert "transport=shm" in open(slog).read()
    finally:
        for h in hogs:
            h.kill()
            h.wait(10)
