"""LD_PRELOAD library: costs nothing where unused, foreign Python hosts, `rdmasock stat`,
shared memory unavailable.  The program-level tests are in tests/programs/."""
import json
import os
import select
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import free_port, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PINGPONG_SRC = os.path.join(ROOT, "bench", "c", "pingpong.c")
RUN = [sys.executable, "-m", "rdmasock", "run", "--"]


def _lib():
    return subprocess.check_output([sys.executable, "-m", "rdmasock", "preload-path"], text=True).strip()


@pytest.fixture(scope="module")
def cbin(tmp_path_factory):
    d = tmp_path_factory.mktemp("cbin")
    out = {}
    for name, src, extra in (("pingpong", PINGPONG_SRC, []),
                             ("foreign", os.path.join(HERE, "c", "foreign_python.c"), ["-rdynamic"])):
        path = str(d / name)
        subprocess.run(["gcc", "-O2", *extra, "-o", path, src], check=True, timeout=120)
        out[name] = path
    return out


def _env(log):
    e = dict(os.environ)
    e["RDMASOCK_LOG_FILE"] = log
    return e


def _start_server(cmd, env):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    line = p.stdout.readline()
    if b"ready" not in line:
        p.kill()
        raise RuntimeError("server did not start: %r %r" % (line, p.stderr.read()))
    return p


def _stop(p):
    if p.poll() is None:
        p.kill()
    p.wait(10)


@pytest.mark.parametrize("prog", [["ls", "/"], ["cat", "/etc/hostname"], ["curl", "-s", "file:///etc/hostname"]])
def test_never_starts_python_without_inet_streams(prog):
    """Preloaded into a program that opens no INET stream socket: libpython is never loaded."""
    if not shutil.which(prog[0]):
        pytest.fail("%s is not installed (scripts/setup.sh installs it)" % prog[0])
    env = dict(os.environ, LD_PRELOAD=_lib(), LD_DEBUG="libs")
    r = subprocess.run(prog, env=env, capture_output=True, timeout=30)
    assert r.returncode == 0
    assert b"libpython" not in r.stderr
    assert b"_engine" not in r.stderr


def test_foreign_python_host_stays_plain_with_reason(cbin, tmp_path):
    log = str(tmp_path / "log")
    port = free_port()
    srv = _start_server(RUN + [cbin["pingpong"], "server", str(port)], _env(log))
    try:
        r = subprocess.run(RUN + [cbin["foreign"], str(port)], env=_env(log), capture_output=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout == b"ping\n"
        lines = open(log).read()
        assert "engine=unavailable transport=tcp reason=python_version_mismatch" in lines
        assert wait_for(lambda: "role=server" in open(log).read(), 10)
        assert "transport=shm" not in open(log).read()
    finally:
        _stop(srv)


def test_stat_lists_live_connections(cbin, tmp_path):
    log = str(tmp_path / "log")
    port = free_port()
    srv = _start_server(RUN + [cbin["pingpong"], "server", str(port)], _env(log))
    cli = subprocess.Popen(RUN + [cbin["pingpong"], "client", str(port), "4"], stdout=subprocess.PIPE, env=_env(log))
    try:
        procs = []

        def both_listed():
            procs[:] = json.loads(subprocess.check_output([sys.executable, "-m", "rdmasock", "stat", "--json"],
                                                          timeout=60))
            mine = [p for p in procs if p["pid"] in (srv.pid, cli.pid)]
            conns = [c for p in mine for c in p["connections"] if c["transport"] == "shm" and c["bytes_sent"] > 0]
            return len(conns) == 2
        assert wait_for(both_listed, 20, 0.3), procs
        mine = {p["pid"]: p for p in procs if p["pid"] in (srv.pid, cli.pid)}
        c, s = mine[cli.pid]["connections"][0], mine[srv.pid]["connections"][0]
        assert (c["role"], s["role"]) == ("client", "server")
        assert c["local"] == s["peer"] and c["peer"] == s["local"] == "127.0.0.1:%d" % port
        assert c["fallback_reason"] is None
        text = subprocess.check_output([sys.executable, "-m", "rdmasock", "stat"], text=True, timeout=60)
        assert "pingpong" in text and "shm" in text
        assert cli.wait(30) == 0
    finally:
        _stop(cli)
        _stop(srv)


_SPILL_PEERS = r"""
import socket, sys
if sys.argv[1] == "server":
    ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(1)
    print(ls.getsockname()[1], flush=True)
    c, _ = ls.accept()
    c.settimeout(60)
    assert c.recv(1) == b"x"              # the handshake is over once both have exchanged a byte
    c.sendall(b"y")
    sys.stdin.readline()                  # reads nothing more until told
    n = 0
    while True:
        d = c.recv(1 << 16)
        if not d:
            break
        n += len(d)
    print(n, flush=True)
else:
    c = socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=60)
    c.sendall(b"x")
    assert c.recv(1) == b"y"
    c.sendall(b"s" * (2 << 20))           # a timeout here ends the test as a failure
    print("sent", flush=True)
    sys.stdin.readline()
    c.close()
"""


def test_stat_shows_spilled_bytes(tmp_path):
    """A client writes 2 MiB to a server that reads nothing yet: the ring fills, the rest
    goes over the socket behind SPILL records, and `rdmasock stat` says how much, on a
    connection that stays shm; then the server gets every byte."""
    log = str(tmp_path / "log")
    srv = subprocess.Popen(RUN + ["/usr/bin/python3", "-c", _SPILL_PEERS, "server"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, env=_env(log))
    cli = None
    try:
        port = srv.stdout.readline().strip().decode()
        cli = subprocess.Popen(RUN + ["/usr/bin/python3", "-c", _SPILL_PEERS, "client", port], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, env=_env(log))
        assert cli.stdout.readline() == b"sent\n"
        procs = json.loads(subprocess.check_output([sys.executable, "-m", "rdmasock", "stat", "--json"], timeout=60))
        conns = [c for p in procs if p["pid"] == cli.pid for c in p["connections"]]
        assert len(conns) == 1 and conns[0]["transport"] == "shm", procs
        assert 0 < conns[0]["bytes_spilled"] < 2 << 20 <= conns[0]["bytes_sent"], conns
        text = subprocess.check_output([sys.executable, "-m", "rdmasock", "stat"], text=True, timeout=60)
        assert "SPILLED" in text.splitlines()[0]
        srv.stdin.write(b"go\n")
        srv.stdin.flush()
        cli.stdin.write(b"go\n")
        cli.stdin.flush()
        assert srv.stdout.readline() == b"%d\n" % (2 << 20)      # every byte after the first
        assert cli.wait(30) == 0 and srv.wait(30) == 0
        assert "reason=" not in open(log).read()
    finally:
        for p in (cli, srv):
            if p is not None:
                _stop(p)


def test_edge_triggered_writer_wakes_for_spill_and_for_room(tmp_path):
    """An edge-triggered epoll writer fills the ring while its reader is quiet: EPOLLOUT
    must come when the full ring may spill (no credit for 10 ms) and again when the reader
    frees room, never lost; 8 MiB arrive whole and the connection stays shm."""
    prog = os.path.join(HERE, "et_writer.py")
    log = str(tmp_path / "log")
    srv = subprocess.Popen(RUN + ["/usr/bin/python3", prog, "server"], stdout=subprocess.PIPE, env=_env(log))
    try:
        port = srv.stdout.readline().strip().decode()
        r = subprocess.run(RUN + ["/usr/bin/python3", prog, "client", port], capture_output=True, env=_env(log),
                           timeout=90)
        out = srv.communicate(timeout=60)[0]
    finally:
        _stop(srv)
    assert r.stdout.split()[:2] == [b"sent", b"8388608"] and not r.stderr, (r.stdout, r.stderr)
    assert out.split() == [b"got", b"8388608", b"OK"], out
    text = open(log).read()
    assert text.count("transport=shm") == 2 and "reason=" not in text, text


def test_shared_memory_unavailable_falls_back_with_reason(cbin, tmp_path):
    """A server that cannot size a memfd (RLIMIT_FSIZE 0; SIGXFSZ ignored) declines with
    shm_unavailable: the connection works as TCP and the client logs the reason."""
    log = str(tmp_path / "log")
    port = free_port()

    def limits():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    srv = subprocess.Popen(RUN + [cbin["pingpong"], "server", str(port)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=_env(log), preexec_fn=limits)
    try:
        assert b"ready" in srv.stdout.readline()
        r = subprocess.run(RUN + [cbin["pingpong"], "client", str(port), "0.3"], env=_env(log),
                           capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert b"round_trips_per_s" in r.stdout
        assert "role=client" in open(log).read()
        assert "transport=tcp reason=shm_unavailable" in open(log).read()
    finally:
        _stop(srv)


SYS_PY = "/usr/bin/python3"
ONE_CONNECTION = [SYS_PY, "-c", "import socket; s = socket.create_server(('127.0.0.1', 0)); "
                  "c = socket.create_connection(s.getsockname()); a, _ = s.accept(); c.sendall(b'x'); "
                  "print(a.recv(1).decode())"]


@pytest.mark.parametrize("writer", ["engine", "library"])
def test_log_file_is_private_and_never_followed(cbin, tmp_path, writer):
    """RDMASOCK_LOG_FILE is created 0600 and a symbolic link planted at its path is not
    followed: the file it points to stays untouched and the program runs on, its output
    intact.  Both writers: the engine (connection lines, a program connecting to itself)
    and the C library (its one engine=unavailable line, from a foreign Python host)."""

    def run_once(log_path):
        env = dict(os.environ, RDMASOCK_LOG_FILE=str(log_path))
        if writer == "engine":
            return subprocess.run(RUN + ONE_CONNECTION, env=env, capture_output=True, timeout=60)
        port = free_port()
        srv = _start_server(RUN + [cbin["pingpong"], "server", str(port)], _env(str(tmp_path / "srv.log")))
        try:
            return subprocess.run(RUN + [cbin["foreign"], str(port)], env=env, capture_output=True, timeout=60)
        finally:
            _stop(srv)

    expected = b"x\n" if writer == "engine" else b"ping\n"
    log = tmp_path / "fresh.log"
    r = run_once(log)
    assert r.returncode == 0 and not r.stderr and r.stdout == expected, r
    assert log.stat().st_size > 0 and (log.stat().st_mode & 0o777) == 0o600
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    link = tmp_path / "planted.log"
    link.symlink_to(victim)
    r2 = run_once(link)
    assert r2.returncode == 0 and not r2.stderr and r2.stdout == expected, r2
    assert victim.read_bytes() == b"untouched"


def test_threads_connecting_while_the_engine_loads_all_upgrade(tmp_path):
    """30 threads of a fresh process connect at the same moment: the first loads the
    engine, the others wait for it and are upgraded too (none slips through as plain
    TCP while the load is under way)."""
    prog = os.path.join(HERE, "echo_threads.py")
    log = str(tmp_path / "log")
    srv = subprocess.Popen(RUN + ["/usr/bin/python3", prog, "server", "30"], stdout=subprocess.PIPE, env=_env(log))
    try:
        port = srv.stdout.readline().split()[1].decode()
        r = subprocess.run(RUN + ["/usr/bin/python3", prog, "client", port, "30"], capture_output=True,
                           env=_env(log), timeout=90)
        assert r.stdout == b"ready\n" and not r.stderr, (r.stdout, r.stderr)
        assert srv.communicate(timeout=60)[0] == b'{"eof": 30}\n'
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(10)
    lines = open(log).read().splitlines()
    for role in ("client", "server"):
        mine = [l for l in lines if "role=%s " % role in l]
        assert len(mine) == 30 and all("transport=shm" in l for l in mine), mine


def test_server_poll_says_writable_only_with_room_while_the_client_is_quiet(tmp_path):
    """The client's first byte goes as a preamble frame and it then stays quiet: the
    server is still in its preamble when its ring fills.  poll() must not report POLLOUT
    for a full ring (a level-triggered writer would spin), and the 8 MiB arrive whole."""
    prog = os.path.join(HERE, "quiet_reader.py")
    log = str(tmp_path / "log")
    srv = subprocess.Popen(RUN + ["/usr/bin/python3", prog, "server"], stdout=subprocess.PIPE, env=_env(log))
    try:
        port = srv.stdout.readline().split()[1].decode()
        r = subprocess.run(RUN + ["/usr/bin/python3", prog, "client", port], capture_output=True, env=_env(log),
                           timeout=90)
        out = json.loads(srv.communicate(timeout=60)[0])
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(10)
    import hashlib
    want = hashlib.sha256(hashlib.sha256(b"seed").digest() * ((8 << 20) // 32)).hexdigest()
    assert r.stdout.split() == [b"8388608", want.encode()] and not r.stderr, (r.stdout, r.stderr)
    assert out["sent"] == 8 << 20
    assert out["spurious"] < 100, out        # 150,000 when the kernel's POLLOUT was taken as is
    assert "transport=shm" in open(log).read()


HIGHEST_FD_PROG = r"""
import hashlib, os, resource, socket, threading
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
top = hard - 1                                     # the highest number this process may have
srv = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(srv.getsockname())
s, _ = srv.accept()
c.sendall(b"a")
assert s.recv(1) == b"a"                           # both ends on the ring now
os.dup2(c.fileno(), top)
c.close()                                          # the connection lives only at `top`
hi = socket.socket(fileno=top)
data = os.urandom(3 << 20)
got = bytearray()
def read():
    while len(got) < len(data):
        got.extend(s.recv(1 << 20))
t = threading.Thread(target=read)
t.start()
hi.sendall(data)
t.join(60)
s.sendall(data[::-1])
back = bytearray()
while len(back) < len(data):
    back.extend(hi.recv(1 << 20))
hi.close()
assert s.recv(1) == b""                            # the close at `top` ended the stream
print("ok", top, bytes(got) == data, bytes(back) == data[::-1])
"""


def test_upgraded_connection_at_the_highest_descriptor(tmp_path):
    """Any descriptor number works: an upgraded connection moved (dup2) to the highest
    number RLIMIT_NOFILE's hard limit allows carries 3 MiB each way on the ring and ends
    with its close.  Had the library lost track of it there, its bytes would reach the
    peer's ring reader raw, as garbage."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    log = str(tmp_path / "log")
    r = subprocess.run(RUN + ["/usr/bin/python3", "-c", HIGHEST_FD_PROG], capture_output=True, text=True,
                       env=_env(log), timeout=120)
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert r.stdout.split() == ["ok", str(hard - 1), "True", "True"], r.stdout
    lines = open(log).read().splitlines()
    assert sum("transport=shm" in line for line in lines) == 2 and "transport=tcp" not in " ".join(lines), lines


MAPPED_PAIR = r"""
import hashlib, socket, sys
fam = {"4": socket.AF_INET, "6": socket.AF_INET6}
host = {"4": "127.0.0.1", "6": "::ffff:127.0.0.1"}
if sys.argv[1] == "server":
    ls = socket.socket(fam[sys.argv[2]])
    ls.bind((host[sys.argv[2]], 0))
    ls.listen(8)
    print("port", ls.getsockname()[1], flush=True)
    c, _ = ls.accept()
    data = b""
    while len(data) < 300000:
        data += c.recv(65536)
    c.sendall(hashlib.sha256(data).digest())
    c.close()
else:
    s = socket.socket(fam[sys.argv[3]])
    s.connect((host[sys.argv[3]], int(sys.argv[2])))
    data = bytes(range(256)) * 1172 + b"x" * 68
    s.sendall(data)
    print(s.recv(64) == hashlib.sha256(data).digest(), flush=True)
"""


@pytest.mark.parametrize("server,client", [("6", "6"), ("6", "4"), ("4", "6")])
def test_ipv4_mapped_sockets_of_family_inet6_upgrade(tmp_path, server, client):
    """Sockets of family AF_INET6 on IPv4-mapped addresses (Java's ServerSocket and
    SocketChannel, dual-stack programs) carry an IPv4 connection, which the kernel lists
    among its IPv6 sockets: the rendezvous still finds the listener's and the client's
    owners, and the connection upgrades with either end of either family (both fell back
    to TCP with peer_unverified / peer_not_rdmasock before)."""
    prog = tmp_path / "mapped.py"
    prog.write_text(MAPPED_PAIR)
    log = str(tmp_path / "log")
    srv = subprocess.Popen(RUN + [SYS_PY, str(prog), "server", server], stdout=subprocess.PIPE, env=_env(log))
    try:
        port = srv.stdout.readline().split()[1].decode()
        r = subprocess.run(RUN + [SYS_PY, str(prog), "client", port, client], capture_output=True, env=_env(log),
                           timeout=60)
        assert r.stdout == b"True\n" and not r.stderr, (r.stdout, r.stderr)
        srv.wait(30)
    finally:
        _stop(srv)
    lines = [l for l in open(log).read().splitlines() if "role=" in l]
    assert sorted(l.split("role=")[1].split()[0] for l in lines) == ["client", "server"], lines
    assert all("transport=shm" in l for l in lines), lines


FORKED_WRITER = r"""
import hashlib, os, socket, sys
if sys.argv[1] == "server":                       # echoes each connection until EOF, then closes
    ls = socket.create_server(("127.0.0.1", 0))
    print("port", ls.getsockname()[1], flush=True)
    for _ in range(int(sys.argv[2])):
        c, _ = ls.accept()
        while True:
            d = c.recv(65536)
            if not d:
                break
            c.sendall(d)
        c.close()
else:                                             # forks a writer right after connect, reads in the parent
    port, n, size = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        data = hashlib.sha256(b"%d" % i).digest() * (size // 32)
        pid = os.fork()
        if pid == 0:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            os._exit(0)
        got = bytearray()
        while True:
            d = s.recv(65536)
            if not d:
                break
            got += d
        os.waitpid(pid, 0)
        s.close()
        print(i, len(got), bytes(got) == data, flush=True)
"""


def test_client_that_forks_a_writer_right_after_connect(tmp_path):
    """A client forks right after connect, before the handshake's answer has come: the
    child writes and half-closes, the parent reads the echo (the Perl/C idiom of a writer
    child).  Both processes would have taken the answer's steps; the loser read the
    server's bytes as a broken answer (handshake_garbage) and its data never reached the
    ring: 0 to 600 of 20,000 lines arrived.  fork now waits for the answer first."""
    prog = tmp_path / "forked_writer.py"
    prog.write_text(FORKED_WRITER)
    log = str(tmp_path / "log")
    n, size = 5, 3 << 20
    srv = subprocess.Popen(RUN + [SYS_PY, str(prog), "server", str(n)], stdout=subprocess.PIPE, env=_env(log))
    try:
        port = srv.stdout.readline().split()[1].decode()
        r = subprocess.run(RUN + [SYS_PY, str(prog), "client", port, str(n), str(size)], capture_output=True,
                           env=_env(log), timeout=90)
        assert r.stdout.decode().splitlines() == ["%d %d True" % (i, size // 32 * 32) for i in range(n)], \
            (r.stdout, r.stderr)
        srv.wait(30)
    finally:
        _stop(srv)
    lines = [l for l in open(log).read().splitlines() if "role=" in l]
    assert len(lines) == 2 * n and all("transport=shm" in l for l in lines), lines


PASSED_SOCKET = r"""
import ctypes, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)          # the preloaded sendmmsg/recvmmsg come first
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
class mmsghdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.POINTER(iovec)),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int), ("len", ctypes.c_uint)]
def mmsg(payload, control):
    data, ctl = ctypes.create_string_buffer(payload, len(payload)), ctypes.create_string_buffer(control, 24)
    io = iovec(ctypes.addressof(data), len(payload))
    m = mmsghdr(None, 0, ctypes.pointer(io), 1, ctypes.addressof(ctl), len(control), 0, 0)
    return m, (data, ctl, io)
def send_fd(sock, fd):
    if sys.argv[2] == "sendmsg":
        return socket.send_fds(sock, [b"x"], [fd])
    m, keep = mmsg(b"x", struct.pack("=QiiiI", 20, socket.SOL_SOCKET, socket.SCM_RIGHTS, fd, 0))
    assert libc.sendmmsg(sock.fileno(), ctypes.byref(m), 1, 0) == 1, ctypes.get_errno()
def recv_fd(sock):
    if sys.argv[2] == "sendmsg":
        return socket.recv_fds(sock, 16, 1)[1][0]
    m, keep = mmsg(bytes(16), bytes(24))
    assert libc.recvmmsg(sock.fileno(), ctypes.byref(m), 1, 0, None) == 1, ctypes.get_errno()
    size, level, kind, fd = struct.unpack_from("=Qiii", keep[1].raw)
    assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS) and m.controllen >= 20, (level, kind)
    return fd
def echo_n(c, n):
    got = b""
    while len(got) < n:
        d = c.recv(65536)
        if not d:
            break
        got += d
    return got
# an upgraded connection, handed to another process that goes on with it
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
pid = os.fork()
if pid == 0:                                  # the receiver: goes on with the conversation
    a.close()
    s = socket.socket(fileno=recv_fd(b))
    data = bytes(range(256)) * 4000
    s.sendall(data)
    ok = echo_n(s, len(data)) == data
    s.shutdown(socket.SHUT_WR)
    print("receiver", ok, s.recv(1) == b"", flush=True)
    os._exit(0)
b.close()
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"first")
print("sender", echo_n(s, 5) == b"first", flush=True)
send_fd(a, s.fileno())
s.close()
os.waitpid(pid, 0)
"""


@pytest.mark.parametrize("call", ["sendmsg", "sendmmsg"])
def test_upgraded_socket_passed_to_another_process(tmp_path, call):
    """A process passes its upgraded connection to another (SCM_RIGHTS, with sendmsg or
    with sendmmsg and recvmmsg) and closes its copy; the receiver, which has no ring for
    it, goes on with the conversation on the kernel socket.  The connection moves to TCP
    before it is sent (reason passed), both directions, and the sender's close ends
    nothing.  Before, the receiver's bytes reached the server as garbage on its doorbell
    channel (with sendmmsg, until the vector forms looked at their messages too)."""
    prog, echo = tmp_path / "passed.py", tmp_path / "echo.py"
    prog.write_text(PASSED_SOCKET)
    echo.write_text(FORKED_WRITER)                # its server: echoes a connection until EOF
    log = str(tmp_path / "log")
    srv = subprocess.Popen(RUN + [SYS_PY, str(echo), "server", "1"], stdout=subprocess.PIPE, env=_env(log))
    try:
        port = srv.stdout.readline().split()[1].decode()
        r = subprocess.run(RUN + [SYS_PY, str(prog), port, call], capture_output=True, env=_env(log), timeout=60)
        assert sorted(r.stdout.decode().splitlines()) == ["receiver True True", "sender True"], (r.stdout, r.stderr)
        srv.wait(30)
    finally:
        _stop(srv)
    text = open(log).read()
    assert "reason=passed" in text and "role=client" in text, text



REUSEPORT_PAIR = r"""
import select, socket, sys
if sys.argv[1] == "server":              # two listeners of one port (SO_REUSEPORT): the kernel spreads
    lss = []                              # connections over both; only one can hold the port's name
    port = 0
    for _ in range(2):
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        ls.bind(("127.0.0.1", port))
        ls.listen(64)
        port = ls.getsockname()[1]
        lss.append(ls)
    print("port", port, flush=True)
    served = [0, 0]
    for _ in range(int(sys.argv[2])):
        ready, _, _ = select.select(lss, [], [], 30)
        i = lss.index(ready[0])
        c, _ = lss[i].accept()
        served[i] += 1
        c.sendall(c.recv(100).upper())
        c.close()
    print("served", *served, flush=True)
else:
    bad = 0
    for i in range(int(sys.argv[3])):
        s = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
        s.sendall(b"ping %d" % i)
        bad += s.recv(100) != b"PING %d" % i
        s.close()
    print("bad", bad, flush=True)
"""


def test_reuseport_listeners_without_the_name_answer_too(tmp_path):
    """Two listening sockets share a port (SO_REUSEPORT, as nginx's `reuseport` and Node's
    cluster with SCHED_NONE do).  One holds the port's rendezvous name, so every client
    sends a HELLO; connections the kernel gives to the other must be answered too.  That
    one was not a listener of ours: its connections read the HELLO as data."""
    served = _pair_answers_every_ping(tmp_path, REUSEPORT_PAIR, REUSEPORT_PAIR, 40).split()
    assert served[0] == b"served" and int(served[2]) > 0, served      # the second listener got some


INHERITED_LISTENER = r"""
import socket, subprocess, sys
if sys.argv[1] == "server":              # listens (and so holds the port's name), then runs a worker
    ls = socket.create_server(("127.0.0.1", 0))      # that accepts on the inherited socket
    print("port", ls.getsockname()[1], flush=True)
    w = subprocess.run([sys.executable, __file__, "worker", str(ls.fileno()), sys.argv[2]], pass_fds=[ls.fileno()])
    sys.exit(w.returncode)
elif sys.argv[1] == "worker":
    ls = socket.socket(fileno=int(sys.argv[2]))
    for _ in range(int(sys.argv[3])):
        c, _ = ls.accept()
        c.sendall(c.recv(100).upper())
        c.close()
"""


def test_listening_socket_inherited_by_a_worker_answers(tmp_path):
    """A server listens (its port's name is registered) and runs a worker program that
    accepts on the inherited listening socket without calling listen() (a server's binary
    upgrade, socket activation, a listener received with SCM_RIGHTS).  Clients find the
    name and send a HELLO; the worker, which had no listener of ours, read it as data."""
    _pair_answers_every_ping(tmp_path, INHERITED_LISTENER, REUSEPORT_PAIR, 10)  # its client: pings answered upper-case


def _pair_answers_every_ping(tmp_path, server_src, client_src, n):
    """Runs `server_src server n` and `client_src client PORT n`, both preloaded: the client
    must print "bad 0", the server exit 0, and every connection be logged shm by both.
    Returns what the server printed after its port."""
    prog, client = tmp_path / "server.py", tmp_path / "client.py"
    prog.write_text(server_src)
    client.write_text(client_src)
    log = str(tmp_path / "log")
    srv = subprocess.Popen(RUN + [SYS_PY, str(prog), "server", str(n)], stdout=subprocess.PIPE, env=_env(log))
    try:
        port = srv.stdout.readline().split()[1].decode()
        r = subprocess.run(RUN + [SYS_PY, str(client), "client", port, str(n)], capture_output=True, env=_env(log),
                           timeout=90)
        assert r.stdout == b"bad 0\n" and not r.stderr, (r.stdout, r.stderr)
        out = srv.communicate(timeout=30)[0]
        assert srv.returncode == 0
    finally:
        _stop(srv)
    lines = [l for l in open(log).read().splitlines() if "role=" in l and "role=listener" not in l]
    assert len(lines) == 2 * n and all("transport=shm" in l for l in lines), lines
    return out


ONESHOT_WAITER = r"""
import select, socket, sys, time
if sys.argv[1] == "server":                 # answers each client's request after a pause
    ls = socket.create_server(("127.0.0.1", 0))
    print("port", ls.getsockname()[1], flush=True)
    for _ in range(int(sys.argv[2])):
        c, _ = ls.accept()
        want = c.recv(100)
        time.sleep(0.2)
        c.sendall(want.upper())
        c.close()
    sys.exit(0)
port, n = int(sys.argv[2]), int(sys.argv[3])
bad = 0
for i in range(n):                         # Erlang's way: a non-blocking connect, one-shot
    s = socket.socket()                     # registrations armed again for each wait
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    ep = select.epoll()
    ep.register(s.fileno(), select.EPOLLOUT | select.EPOLLONESHOT)
    ok = ep.poll(5) == [(s.fileno(), select.EPOLLOUT)]
    s.send(b"ping %d" % i)
    ep.modify(s.fileno(), select.EPOLLIN | select.EPOLLONESHOT)
    got = b""
    deadline = time.monotonic() + 5
    while ok and not got.endswith(b"PING %d" % i) and time.monotonic() < deadline:
        if ep.poll(max(0.0, deadline - time.monotonic())):
            try:
                chunk = s.recv(100)
            except BlockingIOError:
                chunk = b"?"
            if not chunk:
                break
            got += chunk
            ep.modify(s.fileno(), select.EPOLLIN | select.EPOLLONESHOT)
    bad += got != b"PING %d" % i
    ep.close()
    s.close()
print("bad", bad)
"""


def test_one_shot_epoll_waiter_is_woken_after_the_handshake(tmp_path):
    """A one-shot registration for input (EPOLLONESHOT, armed again with EPOLL_CTL_MOD after
    each event, as Erlang's runtime does) whose kernel event fired on the server's handshake
    answer.  That event carries nothing of the program's, so it is not reported, and the
    registration must be armed again: it was left spent, and the server's data, 200 ms
    later, woke nobody (every connection timed out)."""
    _pair_answers_every_ping(tmp_path, ONESHOT_WAITER, ONESHOT_WAITER, 5)


FORK_COUNTS = r"""
import os, socket, struct, sys, threading
if sys.argv[1] == "server":               # echoes each connection until EOF, all at once
    def serve(c):
        while d := c.recv(65536):
            c.sendall(d)
        c.close()
    ls = socket.create_server(("127.0.0.1", 0))
    print("port", ls.getsockname()[1], flush=True)
    threads = []
    for _ in range(int(sys.argv[2])):
        threads.append(threading.Thread(target=serve, args=(ls.accept()[0],)))
        threads[-1].start()
    for t in threads:
        t.join()
    sys.exit(0)
port = int(sys.argv[1])
def echo(s, data):
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        d = s.recv(65536)
        if not d:
            break
        got += d
    return got == data
def received(s):
    return struct.unpack_from("=QQ", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232), 120)
a = socket.create_connection(("127.0.0.1", port))
assert echo(a, b"a" * 1000)
go_r, go_w = os.pipe()
done_r, done_w = os.pipe()
pid = os.fork()
if pid == 0:                              # goes on with the connection it inherited
    os.read(go_r, 1)
    ok = echo(a, b"c" * 3000)
    os.write(done_w, b"%d %d %d\n" % ((ok,) + received(a)))
    sys.stdin.readline()
    os._exit(0)
os.close(done_w)                          # the child's end: EOF here if it dies
a.close()
b = socket.create_connection(("127.0.0.1", port))     # may take the row `a` had in this process
assert echo(b, b"p" * 500)
os.write(go_w, b"g")
print(pid, os.read(done_r, 100).decode().strip(), *received(b), flush=True)
sys.stdin.readline()
os.waitpid(pid, 0)
"""


def test_forked_child_counts_its_inherited_connection_apart(tmp_path):
    """A child goes on with a connection it inherited while the parent closes its copy and
    opens another.  The child's bytes are the child's: its TCP_INFO counts the inherited
    connection's whole stream, `rdmasock stat` shows that connection under the child, and
    the parent's new connection counts only its own bytes, even where it reuses the row
    the closed one had in the parent's table."""
    prog = tmp_path / "forkcounts.py"
    prog.write_text(FORK_COUNTS)
    log = str(tmp_path / "log")
    srv = subprocess.Popen(RUN + [SYS_PY, str(prog), "server", "2"], stdout=subprocess.PIPE, env=_env(log))
    cli = None
    try:
        port = srv.stdout.readline().split()[1].decode()
        cli = subprocess.Popen(RUN + [SYS_PY, str(prog), port], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               env=_env(log))
        assert select.select([cli.stdout], [], [], 60)[0], "the program said nothing in 60 s"
        line = cli.stdout.readline()
        child, ok, child_acked, child_received, acked, received = map(int, line.split())
        assert ok == 1 and (child_acked, child_received) == (4001, 4000)   # Linux counts the SYN as acked
        assert (acked, received) == (501, 500)
        procs = json.loads(subprocess.check_output([sys.executable, "-m", "rdmasock", "stat", "--json"], timeout=60))
        rows = {p["pid"]: [(c["bytes_sent"], c["bytes_received"], c["transport"]) for c in p["connections"]]
                for p in procs}
        assert rows.get(cli.pid) == [(500, 500, "shm")], procs
        assert rows.get(child) == [(4000, 4000, "shm")], procs
        cli.stdin.write(b"\n\n")
        cli.stdin.close()
        assert cli.wait(30) == 0
        srv.wait(30)
    finally:
        for p in (cli, srv):
            if p is not None:
                _stop(p)


NONBLOCKING_PREAMBLE = r"""
import hashlib, socket, sys
data = hashlib.sha256(b"seed").digest() * (1 << 15)        # 1 MiB, never repeating within 32 B
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
l.bind(("127.0.0.1", 0))
l.listen(1)
c = socket.socket()
c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
c.connect(l.getsockname())
c.setblocking(False)
sent = 0
try:                                         # before the server's answer: nobody reads
    while sent < len(data):
        sent += c.send(data[sent:sent + 65536])
except BlockingIOError:
    pass
first = sent
a, _ = l.accept()
a.settimeout(10)
got = bytearray()
while len(got) < sent:                       # the bytes the writes took, no more
    got += a.recv(1 << 16)
assert bytes(got) == data[:sent], "first bytes differ"
while sent < len(data):                      # one thread both ends, as an event loop
    try:
        sent += c.send(data[sent:sent + 65536])
    except BlockingIOError:
        got += a.recv(1 << 16)
c.shutdown(socket.SHUT_WR)
while True:
    b = a.recv(1 << 16)
    if not b:
        break
    got += b
assert bytes(got) == data, "stream differs"
c3 = socket.socket()                         # ends its writing with a write taken in part
c3.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
c3.connect(l.getsockname())
c3.setblocking(False)
n3 = 0
try:
    while True:
        n3 += c3.send(data[n3:n3 + 65536])
except BlockingIOError:
    pass
c3.shutdown(socket.SHUT_WR)
a3, _ = l.accept()
a3.settimeout(10)
got3 = bytearray()
while True:
    b = a3.recv(1 << 16)
    if not b:
        break
    got3 += b
assert bytes(got3) == data[:n3], "the bytes before the half-close differ"
a3.sendall(b"bye")
a3.close()
c3.setblocking(True)
c3.settimeout(10)
back = b""
while True:
    b = c3.recv(100)
    if not b:
        break
    back += b
assert back == b"bye", back
print("ok", first > 0, n3 > 0)
"""


@pytest.mark.parametrize("preload", [False, True], ids=["tcp", "rdmasock"])
def test_nonblocking_write_before_the_answer_never_blocks(tmp_path, preload):
    """A non-blocking client writes before the server's answer into a socket that cannot
    take a whole preamble frame (its own listener, in the same thread, does not read
    yet).  Its writes return what fit, then EAGAIN, as over TCP; they used to wait for
    room for the frame's tail, for ever.  The frame left open is finished by the next
    writes, and the stream arrives whole; a client that half-closes instead leaves its
    server what came, then the end of the stream, and reads the server's answer."""
    log = str(tmp_path / "log")
    r = subprocess.run((RUN if preload else []) + [SYS_PY, "-c", NONBLOCKING_PREAMBLE], capture_output=True,
                       env=_env(log), timeout=60)
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert r.stdout.split() == [b"ok", b"True", b"True"]
    if preload:
        assert "transport=shm" in open(log).read()
