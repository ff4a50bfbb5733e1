"""rdmasock.socket as a drop-in for socket.socket, rdmasock with rdmasock (shm)."""
import errno
import os
import socket
import threading

import pytest

import rdmasock
from conftest import recv_all, recv_exact


def test_upgrades_to_shm_and_reports_it(pair):
    c, s = pair()
    c.sendall(b"ping")
    assert recv_exact(s, 4) == b"ping"
    s.sendall(b"pong")
    assert recv_exact(c, 4) == b"pong"
    assert (c.transport, s.transport) == ("shm", "shm")
    assert c.fallback_reason is None and s.fallback_reason is None
    assert c.stats()["bytes_sent"] == 4 and s.stats()["bytes_received"] == 4


def test_stats_describe_the_connection_state(pair):
    """stats()["state"]: one line of positions and control words, for whoever wonders why
    a call waits."""
    c, s = pair()
    c.sendall(b"x" * 1000)
    assert recv_exact(s, 1000) == b"x" * 1000
    cs, ss = c.stats()["state"], s.stats()["state"]
    assert cs.startswith("shm ring=") and "; shared: rx head=" in cs, cs

    def part(state, name):                      # "tx: pos=1 bytes=2; ..." -> {"pos": 1, "bytes": 2}
        return {k: int(v) for k, v in (f.split("=") for f in state.split(name + ": ")[1].split(";")[0].split())}
    assert part(cs, "tx")["bytes"] == 1000 and part(cs, "tx")["pos"] > 1000, cs
    assert part(ss, "rx")["bytes"] == 1000 and part(ss, "rx")["pos"] == part(cs, "tx")["pos"], (cs, ss)


def test_is_a_socket_and_fileno_is_the_tcp_socket(pair):
    c, s = pair()
    assert isinstance(c, socket.socket)
    assert c.family == socket.AF_INET and c.type == socket.SOCK_STREAM
    assert c.getpeername() == s.getsockname() and s.getpeername() == c.getsockname()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    assert socket.socket(fileno=os.dup(c.fileno())).type == socket.SOCK_STREAM


def test_nagle_and_cork_are_kept_virtually(pair):
    """TCP_NODELAY off and TCP_CORK on would hold doorbells back (a cork for 200 ms per
    bell): the program sees its own values, the TCP socket keeps Nagle and the cork off."""
    import _socket
    c, s = pair()
    for opt, kernel in ((socket.TCP_NODELAY, 1), (socket.TCP_CORK, 0)):
        for value in (1, 0, 1):
            s.setsockopt(socket.IPPROTO_TCP, opt, 1 - kernel if value else kernel)
            assert s.getsockopt(socket.IPPROTO_TCP, opt) == (1 - kernel if value else kernel)
            assert _socket.socket.getsockopt(s, socket.IPPROTO_TCP, opt) == kernel
    c.sendall(b"ping")
    assert recv_exact(s, 4) == b"ping"


def test_other_families_are_plain_sockets():
    """rdmasock.socket stands in for socket.socket for every family (a program may patch
    the socket module with it); only INET stream sockets are ever upgraded."""
    a, b = socket.socketpair()
    for fam, typ in ((socket.AF_UNIX, socket.SOCK_STREAM), (socket.AF_INET, socket.SOCK_DGRAM)):
        s = rdmasock.socket(fam, typ)
        assert isinstance(s, socket.socket) and (s.family, s.type) == (fam, typ)
        s.close()
    u = rdmasock.socket(fileno=a.detach())
    assert u.family == socket.AF_UNIX
    u.sendall(b"unix")
    assert b.recv(4) == b"unix" and u.transport == "tcp"
    u.close()
    b.close()
    s = rdmasock.socket()
    assert isinstance(s, rdmasock.socket)
    s.close()


def test_dup_fromfd_detach_share_the_connection(pair):
    """Objects for the same socket read and write the same stream; the connection ends
    (FIN) only when the last of them closes, as with kernel sockets."""
    c, s = pair()
    c.sendall(b"one")
    assert recv_exact(s, 3) == b"one"
    d = s.dup()
    f = rdmasock.fromfd(s.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    assert isinstance(f, rdmasock.socket) and f.transport == "shm"
    c.sendall(b"twothree")
    assert recv_exact(d, 3) == b"two" and recv_exact(f, 5) == b"three"
    s.close()
    d.sendall(b"back")
    assert recv_exact(c, 4) == b"back"
    d.close()
    c.sendall(b"more")
    assert recv_exact(f, 4) == b"more"
    fd = f.detach()
    with pytest.raises(OSError):
        f.recv(1)
    g = rdmasock.socket(fileno=fd)
    g.sendall(b"last")
    assert recv_exact(c, 4) == b"last"
    g.close()
    assert c.recv(1) == b""                  # the last holder closed: end of stream


def test_recv_variants(pair):
    c, s = pair()
    c.sendall(b"abcdefghij")
    buf = bytearray(4)
    assert s.recv(3, socket.MSG_PEEK) == b"abc"
    assert s.recv_into(buf) == 4 and buf == b"abcd"
    assert s.recv_into(buf, 2) == 2 and buf[:2] == b"ef"
    data, anc, flags, addr = s.recvmsg(2)
    assert data == b"gh" and anc == []
    assert s.recvfrom(2)[0] == b"ij"
    c.sendmsg([b"12", memoryview(b"34"), bytearray(b"5")])
    assert recv_exact(s, 5) == b"12345"
    c.sendall(b"x" * 100)
    assert s.recv(100, socket.MSG_WAITALL) == b"x" * 100


def test_urgent_data_moves_the_connection_to_tcp(pair):
    """MSG_OOB exists only in TCP: the sender's connection moves there behind what it sent
    before (reason urgent_data, the peer's peer_moved); the urgent byte and the stream
    arrive as over TCP."""
    import select
    c, s = pair()
    c.sendall(b"ab")
    assert recv_exact(s, 2) == b"ab"
    with pytest.raises(OSError) as e:
        s.recv(1, socket.MSG_OOB)                        # none pending yet
    assert e.value.errno == errno.EINVAL
    c.sendall(b"12")
    assert c.send(b"c", socket.MSG_OOB) == 1
    c.sendall(b"de")
    p = select.poll()
    p.register(s.fileno(), select.POLLPRI)
    assert p.poll(3000)
    assert s.recv(1, socket.MSG_OOB) == b"c"
    assert recv_exact(s, 4) == b"12de"
    s.sendall(b"back")
    assert recv_exact(c, 4) == b"back"
    assert (c.transport, c.fallback_reason) == ("tcp", "urgent_data")
    assert (s.transport, s.fallback_reason) == ("tcp", "peer_moved")


def test_recv_trunc_discards(pair):
    c, s = pair()
    c.sendall(bytes(range(200)))
    assert len(s.recv(50, socket.MSG_PEEK | socket.MSG_TRUNC)) == 50
    assert len(s.recv(150, socket.MSG_TRUNC | socket.MSG_WAITALL)) == 150
    assert recv_exact(s, 50) == bytes(range(150, 200))


def test_makefile_text_and_binary(pair):
    c, s = pair()
    wf, rf = c.makefile("w"), s.makefile("r")
    wf.write("line one\nline two\n")
    wf.flush()
    assert rf.readline() == "line one\n" and rf.readline() == "line two\n"
    bw, br = s.makefile("wb"), c.makefile("rb")
    bw.write(b"\x00\x01" * 50000)
    bw.flush()
    assert br.read(100000) == b"\x00\x01" * 50000
    for f in (wf, rf, bw, br):
        f.close()


def test_timeouts_and_nonblocking(pair):
    c, s = pair()
    c.sendall(b"x")
    assert recv_exact(s, 1) == b"x"
    s.settimeout(0.2)
    assert s.gettimeout() == 0.2
    with pytest.raises(TimeoutError):
        s.recv(10)
    s.setblocking(False)
    assert s.gettimeout() == 0.0
    with pytest.raises(BlockingIOError):
        s.recv(10)
    with pytest.raises(BlockingIOError):
        s.recv(10, socket.MSG_DONTWAIT)
    s.setblocking(True)
    c.sendall(b"y")
    assert s.recv(10) == b"y"


def test_half_close_both_ways(pair):
    c, s = pair()
    c.sendall(b"request")
    c.shutdown(socket.SHUT_WR)
    assert recv_all(s) == b"request"
    with pytest.raises(BrokenPipeError):
        c.sendall(b"more")
    s.sendall(b"response after client's half-close")
    s.shutdown(socket.SHUT_WR)
    assert recv_all(c) == b"response after client's half-close"
    assert s.recv(10) == b""


def test_download_only_client_stays_on_the_ring(pair):
    """A client that only reads sends its first TCP bytes as credit doorbells (its SWITCH
    goes first): a stream several rings long arrives whole, still on the ring."""
    c, s = pair()
    payload = os.urandom(1 << 20) * 6
    t = threading.Thread(target=s.sendall, args=(payload,))
    t.start()
    assert recv_exact(c, len(payload)) == payload
    t.join(30)
    assert (c.transport, s.transport) == ("shm", "shm")
    s.close()
    assert c.recv(10) == b""


def test_close_delivers_eof_after_data(pair):
    c, s = pair()
    c.sendall(b"last words")
    c.close()
    assert recv_all(s) == b"last words"


def test_context_manager_and_create_server_signature():
    with rdmasock.create_server(("127.0.0.1", 0), backlog=5, reuse_port=True) as srv:
        with rdmasock.create_connection(srv.getsockname(), timeout=5, source_address=("127.0.0.1", 0)) as c:
            s, addr = srv.accept()
            with s:
                c.sendall(b"hi")
                assert recv_exact(s, 2) == b"hi"
                assert addr == c.getsockname() and c.transport == "shm"
                assert c.gettimeout() == 5
    assert c.fileno() == -1 and srv.fileno() == -1


def test_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        srv = rdmasock.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as exc:
        pytest.skip("no ::1: %s" % exc)
    with srv:
        c = rdmasock.create_connection(srv.getsockname()[:2])
        s, _ = srv.accept()
        c.sendall(b"six")
        assert recv_exact(s, 3) == b"six" and s.transport == "shm"
        c.close()
        s.close()


def test_connect_and_connect_ex_plain_calls():
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c = rdmasock.socket()
    assert c.connect_ex(srv.getsockname()) == 0
    s, _ = srv.accept()
    c.sendall(b"ok")
    assert recv_exact(s, 2) == b"ok" and s.transport == "shm"
    c2 = rdmasock.socket()
    port = srv.getsockname()[1]
    for x in (c, s, srv):
        x.close()
    assert c2.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED
    c2.close()


def test_send_before_accept_then_client_reads():
    """A client that writes before the server accepted, then waits for the answer."""
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c = rdmasock.create_connection(srv.getsockname(), timeout=10)
    c.sendall(b"early bytes " * 1000)

    def serve():
        s, _ = srv.accept()
        assert recv_exact(s, 12000) == b"early bytes " * 1000
        s.sendall(b"answer")
        s.close()

    t = threading.Thread(target=serve)
    t.start()
    assert recv_exact(c, 6) == b"answer"
    t.join(10)
    assert c.transport == "shm"
    c.close()
    srv.close()


def test_send_before_accept_reaches_the_server():
    """TCP lets a client write before the server accepts, then do nothing; so must rdmasock."""
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c = rdmasock.create_connection(srv.getsockname())
    c.sendall(b"early bytes " * 1000)
    s, _ = srv.accept()
    s.settimeout(2)
    assert recv_exact(s, 12000, timeout=3) == b"early bytes " * 1000
    s.sendall(b"answer")
    assert recv_exact(c, 6) == b"answer"
    assert c.transport == s.transport == "shm"
    for x in (c, s, srv):
        x.close()


def test_nonblocking_half_close_during_the_handshake_does_not_wait():
    """One thread runs both ends, as an event loop does: a non-blocking client writes and
    half-closes before the server has even accepted.  Waiting there for the server's
    answer would wait for itself; the half-close happens when the handshake ends, on the
    path the data takes, and the server reads everything, then end of stream."""
    import time
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c = rdmasock.create_connection(srv.getsockname())
    c.setblocking(False)
    c.sendall(b"request " * 2000)
    t0 = time.monotonic()
    c.shutdown(socket.SHUT_WR)
    assert time.monotonic() - t0 < 1
    s, _ = srv.accept()
    s.setblocking(False)
    got, deadline = b"", time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            c.recv(1)                                # the client's next call ends its handshake
        except BlockingIOError:
            pass
        try:
            d = s.recv(65536)
        except BlockingIOError:
            time.sleep(0.001)
            continue
        if not d:
            break
        got += d
    assert got == b"request " * 2000
    s.sendall(b"reply")
    s.close()
    c.setblocking(True)
    c.settimeout(10)
    assert recv_all(c, timeout=10) == b"reply"
    assert c.transport == "shm" and c.fallback_reason is None
    c.close()
    srv.close()


def test_detach_and_reattach(pair):
    c, s = pair()
    c.sendall(b"a")
    assert recv_exact(s, 1) == b"a"
    fd = s.detach()
    s2 = rdmasock.socket(fileno=fd)
    c.sendall(b"b")
    assert recv_exact(s2, 1) == b"b" and s2.transport == "shm"
    s2.close()


def test_many_threads_many_connections():
    srv = rdmasock.create_server(("127.0.0.1", 0), backlog=64)
    errors = []

    def serve():
        for _ in range(40):
            s, _ = srv.accept()
            threading.Thread(target=echo, args=(s,), daemon=True).start()

    def echo(s):
        with s:
            while True:
                d = s.recv(4096)
                if not d:
                    return
                s.sendall(d)

    def client(i):
        try:
            with rdmasock.create_connection(srv.getsockname(), timeout=30) as c:
                msg = (b"%d-" % i) * 500
                c.sendall(msg)
                assert recv_exact(c, len(msg)) == msg
                assert c.transport == "shm"
        except BaseException as exc:        # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ts = [threading.Thread(target=client, args=(i,)) for i in range(40)]
    for x in ts:
        x.start()
    for x in ts:
        x.join(60)
    srv.close()
    assert not errors, errors[:3]


CLOSE_BEFORE_ANSWER = """
import socket, sys
sock = getattr(__import__(sys.argv[1]), "socket")
srv = sock(); srv.bind(("127.0.0.1", 0)); srv.listen()
for i in range(40):
    c = sock(); c.connect(srv.getsockname())
    c.sendall(b"bye")                 # a preamble frame: the server has not answered yet
    s, _ = srv.accept()               # the answer leaves now, to a client about to close
    c.close()
    got = b""
    while True:
        b = s.recv(100)
        if not b:
            break
        got += b
    assert got == b"bye", (i, got)
    s.close()
print("ok")
"""


ACCEPT_AND_CLOSE = """
import select, socket, sys, threading, time
sock = getattr(__import__(sys.argv[1]), "socket")
srv = sock(); srv.bind(("127.0.0.1", 0)); srv.listen()
for i in range(20):
    t = threading.Thread(target=lambda: srv.accept()[0].close())
    t.start()
    c = sock(); c.setblocking(False)
    c.connect_ex(srv.getsockname())
    t.join()                          # the server accepted and closed before our HELLO left
    time.sleep(0.01)
    select.select([], [c], [], 5)
    time.sleep(0.01)
    err = c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    assert err == 0, (i, err)         # nothing the program wrote: no reset to report
    c.close()
print("ok")
"""


def _run_program(tmp_path, text, mode):
    import subprocess
    import sys
    prog = tmp_path / "prog.py"
    prog.write_text(text)
    cmd = ([sys.executable, str(prog), "rdmasock"] if mode == "api" else
           [sys.executable, "-m", "rdmasock", "run", "--", "/usr/bin/python3", str(prog), "socket"])
    env = dict(os.environ, RDMASOCK_LOG_FILE=str(tmp_path / "log"))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


HIGH_DESCRIPTORS = """
import os, resource, socket, sys
sock = getattr(__import__(sys.argv[1]), "socket")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
filler = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]     # sockets get numbers > 1023
srv = sock(); srv.bind(("127.0.0.1", 0)); srv.listen()
for timeout in (None, 5.0, 0.0):
    c = sock(); assert c.fileno() > 1023
    c.settimeout(timeout)
    try:
        c.connect(srv.getsockname())
    except BlockingIOError:
        pass
    s, _ = srv.accept()
    c.settimeout(5)
    c.sendall(b"ping")
    assert s.recv(4) == b"ping"
    s.sendall(b"pong")
    assert c.recv(4) == b"pong"
    c.close(); s.close()
print("ok")
"""


FORKING_SERVER = """
import os, socket, sys, time
mod = __import__(sys.argv[1])
srv = mod.create_server(("127.0.0.1", 0))
c = mod.create_connection(srv.getsockname())
s, _ = srv.accept()
c.sendall(b"go")
assert s.recv(2) == b"go"
pid = os.fork()
if pid == 0:                      # the child answers, after the parent has closed its copy
    try:
        srv.close()
        time.sleep(0.2)
        s.sendall(b"y" * 100000)
        s.close()
    finally:
        os._exit(0)
s.close()
got = b""
while True:
    b = c.recv(65536)
    if not b:
        break
    got += b
assert got == b"y" * 100000, len(got)
assert os.waitpid(pid, 0)[1] == 0
print("ok")
"""


@pytest.mark.parametrize("mode", ["api", "preload"])
def test_forking_server_parent_close_leaves_the_stream_to_the_child(mode, tmp_path):
    """A forking server: the parent closes its copy of the accepted socket at once and the
    child answers.  As over TCP, the client reads the child's answer, then the end of the
    stream: a close in a process other than the last holder ends nothing.  Through the
    Python API, the parent's close wrote the FIN record and the client read no byte."""
    _run_program(tmp_path, FORKING_SERVER, mode)
    assert (tmp_path / "log").read_text().count("transport=shm") == 2


@pytest.mark.parametrize("mode", ["api", "preload"])
def test_descriptors_above_1023(mode, tmp_path):
    """Sockets numbered above 1023 (select() cannot take them) upgrade like the others,
    blocking, with a timeout and non-blocking."""
    _run_program(tmp_path, HIGH_DESCRIPTORS, mode)
    log = open(tmp_path / "log").read()
    assert log.count("role=client") == 3 and "transport=tcp" not in log and "rror" not in log, log


@pytest.mark.parametrize("mode", ["api", "preload"])
def test_server_closing_at_once_leaves_no_error(mode, tmp_path):
    """A server that accepts and closes at once (a port check, a refusal): over TCP the
    client's SO_ERROR stays 0, even though its HELLO then meets a closed socket."""
    _run_program(tmp_path, ACCEPT_AND_CLOSE, mode)


@pytest.mark.parametrize("mode", ["api", "preload"])
def test_client_closing_before_the_answer_ends_the_stream(mode, tmp_path):
    """A client that writes and closes before it has read the server's answer: the server
    reads its bytes, then the end of the stream, as over TCP (the reset that the unread
    answer provokes must not overtake them)."""
    _run_program(tmp_path, CLOSE_BEFORE_ANSWER, mode)
    log = open(tmp_path / "log").read()
    # the API's accept answers at once (shm); the preloaded server's first recv comes after
    # the client is gone, so its answer is a DECLINE (fd_pass_failed): a handshake either way
    assert ("transport=shm" if mode == "api" else "reason=fd_pass_failed") in log, log



SO_TIMESTAMPNS, SO_TIMESTAMPING, TCP_INQ = 35, 37, 36        # the socket module has no names for them
SOF_RX_SOFTWARE, SOF_SOFTWARE, SOF_TX_SOFTWARE, SOF_OPT_ID = 0x8, 0x10, 0x2, 0x80


def _plain_pair():
    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname())
    s, _ = srv.accept()
    srv.close()
    return c, s


def _plain_and_upgraded(pair, check):
    """Runs check(client, server) on a plain pair, then on an upgraded one (returned)."""
    c, s = _plain_pair()
    try:
        check(c, s)
    finally:
        c.close()
        s.close()
    c, s = pair()
    assert (c.transport, s.transport) == ("shm", "shm")
    check(c, s)
    return c, s


def _tcp_info(sock):
    import struct
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    acked, received = struct.unpack_from("=QQ", raw, 120)
    segs_out, segs_in = struct.unpack_from("=II", raw, 136)
    data_segs_in, data_segs_out = struct.unpack_from("=II", raw, 152)
    return dict(acked=acked, received=received, segs_out=segs_out, segs_in=segs_in,
                data_segs_in=data_segs_in, data_segs_out=data_segs_out)


def _stamp_reports(c, s):
    """What a program sees of the stream through TCP_INFO, receive ancillary data and
    transmit timestamps: the same assertions for a plain and an upgraded pair."""
    import struct
    import time
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    before_c, before_s = _tcp_info(c), _tcp_info(s)
    for i in range(20):                          # messages sent apart: a segment each at least
        c.sendall(b"%02d" % i)
        time.sleep(0.002)
    assert recv_exact(s, 40) == b"".join(b"%02d" % i for i in range(20))
    after_c, after_s = _tcp_info(c), _tcp_info(s)
    assert after_s["received"] - before_s["received"] == 40
    assert after_c["acked"] - before_c["acked"] == 40
    assert after_c["data_segs_out"] - before_c["data_segs_out"] >= 20
    assert after_s["data_segs_in"] - before_s["data_segs_in"] >= 20 and after_s["segs_in"] > before_s["segs_in"]

    c.sendall(b"z")                              # asked for nothing yet: no ancillary data
    assert s.recvmsg(1, 1024)[:2] == (b"z", [])
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.setsockopt(socket.IPPROTO_TCP, TCP_INQ, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, SOF_RX_SOFTWARE | SOF_SOFTWARE)
    time.sleep(0.05)                             # the kernel turns receive stamps on asynchronously
    c.sendall(b"abcdef")
    data, anc, flags, _ = s.recvmsg(3, 1024, socket.MSG_WAITALL)
    assert data == b"abc" and not flags & socket.MSG_CTRUNC
    kinds = [(level, kind) for level, kind, _ in anc]
    assert kinds == [(socket.SOL_SOCKET, SO_TIMESTAMPNS), (socket.SOL_SOCKET, SO_TIMESTAMPING),
                     (socket.IPPROTO_TCP, TCP_INQ)], anc
    sec, _ = struct.unpack("=qq", anc[0][2])
    assert abs(sec - time.time()) < 10
    sw, _, _, _, hw, hw_ns = struct.unpack("=qqqqqq", anc[1][2])
    assert abs(sw - time.time()) < 10 and hw == hw_ns == 0
    assert struct.unpack("=i", anc[2][2])[0] == 3        # bytes left to read
    data, anc, flags, _ = s.recvmsg(3, socket.CMSG_SPACE(16))
    assert data == b"def" and flags & socket.MSG_CTRUNC and [k for _, k, _ in anc] == [SO_TIMESTAMPNS]

    deadline = time.monotonic() + 10
    c.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, SOF_TX_SOFTWARE | SOF_SOFTWARE | SOF_OPT_ID)
    c.sendall(b"stamped")
    stamp = None
    while stamp is None and time.monotonic() < deadline:
        try:
            _, anc, _, _ = c.recvmsg(256, 1024, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except BlockingIOError:
            time.sleep(0.005)
            continue
        stamp = [d for level, kind, d in anc if (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMPING)]
    assert stamp and abs(struct.unpack_from("=q", stamp[0])[0] - time.time()) < 10, anc
    assert recv_exact(s, 7) == b"stamped"
    s.sendall(b"back")
    assert recv_exact(c, 4) == b"back"


def test_reports_of_the_stream_match_tcp(pair):
    """TCP_INFO counts the stream's bytes and segments, recvmsg gives the receive
    timestamps and TCP_INQ the program asked for, and transmit timestamps come on the
    error queue (the connection moves to TCP for them, reason tx_timestamps): the same
    assertions hold for plain sockets and for an upgraded pair."""
    c, s = _plain_and_upgraded(pair, _stamp_reports)
    assert (c.transport, c.fallback_reason) == ("tcp", "tx_timestamps")


def test_sigio_for_each_arrival_with_o_async_set_on_the_descriptor():
    """A Python program sets O_ASYNC with fcntl on the socket's descriptor (the API does
    not see that call): each arrival raises SIGIO, read or not, as over TCP."""
    import subprocess
    import sys
    outs = {}
    for mode in ("plain", "api"):
        p = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "sigio_program.py"), mode],
                           capture_output=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if not k.startswith("RDMASOCK_")})
        assert p.returncode == 0, p.stderr.decode()
        outs[mode] = p.stdout.decode().split()
    assert outs["plain"][:2] == ["3", "m0m1m2"], outs
    assert outs["api"] == ["3", "m0m1m2", "shm"], outs


def _nonblocking_behind_its_back(c, s):
    os.set_blocking(s.fileno(), False)
    with pytest.raises(BlockingIOError):
        s.recv(16)
    c.sendall(b"x")
    for _ in range(500):
        try:
            assert s.recv(16) == b"x"
            break
        except BlockingIOError:
            import time
            time.sleep(0.01)
    else:
        pytest.fail("the byte never came")
    os.set_blocking(c.fileno(), False)
    sent = 0
    with pytest.raises(BlockingIOError):
        for _ in range(100000):                  # fills whatever buffers the connection has
            sent += c.send(b"y" * 65536)
    assert sent > 0


def test_o_nonblock_set_on_the_descriptor_is_honoured(pair):
    """os.set_blocking(fd, False) on the socket's descriptor, behind the socket object's
    back: reads with nothing to read and writes with no room fail with EAGAIN at once, as
    they do over TCP."""
    _plain_and_upgraded(pair, _nonblocking_behind_its_back)


def test_a_client_that_can_connect_finds_the_listeners_name(monkeypatch):
    """The rendezvous name is registered before the socket listens: a client whose connect
    succeeds at the first instant (the first one, while a server starts) must find it, or
    it goes plain.  Checked at that instant, inside listen(), as such a client would."""
    from rdmasock import api, rendezvous
    seen = []
    real_listen = api._base.listen

    def listen_and_look(sock, *args):
        real_listen(sock, *args)
        if sock.family == socket.AF_INET:                      # not the rendezvous' own sockets
            seen.append(rendezvous.listener_status(*sock.getsockname()[:2])[0])
    monkeypatch.setattr(api._base, "listen", listen_and_look)
    ls = rdmasock.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        ls.bind(("127.0.0.1", 0))
        ls.listen()
        assert seen == ["ok"]
        c = rdmasock.create_connection(ls.getsockname(), timeout=5)
        s, _ = ls.accept()
        c.sendall(b"x")
        assert s.recv(1) == b"x" and c.transport == s.transport == "shm"
        c.close()
        s.close()
    finally:
        ls.close()
    # a socket that listen() binds itself registers after (its port is unknown before)
    seen.clear()
    ls = rdmasock.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        ls.listen()
        assert seen == ["absent"]
        assert rendezvous.listener_status("127.0.0.1", ls.getsockname()[1])[0] == "ok"
    finally:
        ls.close()
