"""Waking a shm receiver through a futex word of the segment (FUTEX_WAKE, docs/PROTOCOL.md
6.11): a blocking receive, or a library poll whose descriptors are all such connections,
sleeps on the word the producer raises with its next record instead of on a doorbell
byte.  The C tests (tests/c/test_ring.c word_*) cover lost wake-ups, a peer's death, a
shutdown and stray raises at the ring level; these cover the handshake's agreement, the
Python API's promise to kernel poll callers, and preloaded programs, with peers that do
and do not speak it."""
import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import recv_exact

ROUNDS = 2000


def _echo(s, rounds, size=64):
    for _ in range(rounds):
        s.sendall(recv_exact(s, size))


def _pingpong(c, rounds, size=64):
    for i in range(rounds):
        msg = bytes([i % 251]) * size
        c.sendall(msg)
        assert recv_exact(c, size) == msg, i


def test_api_receives_wake_through_the_word(pair, monkeypatch):
    """Both ends agree on FUTEX_WAKE; blocking receives (no spinning) sleep on the word, and
    none of those sleeps lasted until its window ran out (a lost wake-up would)."""
    from rdmasock import config
    monkeypatch.setenv("RDMASOCK_SPIN_US", "0")
    config.reload()
    c, s = pair()
    t = threading.Thread(target=_echo, args=(s, ROUNDS))
    t.start()
    _pingpong(c, ROUNDS)
    t.join(30)
    cs, ss = c.stats(), s.stats()
    assert cs["word_wake"] and ss["word_wake"]
    assert cs["word_sleeps"] + ss["word_sleeps"] > 0
    assert cs["word_timeouts"] + ss["word_timeouts"] == 0


def test_api_kernel_poll_after_a_word_wake(pair):
    """The Python API's program may wait in the kernel's select once recv returns: a receive
    woken through the word leaves the doorbell invariant (PROTOCOL 6.7) intact, so the next
    message makes the descriptor readable."""
    c, s = pair()
    for i in range(20):
        got = []
        t = threading.Thread(target=lambda: got.append(recv_exact(c, 8)))
        t.start()
        time.sleep(0.02)                        # c is asleep in recv
        s.sendall(b"first%03d" % i)
        t.join(10)
        assert got == [b"first%03d" % i]
        threading.Timer(0.05, s.sendall, (b"later%03d" % i,)).start()
        r, _, _ = select.select([c], [], [], 10)
        assert r == [c], "the next message never made the socket readable (round %d)" % i
        assert recv_exact(c, 8) == b"later%03d" % i
    assert c.stats()["word_sleeps"] > 0


def test_api_without_the_feature_sleeps_on_the_socket(pair, monkeypatch):
    """RDMASOCK_WORD_WAKE=0 (as a peer of an older version): the handshake agrees on none,
    nothing sleeps on the word, and the exchange is the same."""
    from rdmasock import config
    monkeypatch.setenv("RDMASOCK_WORD_WAKE", "0")
    config.reload()
    c, s = pair()
    t = threading.Thread(target=_echo, args=(s, 500))
    t.start()
    _pingpong(c, 500)
    t.join(30)
    assert c.transport == s.transport == "shm"
    assert not c.stats()["word_wake"] and not s.stats()["word_wake"]
    assert c.stats()["word_sleeps"] == s.stats()["word_sleeps"] == 0


def _warm(c, s):
    """One byte each way: both ends past the handshake, on their rings."""
    c.sendall(b"w")
    assert recv_exact(s, 1) == b"w"
    s.sendall(b"w")
    assert recv_exact(c, 1) == b"w"


def _asleep_in_recv(c, size, got, before):
    """A thread of c in a blocking recv(size), returned once it sleeps on the word."""
    t = threading.Thread(target=lambda: got.append(c.recv(size)))
    t.start()
    deadline = time.monotonic() + 10
    while c.stats()["word_sleeps"] == before and time.monotonic() < deadline:
        time.sleep(0.001)
    assert c.stats()["word_sleeps"] > before, "the receive never slept on the word"
    return t


def test_api_quiet_wake_sends_no_byte(pair, monkeypatch):
    """QUIET_WAKE (PROTOCOL 6.13): a message that a sleeping recv takes whole wakes it
    through the word with no doorbell byte; the message sent once recv has returned rings,
    so that a select in the kernel sees it."""
    from rdmasock import config
    monkeypatch.setenv("RDMASOCK_SPIN_US", "0")
    config.reload()
    c, s = pair()
    _warm(c, s)
    assert c.stats()["quiet_wake"] and s.stats()["quiet_wake"]
    for i in range(10):
        got = []
        t = _asleep_in_recv(c, 64, got, c.stats()["word_sleeps"])
        bells = s.stats()["doorbells_sent"]
        s.sendall(b"quiet%03d" % i)
        t.join(10)
        assert got == [b"quiet%03d" % i]
        assert s.stats()["doorbells_sent"] == bells, "a byte for a message the sleeping recv took whole"
        assert select.select([c], [], [], 0)[0] == [], "the socket is readable with nothing to read"
        s.sendall(b"loud%03d" % i)
        assert select.select([c], [], [], 10)[0] == [c], "a message after recv returned did not ring"
        assert recv_exact(c, 7) == b"loud%03d" % i


def test_api_quiet_wake_leaves_more_readable(pair, monkeypatch):
    """More arrives than the sleeping recv takes: what it leaves makes the socket readable."""
    from rdmasock import config
    monkeypatch.setenv("RDMASOCK_SPIN_US", "0")
    config.reload()
    c, s = pair()
    _warm(c, s)
    for i in range(10):
        got = []
        t = _asleep_in_recv(c, 4, got, c.stats()["word_sleeps"])
        s.sendall(b"%04d" % i + b"x" * 60)
        t.join(10)
        assert got == [b"%04d" % i]
        assert select.select([c], [], [], 10)[0] == [c], "60 bytes left and the socket not readable"
        assert recv_exact(c, 60) == b"x" * 60


def test_api_without_quiet_wake_rings(pair, monkeypatch):
    """RDMASOCK_QUIET_WAKE=0 (as a peer of an older version): not agreed; a sleeping recv is
    woken through the word and rung a byte too, and the exchange is the same."""
    from rdmasock import config
    monkeypatch.setenv("RDMASOCK_QUIET_WAKE", "0")
    monkeypatch.setenv("RDMASOCK_SPIN_US", "0")
    config.reload()
    c, s = pair()
    _warm(c, s)
    assert c.stats()["word_wake"] and not c.stats()["quiet_wake"] and not s.stats()["quiet_wake"]
    got = []
    t = _asleep_in_recv(c, 64, got, c.stats()["word_sleeps"])
    bells = s.stats()["doorbells_sent"]
    s.sendall(b"rung")
    t.join(10)
    assert got == [b"rung"]
    assert s.stats()["doorbells_sent"] == bells + 1


PEER = r"""
import select, socket, sys, time
mode, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def exact(s, n):
    b = b""
    while len(b) < n:
        d = s.recv(n - len(b))
        if not d:
            raise SystemExit("EOF after %d of %d" % (len(b), n))
        b += d
    return b
if mode == "server":
    srv = socket.create_server(("127.0.0.1", port))
    print("ready", flush=True)
    s, _ = srv.accept()
    for _ in range(rounds):
        s.sendall(exact(s, 64))
    s.sendall(b"bye")
    if len(sys.argv) > 4:                       # then wait to be killed
        time.sleep(60)
    exact(s, 3)
else:
    c = socket.create_connection(("127.0.0.1", port))
    p = select.poll()
    p.register(c, select.POLLIN)
    for i in range(rounds):
        msg = bytes([i % 251]) * 64
        c.sendall(msg)
        if i % 2:                               # half the waits in poll, half in recv
            assert p.poll(10000), "poll timed out"
        assert exact(c, 64) == msg, i
    assert exact(c, 3) == b"bye"
    if len(sys.argv) > 4:                       # the server dies while we wait in poll
        print("waiting", flush=True)
        t0 = time.monotonic()
        ev = p.poll(10000)
        assert ev, "poll timed out after the peer died"
        assert c.recv(16) == b"", "data after the peer died"
        print("eof after %.3f s" % (time.monotonic() - t0), flush=True)
    else:
        c.sendall(b"end")
    print("ok", flush=True)
"""


def _preloaded(tmp_path, role, port, rounds, env, *extra):
    prog = tmp_path / "peer.py"
    prog.write_text(PEER)
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "rdmasock", "run", "--", "/usr/bin/python3", str(prog),
           role, str(port), str(rounds)] + list(extra)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("server_word_wake", ["1", "0"])
def test_preloaded_pingpong_on_one_cpu(tmp_path, server_word_wake):
    """Two preloaded programs pinned to one CPU, waiting in recv and in poll: byte-exact
    with the feature on both sides, and with the server refusing it (then both sleep on
    the socket: the client's offer is answered without it)."""
    port = _free_port()
    log = str(tmp_path / "log")
    base = dict(os.environ, RDMASOCK_LOG_FILE=log)
    srv = _preloaded(tmp_path, "server", port, ROUNDS, dict(base, RDMASOCK_WORD_WAKE=server_word_wake))
    try:
        assert srv.stdout.readline().strip() == "ready"
        cli = _preloaded(tmp_path, "client", port, ROUNDS, base)
        out, err = cli.communicate(timeout=120)
        assert cli.returncode == 0 and out.strip() == "ok" and not err, out + err
        srv.wait(30)
        assert srv.returncode == 0, srv.stderr.read()
    finally:
        for p in (srv,):
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert open(log).read().count("transport=shm") == 2


def test_preloaded_poll_sees_a_dead_peer(tmp_path):
    """The server is killed while the client waits in poll, asleep on the word: nobody
    raises it, the kernel only closes the socket.  The word's 50 ms window ends and the
    socket tells: poll reports the descriptor and recv returns the end of the stream."""
    port = _free_port()
    env = dict(os.environ, RDMASOCK_LOG_FILE=str(tmp_path / "log"))
    srv = _preloaded(tmp_path, "server", port, 50, env, "die")
    cli = None
    try:
        assert srv.stdout.readline().strip() == "ready"
        cli = _preloaded(tmp_path, "client", port, 50, env, "die")
        assert cli.stdout.readline().strip() == "waiting"
        time.sleep(0.2)
        srv.kill()
        out, err = cli.communicate(timeout=30)
        assert cli.returncode == 0 and out.strip().endswith("ok") and not err, out + err
    finally:
        for p in (srv, cli):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


EDGE = r"""
import select, socket, sys, time
port = int(sys.argv[2])
if sys.argv[1] == "server":
    srv = socket.create_server(("127.0.0.1", port))
    print("ready", flush=True)
    s, _ = srv.accept()
    s.sendall(b"a" * 100)
    assert s.recv(2) == b"go"
    s.sendall(b"b" * 100)
    s.recv(1)
else:
    c = socket.create_connection(("127.0.0.1", port))
    ep = select.epoll()
    ep.register(c.fileno(), select.EPOLLIN | select.EPOLLET)
    assert ep.poll(10) == [(c.fileno(), select.EPOLLIN)]
    assert c.recv(10) == b"a" * 10                  # 90 bytes stay unread: no new edge
    t0 = time.process_time()
    assert ep.poll(0.3) == [], "an edge without new data"
    spent = time.process_time() - t0
    assert spent < 0.025, "the wait without a new edge burned %.3f s of CPU" % spent
    c.sendall(b"go")
    assert ep.poll(10) == [(c.fileno(), select.EPOLLIN)]
    got = b""
    while len(got) < 190:
        got += c.recv(4096)
    assert got == b"a" * 90 + b"b" * 100
    c.sendall(b".")
    print("ok", flush=True)
"""


def test_preloaded_edge_triggered_wait_sleeps(tmp_path):
    """An edge-triggered epoll on an upgraded socket whose data was reported but not all
    read: the wait sleeps (on the word) until new data comes, it does not spin."""
    prog = tmp_path / "edge.py"
    prog.write_text(EDGE)
    port = _free_port()
    env = dict(os.environ, RDMASOCK_LOG_FILE=str(tmp_path / "log"))
    run = [sys.executable, "-m", "rdmasock", "run", "--", "/usr/bin/python3", str(prog)]
    srv = subprocess.Popen(run + ["server", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env)
    try:
        assert srv.stdout.readline().strip() == "ready"
        cli = subprocess.run(run + ["client", str(port)], capture_output=True, text=True, timeout=60, env=env)
        assert cli.returncode == 0 and cli.stdout.strip() == "ok" and not cli.stderr, cli.stdout + cli.stderr
        srv.wait(30)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(10)
    assert open(tmp_path / "log").read().count("transport=shm") == 2
