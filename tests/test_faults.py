"""Faults: dead peers, full rings, bad handshakes, leftovers, third-user isolation."""
import errno
import glob
import json
import os
import pwd
import select
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

import rdmasock
from rdmasock import handshake as hs, rendezvous
from conftest import recv_all, recv_exact, wait_for


def test_peer_sigkilled_mid_stream_reader_sees_error(peers):
    srv = rdmasock.create_server(("127.0.0.1", 0))
    p = peers("stream-client", "rdmasock", srv.getsockname()[1], 1 << 30)
    s, _ = srv.accept()
    s.settimeout(20)
    recv_exact(s, 1 << 20)
    assert s.transport == "shm"
    p.proc.kill()
    t0 = time.monotonic()
    with pytest.raises((ConnectionResetError, EOFError)):
        while True:
            if not s.recv(1 << 20):
                raise EOFError
    assert time.monotonic() - t0 < 10
    s.close()
    srv.close()


def test_peer_sigkilled_writer_sees_error(peers):
    p = peers("echo-server", "rdmasock")
    c = rdmasock.create_connection(("127.0.0.1", p.port), timeout=20)
    c.sendall(b"x")
    assert recv_exact(c, 1) == b"x" and c.transport == "shm"
    p.proc.kill()
    t0 = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for _ in range(10000):              # the echo is gone: the ring fills, then EPIPE
            c.sendall(b"y" * 65536)
    assert time.monotonic() - t0 < 10
    c.close()


def _around_a_client_death(tmp_path, prog, server_args, client_args, end_client, server_says=None, server_input=None):
    """Runs prog's server and client (tests/*.py programs) twice: plain, then both under the
    preload.  Once the client printed "ready" (and the server `server_says`), end_client(cli)
    ends it; returns {mode: (the server's output after that, seconds it took)}."""
    run = [sys.executable, "-m", "rdmasock", "run", "--"]
    outs = {}
    for mode in ("plain", "preload"):
        pre = run if mode == "preload" else []
        env = dict(os.environ, RDMASOCK_LOG_FILE=str(tmp_path / "log"))
        srv = subprocess.Popen(pre + ["/usr/bin/python3", prog, "server"] + server_args, stdout=subprocess.PIPE, env=env,
                               stdin=subprocess.PIPE if server_input else None)
        cli = None
        try:
            port = srv.stdout.readline().split()[1].decode()
            cli = subprocess.Popen(pre + ["/usr/bin/python3", prog, "client", port] + client_args, stdout=subprocess.PIPE,
                                   env=env)
            assert cli.stdout.readline() == b"ready\n"
            if server_says:
                assert srv.stdout.readline() == server_says
            end_client(cli)
            cli.wait(10)
            t0 = time.monotonic()
            outs[mode] = (srv.communicate(server_input, timeout=60)[0], time.monotonic() - t0)
        finally:
            for p in (cli, srv):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(10)
    assert "shm" in open(tmp_path / "log").read()
    return outs


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_client_process_dies_server_reads_what_tcp_gives(how, tmp_path):
    """A client process that dies after its last read, leaving nothing of the server's
    unread: over TCP every server connection reads the end of the stream.  The same under
    the preload (both ends), whichever way each connection's first bytes travelled
    (preamble frame or ring), and whatever doorbells the client left unread."""
    prog = os.path.join(os.path.dirname(os.path.abspath(__file__)), "echo_threads.py")

    def end(cli):
        time.sleep(0.2)
        cli.send_signal(getattr(signal, how))
    ends = _around_a_client_death(tmp_path, prog, ["30"], ["30", "wait"], end)
    assert ends["plain"][0] == b'{"eof": 30}\n'
    assert ends["preload"][0] == ends["plain"][0]


@pytest.mark.parametrize("how", ["exit", "_exit", "kill", "fork-close", "fork-exit", "fork-killed", "fork-late",
                                 "close+early", "_exit+early"])
def test_server_that_exits_without_close_delivers_its_answer(how, tmp_path):
    """A server that writes a large answer and ends its process (exit, _exit, or SIGKILL)
    with the socket open, while the client has not read yet: over TCP the kernel's close
    sends a FIN behind the answer and the client reads all of it.  Under the preload (both
    ends) the same: the client's doorbell, unread, or its credit doorbell reaching the
    closed socket, once made that close a reset, which threw away the spilled part still
    in the server's socket (the client's read failed).  fork-*: the answer comes from a
    forked child, which reads one more message (its doorbell left unread) and closes or
    exits; the child is the last holder and must end the stream as a close would (the
    parent's close, first, must not).  fork-killed: a child killed at once never gives its
    share back; the parent answering is still the last holder once the child is gone.
    fork-late: the parent, last to close, has a view of the ring from before the child
    wrote: it must not write its end there (it would overwrite the child's records).  +early: the client writes before the handshake has
    ended, so its SWITCH (PROTOCOL 2.9) is due at its next call, its first read, after the
    server's close: that byte, reaching the closed socket, was answered with a reset (the
    client read 373,696 bytes, then ECONNRESET); told that the server closes, the client
    sends none."""
    prog = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_without_close.py")
    size = 2 << 20
    run = [sys.executable, "-m", "rdmasock", "run", "--"]
    env = dict(os.environ, RDMASOCK_LOG_FILE=str(tmp_path / "log"))
    server_how, _, opt = how.partition("+")
    opt = opt or ("bye" if how in ("fork-close", "fork-exit", "fork-killed") else "")
    outs = {}
    for mode in ("plain", "preload"):
        pre = run if mode == "preload" else []
        srv = subprocess.Popen(pre + ["/usr/bin/python3", prog, "server", server_how, str(size)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
        try:
            port = srv.stdout.readline().split()[1].decode()
            cli = subprocess.run(pre + ["/usr/bin/python3", prog, "client", port, "1", opt], capture_output=True,
                                 env=env, timeout=60)
            assert srv.wait(30) == (-signal.SIGKILL if how == "kill" else 0) and srv.stderr.read() == b""
            assert cli.returncode == 0 and cli.stderr == b"", cli.stderr
            outs[mode] = json.loads(cli.stdout)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait(10)
    assert outs["plain"]["bytes"] == size
    assert outs["preload"] == outs["plain"]
    assert open(tmp_path / "log").read().count("transport=shm") == 2


def test_exit_from_a_signal_handler_inside_a_call_does_not_hang(tmp_path):
    """A handler that calls exit() interrupts a send or recv that holds a lock of the
    connection (most often while it copies 64 KiB): the exit path, which ends each stream
    as close would, must not wait for that lock.  It hung 19 times in 20 when it did."""
    prog = str(tmp_path / "exit_in_handler")
    subprocess.run(["gcc", "-O2", "-Wall", "-o", prog, os.path.join(os.path.dirname(os.path.abspath(__file__)), "c",
                    "exit_in_handler.c")], check=True, timeout=120)
    run = [sys.executable, "-m", "rdmasock", "run", "--"]
    log = tmp_path / "log"
    for i in range(20):
        r = subprocess.run(run + [prog, str(200 + 997 * i)], env=dict(os.environ, RDMASOCK_LOG_FILE=str(log)),
                           capture_output=True, timeout=30)
        assert (r.returncode, r.stdout, r.stderr) == (3, b"moving\n", b""), (i, r)
    # the server's line of each run (the client's may still be due when the exit comes)
    lines = open(log).read().splitlines()
    assert sum("role=server" in l and l.endswith("transport=shm") for l in lines) == 20, lines


@pytest.mark.parametrize("how", ["poll", "select", "epoll"])
def test_dead_peer_makes_the_socket_readable(how, tmp_path):
    """A peer process killed without closing: over TCP the socket reads as readable (the
    end of the stream, or a reset), so a program that waits for input and then reads
    learns of it.  The same under the preload: a wait for input that reported only a
    hang-up left pgbench polling its dead connections in a loop."""
    prog = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dead_peer_wait.py")
    seen = _around_a_client_death(tmp_path, prog, [how], [], lambda cli: cli.kill(), b"served\n", b"go\n")
    assert seen["plain"][0] == b'{"readable": true, "read": 0}\n'
    assert seen["preload"][0] == seen["plain"][0]
    assert seen["preload"][1] < 8, "the wait took its whole timeout"


def test_full_ring_backpressure(pair):
    """A reader that takes nothing: the writer fills the ring, then (after the ring stayed
    full a moment) the socket buffers it lends (SPILL), then waits, as over TCP; the
    reader gets every byte, and the connection stays on its ring."""
    c, s = pair()
    c.setblocking(False)
    total = 0
    with pytest.raises(BlockingIOError):
        for _ in range(10000):
            total += c.send(b"z" * 4096)
    assert 100000 < total <= 4 << 20                 # a ring's worth was accepted
    ring = total
    for _ in range(20000):                           # then what the socket's buffers take
        if not select.select([], [c], [], 0.3)[1]:
            break
        try:
            total += c.send(b"z" * 4096)
        except BlockingIOError:
            pass
    assert ring < total <= ring + (64 << 20)
    c.settimeout(0.2)
    with pytest.raises(TimeoutError):
        c.sendall(b"z" * 4096)
    assert c.transport == "shm" and c.stats()["bytes_spilled"] > 0
    got = 0
    s.settimeout(5)
    while got < total:
        got += len(s.recv(1 << 20))
    c.setblocking(True)
    c.sendall(b"after")                               # credit came back
    while True:
        d = s.recv(100)
        if d.endswith(b"after"):
            break


def _fake_rdmasock_client(port, payload):
    """A raw client that registers a client rendezvous (so the server expects a HELLO)
    and then sends payload instead of a valid one."""
    c = socket.socket()
    c.bind(("127.0.0.1", 0))
    marker = rendezvous.register_client(c, *c.getsockname())
    c.connect(("127.0.0.1", port))
    c.sendall(payload)
    return c, marker


@pytest.mark.parametrize("payload,reason", [
    (hs.MAGIC + b"\x00\x01\x00\x01\xff\xff\xff\xff" + b"\0" * 48, "handshake_garbage"),   # oversized
    (hs.MAGIC + b"\x00\x01\x00\x07\x00\x00\x00\x40" + b"\0" * 48, "handshake_garbage"),   # bad opcode
    (hs.MAGIC + b"\x00\x01", "handshake_timeout"),                                        # truncated
])
def test_garbage_handshake_clear_error_bounded(payload, reason, monkeypatch):
    from rdmasock import config
    monkeypatch.setenv("RDMASOCK_HANDSHAKE_TIMEOUT", "1")
    config.reload()
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c, marker = _fake_rdmasock_client(srv.getsockname()[1], payload)
    t0 = time.monotonic()
    s, _ = srv.accept()
    s.settimeout(5)
    with pytest.raises(OSError) as ei:
        s.recv(10)
    assert ei.value.errno == errno.EPROTO and "handshake" in str(ei.value)
    assert s.fallback_reason == reason
    assert time.monotonic() - t0 < 4
    for x in (s, c, marker, srv):
        x.close()


PRELOADED_SERVER = """
import errno, socket
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
s, _ = srv.accept()
s.settimeout(5)                       # Python waits in poll() first, then reads
try:
    print("data", s.recv(10), flush=True)
except OSError as e:
    print("error", errno.errorcode.get(e.errno), flush=True)
"""


def _preloaded_server(tmp_path, extra_env=None):
    (tmp_path / "srv.py").write_text(PRELOADED_SERVER)
    env = dict(os.environ, RDMASOCK_LOG_FILE=str(tmp_path / "log"), **(extra_env or {}))
    srv = subprocess.Popen([sys.executable, "-m", "rdmasock", "run", "--", "/usr/bin/python3", str(tmp_path / "srv.py")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return srv, int(srv.stdout.readline())


@pytest.mark.parametrize("payload,reason", [
    (hs.MAGIC + b"\x00\x01\x00\x01\xff\xff\xff\xff" + b"\0" * 48, "handshake_garbage"),   # oversized
    (hs.MAGIC + b"\x00\x01\x00\x07\x00\x00\x00\x40" + b"\0" * 48, "handshake_garbage"),   # bad opcode
    (hs.MAGIC + b"\x00\x00\x00\x01\x00\x00\x00\x40" + b"\0" * 48, "handshake_garbage"),   # version 0
    (hs.MAGIC + b"\x00\x01", "handshake_timeout"),                                        # truncated
])
def test_garbage_handshake_to_a_preloaded_server(payload, reason, tmp_path):
    """The same bad HELLOs to a preloaded server, whose C side plans the connection at
    accept (shim/rs_answer.c) and hands what it cannot answer to the control plane: the
    program's read, after a wait in poll(), fails with EPROTO at once (the failed handshake
    discarded the bytes that woke the wait, so the kernel socket is shut down for reading
    to keep waits from sleeping through it), and the log says why."""
    srv, port = _preloaded_server(tmp_path, {"RDMASOCK_HANDSHAKE_TIMEOUT": "1"})
    try:
        c, marker = _fake_rdmasock_client(port, payload)
        out, err = srv.communicate(timeout=20)
        assert out.split("\n")[0] == "error EPROTO" and err == "", (out, err)
    finally:
        if srv.poll() is None:
            srv.kill()
    c.close()
    marker.close()
    assert "role=server" in open(tmp_path / "log").read() and "reason=%s" % reason in open(tmp_path / "log").read()


def test_hostile_hello_gets_a_bounded_answer_from_c(tmp_path):
    """A HELLO that offers everything: every feature bit, every transport, ring 2^255, a
    future version.  The C answer grants only what the server speaks, its own ring size
    (2^18 by default), shm, and passes a segment of that size with our nonce."""
    from rdmasock import transport_shm
    srv, port = _preloaded_server(tmp_path)
    try:
        nonce = os.urandom(16)
        hello = hs.Message(hs.OP_HELLO, features=(1 << 64) - 1, transports=(1 << 32) - 1, nonce=nonce,
                           ring_log2=255, version=7).pack()
        c, marker = _fake_rdmasock_client(port, hello)
        c.settimeout(10)
        reply = hs.parse(recv_exact(c, hs.MSG_LEN), (hs.OP_ACCEPT,))
        assert (reply.transports, reply.ring_log2, reply.nonce) == (hs.T_SHM, 18, nonce)
        assert reply.features == hs.SUPPORTED and reply.version == hs.VERSION
        fds = rendezvous.recv_fd(marker, nonce)
        assert fds is not None and len(fds) == 3                  # the segment and both event bells
        assert os.fstat(fds[0]).st_size == transport_shm.segment_bytes(1 << 18)
        for fd in fds:
            os.close(fd)
        c.close()
        marker.close()
        out, err = srv.communicate(timeout=20)
        assert out.split("\n")[0] in ("data b''", "error ECONNRESET") and err == "", (out, err)
    finally:
        if srv.poll() is None:
            srv.kill()
    assert "role=server" in open(tmp_path / "log").read()


def test_non_handshake_bytes_from_registered_client_stay_tcp():
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c, marker = _fake_rdmasock_client(srv.getsockname()[1], b"GET / HTTP/1.0\r\n\r\n")
    s, _ = srv.accept()
    assert recv_exact(s, 18) == b"GET / HTTP/1.0\r\n\r\n"      # nothing consumed
    assert s.transport == "tcp" and s.fallback_reason == "peer_not_rdmasock"
    for x in (s, c, marker, srv):
        x.close()


def test_garbage_reply_gives_client_clear_error():
    ls = socket.create_server(("127.0.0.1", 0))
    lmarker = rendezvous.register_listener(ls)   # pretends to be rdmasock
    c = rdmasock.create_connection(ls.getsockname(), timeout=5)
    s, _ = ls.accept()
    assert recv_exact(s, 64)[:8] == hs.MAGIC
    s.sendall(hs.MAGIC + b"\x00\x01\x00\x02" + b"\xff" * 52)          # ACCEPT with a bogus length
    with pytest.raises(OSError) as ei:
        c.recv(10)
    assert ei.value.errno == errno.EPROTO
    for x in (c, s, ls, lmarker):
        x.close()


def test_server_reset_during_handshake_is_told_as_the_peer_closing():
    """A server that resets the connection instead of answering the HELLO: the client's
    call fails as over TCP (ECONNRESET), and its reason says the peer closed during the
    handshake, not that it sent garbage."""
    ls = socket.create_server(("127.0.0.1", 0))
    lmarker = rendezvous.register_listener(ls)   # pretends to be rdmasock
    c = rdmasock.create_connection(ls.getsockname(), timeout=5)
    s, _ = ls.accept()
    hs.parse(recv_exact(s, 64), (hs.OP_HELLO,))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()                                     # a reset, no answer
    with pytest.raises(ConnectionResetError):
        c.recv(10)
    assert c.transport == "tcp" and c.fallback_reason == "closed_during_handshake"
    for x in (c, ls, lmarker):
        x.close()


def test_client_gone_before_accept_leaves_no_handshake_bytes():
    """A client that connects, writes and closes before the server accepts: its name is
    gone by then, but its HELLO is on the stream.  The server reads it without answering,
    and the program reads exactly what the client wrote, then the end."""
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c = rdmasock.create_connection(srv.getsockname())
    c.sendall(b"written before accept")
    c.close()
    s, _ = srv.accept()
    assert recv_all(s, timeout=10) == b"written before accept"
    assert s.transport == "tcp" and s.fallback_reason == "closed_during_handshake"
    for x in (s, srv):
        x.close()


def test_client_gone_before_accept_loses_nothing_in_flight():
    """The same with more than the buffers hold: the client's last bytes are still on their
    way (in its closed socket) when the server accepts.  An answer would reach that closed
    socket, and its reset would destroy them (the server read 6136 of 12280 bytes, then
    ECONNRESET); unanswered, they all arrive, then the end, as over TCP."""
    srv = rdmasock.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    c = rdmasock.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    c.connect(srv.getsockname())
    c.setblocking(False)
    data = os.urandom(1 << 20)
    sent = 0
    try:
        while sent < len(data):
            sent += c.send(data[sent:sent + 65536])
    except BlockingIOError:
        pass
    c.close()
    assert sent > 0
    s, _ = srv.accept()
    assert recv_all(s, timeout=10) == data[:sent]
    assert s.transport == "tcp" and s.fallback_reason == "closed_during_handshake"
    for x in (s, srv):
        x.close()


def test_accept_of_a_larger_ring_than_offered_is_refused():
    """A server that grants more ring than the HELLO asked for would make the client map
    more than it reserved: a clear handshake error, before any descriptor is looked at."""
    ls = socket.create_server(("127.0.0.1", 0))
    lmarker = rendezvous.register_listener(ls)   # pretends to be rdmasock
    c = rdmasock.create_connection(ls.getsockname(), timeout=5)
    s, _ = ls.accept()
    hello = hs.parse(recv_exact(s, 64), (hs.OP_HELLO,))
    assert hello.ring_log2 < 30
    s.sendall(hs.Message(hs.OP_ACCEPT, features=hs.SUPPORTED, transports=hs.T_SHM, nonce=hello.nonce,
                         ring_log2=30, salt=1).pack())
    with pytest.raises(OSError) as ei:
        c.recv(10)
    assert ei.value.errno == errno.EPROTO
    assert c.fallback_reason == "handshake_garbage"
    for x in (c, s, ls, lmarker):
        x.close()


def _my_segments():
    out = []
    for fd in glob.glob("/proc/%d/fd/*" % os.getpid()):
        try:
            if "rdmasock" in os.readlink(fd):
                out.append(fd)
        except OSError:
            pass
    maps = open("/proc/self/maps").read()
    return out, maps.count("memfd:rdmasock")


def _abstract_names():
    return [ln for ln in open("/proc/net/unix").read().splitlines() if "@rdmasock/" in ln]


def test_nothing_left_behind_after_close(pair):
    import gc
    gc.collect()
    before = set(os.listdir("/dev/shm"))
    fds0, maps0 = _my_segments()
    c, s = pair()
    c.sendall(b"x")
    recv_exact(s, 1)
    assert _my_segments()[1] == maps0 + 2             # both ends map the one memfd segment
    c.close()
    s.close()
    assert _my_segments() == (fds0, maps0)
    assert set(os.listdir("/dev/shm")) == before
    assert not [n for n in _abstract_names() if "/c/" in n]


def test_nothing_left_behind_after_sigkill_of_both(peers):
    before = set(os.listdir("/dev/shm"))
    p = peers("echo-server", "rdmasock")
    q = peers("hold-client", "rdmasock", p.port)
    assert q.first == "ready shm"
    pids = (p.proc.pid, q.proc.pid)
    p.proc.kill()
    q.proc.kill()
    p.proc.wait(10)
    q.proc.wait(10)
    assert set(os.listdir("/dev/shm")) == before
    names = _abstract_names()
    assert wait_for(lambda: not any("rdmasock/l/" in n and str(p.port) in n for n in _abstract_names()), 5), names
    assert all(not os.path.exists("/proc/%d" % pid) for pid in pids)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as another user")
def test_third_user_cannot_open_or_map_the_ring(pair):
    c, s = pair()
    c.sendall(b"secret")
    recv_exact(s, 6)
    regions = [ln.split()[0] for ln in open("/proc/self/maps") if "memfd:rdmasock" in ln]
    assert regions
    fds = ["/proc/%d/map_files/%s" % (os.getpid(), r) for r in regions]
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    import pathlib
    import tempfile
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="rdmasock-probe-"))
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys, glob, mmap\n"
        "ok = []\n"
        "for p in sys.argv[1:] + ['/proc/%s/mem']:\n"
        "    try:\n"
        "        fd = os.open(p, os.O_RDWR)\n"
        "        mmap.mmap(fd, 4096)\n"
        "        ok.append(p)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('opened', len(ok))\n" % os.getpid())
    os.chmod(tmp_path, 0o755)
    os.chmod(probe, 0o644)

    def drop():
        os.setgroups([])
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)

    out = subprocess.run(["/usr/bin/python3", str(probe)] + fds, preexec_fn=drop, capture_output=True, timeout=30)
    probe.unlink()
    tmp_path.rmdir()
    assert out.stdout.decode().strip() == "opened 0", out.stderr.decode()


def test_fake_descriptor_from_third_party_is_ignored():
    """Anyone may send to a client's abstract name; without the nonce it is discarded."""
    c = socket.socket()
    c.bind(("127.0.0.1", 0))
    marker = rendezvous.register_client(c, *c.getsockname())
    fake = os.memfd_create("evil")
    rendezvous.send_fd("127.0.0.1", c.getsockname()[1], b"\0" * 16, [fake])
    assert rendezvous.recv_fd(marker, b"\1" * 16) is None
    for x in (c, marker):
        x.close()
    os.close(fake)
