"""The rendezvous's look-up of abstract UNIX names in the kernel's unix_diag dump
(rdmasock/sockdiag.py, shim/rs_diag.c): exact names among many, their owners, and a clear
answer for every malformed or failed dump."""
import errno
import os
import socket
import struct

from rdmasock import rendezvous, sockdiag
from rdmasock._native import ffi, lib


def _listen(name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(b"\0" + name)
    s.listen(1)
    return s


def test_exact_names_among_many_listeners():
    base = rendezvous.PREFIX + b"test/%d/" % os.getpid()
    socks = [_listen(base + b"%d" % i) for i in range(300)]        # a storm's worth of names
    try:
        want = [base + b"7", base + b"70", base + b"299", base + b"300", base + b"2"]
        found = sockdiag.abstract_listeners(want)
        assert found == {base + b"7": os.geteuid(), base + b"70": os.geteuid(),
                         base + b"299": os.geteuid(), base + b"2": os.geteuid()}
        assert sockdiag.abstract_listeners([base]) == {}          # a prefix of names is not a name
    finally:
        for s in socks:
            s.close()
    assert sockdiag.abstract_listeners([base + b"7"]) == {}


def _msg(mtype, body):
    return struct.pack("=IHHII", 16 + len(body), mtype, 0, 1, 0) + body + b"\0" * (-len(body) % 4)


def _attr(atype, value):
    return struct.pack("=HH", 4 + len(value), atype) + value + b"\0" * (-len(value) % 4)


def _sock(name, uid=None):
    body = b"\0" * 16 + _attr(0, name)                              # unix_diag_msg, UNIX_DIAG_NAME
    if uid is not None:
        body += _attr(7, struct.pack("=I", uid))                    # UNIX_DIAG_UID
    return _msg(20, body)


def _scan(chunk, names):
    wanted = [b"\0" + n for n in names]
    uids = ffi.new("int64_t[]", [-1] * len(names))
    lens = ffi.new("uint32_t[]", [len(w) for w in wanted])
    r = lib.rs_diag_unix_scan(chunk, len(chunk), b"".join(wanted), lens, len(names), uids)
    return r, list(uids)


def test_scan_of_crafted_dumps():
    a, b = b"rdmasock/1/c/127.0.0.1/5", b"rdmasock/1/c/127.0.0.1/55"
    # found with its owner, across chunks; the end of the dump says so
    assert _scan(_sock(b"\0" + a, 1000), [a, b]) == (0, [1000, -1])
    assert _scan(_sock(b"\0" + b, 0) + _msg(3, b"\0" * 4), [a, b]) == (1, [-1, 0])
    # a path name, or the name without its NUL, is another name
    assert _scan(_sock(a, 5) + _sock(b"/" + a, 6) + _msg(3, b""), [a]) == (1, [-1])
    # a kernel without owners in its answer (Linux < 5.3)
    assert _scan(_sock(b"\0" + a), [a]) == (0, [lib.RS_DIAG_NO_UID])
    # the kernel's error, and an error message that carries none
    assert _scan(_msg(2, struct.pack("=i", -errno.EPERM)), [a]) == (-errno.EPERM, [-1])
    assert _scan(_msg(2, struct.pack("=i", 0)), [a]) == (1, [-1])
    assert _scan(_msg(2, b""), [a]) == (-errno.EIO, [-1])
    # malformed: a length shorter than a header, or past the chunk
    assert _scan(struct.pack("=IHHII", 8, 20, 0, 1, 0), [a])[0] == -errno.EPROTO
    assert _scan(_sock(b"\0" + a, 1)[:-4], [a])[0] == -errno.EPROTO
    # an attribute running past its message is ignored, not read beyond it
    bad = b"\0" * 16 + struct.pack("=HH", 200, 0) + b"\0" + a
    assert _scan(_msg(20, bad) + _msg(3, b""), [a]) == (1, [-1])


def test_malformed_dump_is_a_clear_error(monkeypatch):
    class Fake:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def settimeout(self, t):
            pass

        def sendto(self, *a):
            pass

        def recv(self, n):
            return struct.pack("=IHHII", 9999, 20, 0, 1, 0)

    monkeypatch.setattr(sockdiag.socket, "socket", Fake)
    try:
        sockdiag.abstract_listeners([b"x"])
    except sockdiag.Unavailable as exc:
        assert exc.errno == errno.EPROTO and "malformed" in str(exc)
    else:
        raise AssertionError("a malformed dump was accepted")


def _pair(family, host):
    srv = socket.socket(family)
    srv.bind((host, 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname()[:2], timeout=5)
    acc, _ = srv.accept()
    srv.close()
    return cli, acc


def test_connection_owner_exact_lookup_and_fallback(monkeypatch):
    """The owner of one TCP connection (shim/rs_diag.c's exact lookup, which the C server
    side uses too): IPv4, IPv6 and IPv4-mapped ends, none for a connection that does not
    exist, and the same answers from /proc/net/tcp when netlink cannot say.  The third pair
    is of AF_INET6 sockets with IPv4-mapped addresses (Java's, dual-stack programs'): the
    kernel lists them among the IPv6 sockets, yet they are the IPv4 connection's."""
    import rdmasock._native as native
    pairs = [_pair(socket.AF_INET, "127.0.0.1"), _pair(socket.AF_INET6, "::1"),
             _pair(socket.AF_INET6, "::ffff:127.0.0.1")]
    try:
        def answers():
            out = []
            for cli, acc in pairs:
                local, remote = cli.getsockname()[:2], cli.getpeername()[:2]
                out.append(sockdiag.connection_owner(local, remote))
                out.append(sockdiag.connection_owner(remote, local))       # the accepted end
            cli = pairs[0][0]
            mapped = lambda a: ("::ffff:" + a[0], a[1])
            out.append(sockdiag.connection_owner(mapped(cli.getsockname()), mapped(cli.getpeername())))
            out.append(sockdiag.connection_owner(("127.0.0.1", 1), ("127.0.0.1", 2)))
            out.append(sockdiag.connection_owner(("127.0.0.1", 1), ("::1", 2)))  # families differ
            return out
        me = os.geteuid()
        assert answers() == [me] * 7 + [None, None]

        class NoNetlink:
            @staticmethod
            def rs_diag_tcp_owner(*args):
                return -errno.EPROTONOSUPPORT
        monkeypatch.setattr(native, "lib", NoNetlink)
        assert answers() == [me] * 7 + [None, None]
    finally:
        for p in pairs:
            for s in p:
                s.close()


def test_listener_of_family_inet6_on_an_ipv4_mapped_address():
    """A listener of family AF_INET6 bound to ::ffff:127.0.0.1 (Java's ServerSocket) takes
    connections to 127.0.0.1: its owner is the listener's for (127.0.0.1, port), so a
    client looking it up before connecting finds it."""
    srv = socket.socket(socket.AF_INET6)
    try:
        srv.bind(("::ffff:127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        assert sockdiag.listener_owners("127.0.0.1", port) == {os.geteuid()}
        assert sockdiag.listener_owners("::ffff:127.0.0.1", port) == {os.geteuid()}
        assert sockdiag.listener_owners("127.0.0.2", port) == set()
    finally:
        srv.close()
