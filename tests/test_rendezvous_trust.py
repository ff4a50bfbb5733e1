"""A local user who is not the peer gets nothing (issue 15, point 3).

A hostile process running as `nobody` squats rendezvous names and injects descriptors into
a client's name.  Each attack must end in plain TCP with a visible reason (or a clean
upgrade), with no error, no stall over 100 ms and no byte lost or added."""
import socket
import subprocess
import textwrap
import threading
import time


import rdmasock
from rdmasock import rendezvous
from conftest import recv_exact

STALL = 0.1          # seconds: the most an attack may add to a connection's set-up
HOSTILE_USER = "nobody"

SQUATTER = textwrap.dedent(r"""
    import socket, sys, time
    names = sys.argv[1:]
    socks = []
    for n in names:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(b"\0" + n.encode())
        s.listen(16)
        socks.append(s)
    print("ready", flush=True)
    sys.stdin.read()                     # until the test closes our stdin
""")

INJECTOR = textwrap.dedent(r"""
    # Watches /proc/net/unix for client names and passes each a TCP socket that has unsent
    # data and SO_LINGER {1, 10}: a victim that closes it without care blocks for 10 s.
    import array, socket, struct, sys, time
    prefix = sys.argv[1]
    deadline = time.monotonic() + float(sys.argv[2])
    sink = socket.create_server(("127.0.0.1", 0))            # accepts, never reads
    seen, sent = set(), 0
    print("ready", flush=True)
    while time.monotonic() < deadline:
        with open("/proc/net/unix") as f:
            names = [l.split()[-1] for l in f if ("@" + prefix + "c/") in l]
        for n in names:
            if n in seen:
                continue
            seen.add(n)
            lingering = socket.create_connection(sink.getsockname())
            lingering.setblocking(False)
            try:
                while True:
                    lingering.send(b"x" * 65536)
            except BlockingIOError:
                pass
            lingering.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 10))
            try:
                c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                c.connect(b"\0" + n[1:].encode())
                c.sendmsg([b"RSKFD2" + b"\0" * 16], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                     array.array("i", [lingering.fileno()]))])
                sent += 1
                c.close()
            except OSError:
                pass
            lingering.close()
        time.sleep(0.0005)
    print("sent", sent, flush=True)
""")


def _as_nobody(code, *args):
    p = subprocess.Popen(["setpriv", "--reuid=" + HOSTILE_USER, "--regid=nogroup", "--clear-groups", "--",
                          "/usr/bin/python3", "-c", code] + list(args),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise RuntimeError("hostile helper failed: %s" % p.stderr.read())
    return p


def _stop(p):
    try:
        p.stdin.close()
    except OSError:
        pass
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


def _name(kind, ip, port):
    return rendezvous._name(kind, ip, port).decode()


def test_squatted_listener_name_in_front_of_a_plain_server():
    """`nobody` registers the listener name of a plain echo server's port: the rdmasock
    client must not send it a HELLO (that would be garbage for the plain server)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    squat = _as_nobody(SQUATTER, _name("l", "127.0.0.1", port))
    try:
        def echo():
            s, _ = srv.accept()
            with s:
                data = recv_exact(s, 5)
                s.sendall(data.upper())
        t = threading.Thread(target=echo, daemon=True)
        t.start()
        t0 = time.monotonic()
        c = rdmasock.create_connection(("127.0.0.1", port), timeout=5)
        c.sendall(b"hello")
        assert recv_exact(c, 5) == b"HELLO"
        elapsed = time.monotonic() - t0
        assert c.transport == "tcp" and c.fallback_reason == "peer_unverified"
        assert elapsed < STALL, elapsed
        c.close()
        t.join(5)
    finally:
        _stop(squat)
        srv.close()


def test_squatted_client_name_server_speaks_first():
    """`nobody` registers the client name for the port a client will use: the client stays
    plain (marker_busy) and the rdmasock server, which would otherwise wait for a HELLO
    that never comes, greets at once."""
    srv = rdmasock.create_server(("127.0.0.1", 0))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    cport = probe.getsockname()[1]
    probe.close()
    squat = _as_nobody(SQUATTER, _name("c", "127.0.0.1", cport))
    try:
        greeted = []

        def greeter():
            s, _ = srv.accept()
            with s:
                s.sendall(b"220 ready\r\n")
                greeted.append((s.transport, s.fallback_reason, recv_exact(s, 4)))
        t = threading.Thread(target=greeter, daemon=True)
        t.start()
        c = rdmasock.socket()
        c.settimeout(5)
        c.bind(("127.0.0.1", cport))
        t0 = time.monotonic()
        c.connect(("127.0.0.1", srv.getsockname()[1]))
        assert recv_exact(c, 11) == b"220 ready\r\n"
        elapsed = time.monotonic() - t0
        c.sendall(b"QUIT")
        t.join(5)
        assert c.fallback_reason == "marker_busy"
        assert greeted == [("tcp", "peer_unverified", b"QUIT")]
        assert elapsed < STALL, elapsed
        c.close()
    finally:
        _stop(squat)
        srv.close()


def test_plain_client_behind_a_squatted_name_is_not_delayed():
    """A plain client whose port `nobody` squatted: a server-speaks-first rdmasock server
    greets at once."""
    srv = rdmasock.create_server(("127.0.0.1", 0))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    cport = probe.getsockname()[1]
    probe.close()
    squat = _as_nobody(SQUATTER, _name("c", "127.0.0.1", cport))
    try:
        def greeter():
            s, _ = srv.accept()
            with s:
                s.sendall(b"220 ready\r\n")
                recv_exact(s, 1)
        t = threading.Thread(target=greeter, daemon=True)
        t.start()
        c = socket.socket()
        c.settimeout(5)
        c.bind(("127.0.0.1", cport))
        t0 = time.monotonic()
        c.connect(("127.0.0.1", srv.getsockname()[1]))
        assert recv_exact(c, 11) == b"220 ready\r\n"
        assert time.monotonic() - t0 < STALL
        c.sendall(b"x")
        t.join(5)
        c.close()
    finally:
        _stop(squat)
        srv.close()


def test_injected_descriptors_neither_stall_nor_count():
    """`nobody` passes lingering TCP sockets to every client name it sees.  The server
    accepts late, so the injections land first; each connection still upgrades, with the
    server's descriptor, and no set-up takes 100 ms longer than it should."""
    inj = _as_nobody(INJECTOR, rendezvous.PREFIX.decode(), "3")
    srv = rdmasock.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    try:
        for i in range(10):
            c = rdmasock.create_connection(("127.0.0.1", port), timeout=5)
            time.sleep(0.05)                         # the injector's chance to strike
            s, _ = srv.accept()
            t0 = time.monotonic()
            c.sendall(b"ping%d" % i)
            got = recv_exact(s, len(b"ping%d" % i))
            s.sendall(b"pong")
            assert recv_exact(c, 4) == b"pong"
            elapsed = time.monotonic() - t0
            assert got == b"ping%d" % i
            assert (c.transport, s.transport) == ("shm", "shm"), (c.fallback_reason, s.fallback_reason)
            assert elapsed < STALL, elapsed
            c.close()
            s.close()
    finally:
        srv.close()
        try:
            out, _ = inj.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            inj.kill()
            out, _ = inj.communicate(timeout=5)
    sent = int(out.split()[1]) if out.startswith("sent") else 0
    assert sent >= 5, "the injector reached only %d of 10 clients: the test proves nothing (%r)" % (sent, out)
