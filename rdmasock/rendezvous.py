"""Same-host peer detection, proven, without sending a byte a plain program would receive.

Two kinds of abstract UNIX names (SOCK_SEQPACKET listeners; the network namespace is
part of the name, as abstract names are per namespace):

    rdmasock/<netns>/l/<ip>/<port>    this TCP listener runs rdmasock (registered at listen)
    rdmasock/<netns>/c/<ip>/<port>    this TCP client will send a HELLO (registered before
                                      its connect, so the server knows before its accept)

Any local user can bind an abstract name and see every name in /proc/net/unix, so a name
proves nothing by itself.  It counts only if its owner is the owner of the TCP endpoint it
speaks for: the name's uid (kernel unix_diag) must equal the TCP socket's uid (sock_diag;
sockdiag.py).  A name that fails the check makes the connection stay plain TCP with reason
`peer_unverified`, at once: a squatter can prevent an upgrade, never break or delay a
connection.  Processes of the same uid trust each other (they could ptrace each other).

The listener's name refuses every connection (shut down for reading): it only exists to be
looked up.  The client's name accepts the one connection over which the server passes the
shared-memory descriptor, in a message that carries the nonce of the client's HELLO (sent
only over the TCP connection, so only the TCP peer knows it).  Connections from anybody
else are shut down and drained with every descriptor they passed made harmless first
(`defuse`): closing a received TCP socket with SO_LINGER set would otherwise block."""
import array
import errno
import ipaddress
import os
import socket as _socket
import _socket as _c        # the C socket type: its methods even when socket.socket is patched
import stat
import struct

from . import sockdiag
from ._native import ffi, lib

FD_TAG = ffi.string(lib.rs_fd_tag())   # shim/rs_answer.c passes the segment too

CLIENT_BACKLOG = 4          # the server's connection, plus a few of anybody else's
SCM_MAX_FD = 253            # the kernel's limit of descriptors in one message
MAX_STRAY_MESSAGES = 64     # per stray connection, before it is closed


def _netns():
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


NETNS = _netns()
PREFIX = ("rdmasock/%d/" % NETNS).encode()


def norm_ip(ip):
    """Canonical text of an address; '*' for the unspecified address."""
    try:
        a = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return ip
    if a.version == 6 and a.ipv4_mapped:
        a = a.ipv4_mapped
    return "*" if a.is_unspecified else str(a)


def _name(kind, ip, port):
    return PREFIX + ("%s/%s/%d" % (kind, ip, port)).encode()


def _register(name, backlog):
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_NONBLOCK | _socket.SOCK_CLOEXEC)
    try:
        s.bind(b"\0" + name)
        s.listen(backlog)
    except OSError:
        s.close()
        return None
    return s


def register_listener(sock):
    """Returns the marker socket (keep it open while listening) or None if taken.
    A wildcard listener registers by family: "*4" (0.0.0.0), "*6" (:: v6-only) or "*46"
    (:: dual-stack), so a client only trusts a listener that can really accept it."""
    sockname = sock.getsockname()
    ip = norm_ip(sockname[0])
    if ip == "*":
        if sock.family == _socket.AF_INET:
            ip = "*4"
        else:
            v6only = _c.socket.getsockopt(sock, _socket.IPPROTO_IPV6, _socket.IPV6_V6ONLY)
            ip = "*6" if v6only else "*46"
    m = _register(_name("l", ip, sockname[1]), 1)
    if m is not None:
        _drain(m, None)                       # connects are refused: the name is only looked up
    return m


def listener_status(ip, port):
    """Before a connect: (status, detail) with status "absent" (no rdmasock listener),
    "ok" (a listener name whose owner owns a TCP listener for (ip, port)) or "unverified"."""
    ip = norm_ip(ip)
    if ip == "*":
        return "absent", None
    wild = ("*4", "*46") if ":" not in ip else ("*6", "*46")
    try:
        names = sockdiag.abstract_listeners([_name("l", n, port) for n in (ip,) + wild])
        if not names:
            return "absent", None
        tcp = sockdiag.listener_owners(ip, port)
    except sockdiag.Unavailable as exc:
        return "unverified", "cannot look up socket owners: %s" % exc
    if set(names.values()) & tcp:
        return "ok", None
    return "unverified", "listener name owned by uid %s, TCP listener by uid %s" % (
        ",".join(map(str, sorted(set(names.values())))), ",".join(map(str, sorted(tcp))) or "none")


def register_client(sock, ip, port):
    """Before connect, on a socket bound to (ip, port): the marker socket, or None if the
    name is taken.  The server checks the name's owner against this socket's, so a process
    whose credentials changed since it made the socket does not claim one."""
    if os.fstat(sock.fileno()).st_uid != os.geteuid():
        return None
    return _register(_name("c", norm_ip(ip), port), CLIENT_BACKLOG)


def client_status(peer, local):
    """After accept of peer by a server at local: "ok" if the client registered its name
    and owns the TCP socket at the other end; "absent"; or "unverified".  If the owners
    cannot be looked up at all, a registered name counts: a client that registered one
    sends a HELLO, and a plain server must never read it as data."""
    try:
        names = sockdiag.abstract_listeners([_name("c", norm_ip(peer[0]), peer[1])])
    except sockdiag.Unavailable:
        return "ok", "cannot look up socket owners"
    if not names:
        return "absent", None
    try:
        uid = sockdiag.connection_owner((peer[0], peer[1]), (local[0], local[1]))
    except sockdiag.Unavailable:
        return "ok", "cannot look up the TCP socket's owner"
    if uid is not None and uid in names.values():
        return "ok", None
    return "unverified", "client name owned by uid %s, TCP socket by uid %s" % (
        ",".join(map(str, names.values())), uid)


def client_name(ip, port):
    """The rendezvous name of the client at (ip, port), without the leading NUL."""
    return _name("c", norm_ip(ip), port)


def client_prefix():
    """What every client name starts with: the rest is "<ip>/<port>" (shim/rs_answer.c)."""
    return PREFIX + b"c/"


def send_fd(client_ip, client_port, nonce, fds):
    """Server side: passes the segment descriptor (and the event bells, if any: fds is a
    list) to the client's name, with the HELLO's nonce.  Raises OSError if the name does
    not take the connection."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_NONBLOCK | _socket.SOCK_CLOEXEC)
    try:
        s.connect(b"\0" + client_name(client_ip, client_port))
        s.shutdown(_socket.SHUT_RD)           # nothing is ever read from it
        rights = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", fds))]
        s.sendmsg([FD_TAG + nonce], rights, _socket.MSG_DONTWAIT | _socket.MSG_NOSIGNAL)
    finally:
        s.close()


def defuse(fds):
    """Closes descriptors somebody passed us without blocking: a TCP socket with SO_LINGER
    and unsent data would hold close() for its linger time, so sockets are reset instead."""
    for fd in fds:
        try:
            is_sock = stat.S_ISSOCK(os.fstat(fd).st_mode)
        except OSError:
            is_sock = False
        if is_sock:
            try:
                s = _socket.socket(fileno=fd)
            except OSError:
                is_sock = False
            else:
                try:
                    s.setsockopt(_socket.SOL_SOCKET, _socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
                s.close()
        if not is_sock:
            try:
                os.close(fd)
            except OSError:
                pass


def _read_message(conn):
    """One message and its descriptors (all taken off the socket), or None at EOF/empty."""
    try:
        data, anc, flags, _ = conn.recvmsg(64, _socket.CMSG_SPACE(4 * SCM_MAX_FD),
                                           _socket.MSG_DONTWAIT | _socket.MSG_CMSG_CLOEXEC)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return None
    fds = array.array("i")
    for level, kind, payload in anc:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if not data and not fds:
        return None
    return data, list(fds), flags


def recv_fd(marker, nonce):
    """Client side, once the server answered ACCEPT: the descriptors the server passed with
    our nonce (the segment's, then the event bells', if any: a list of 1 or 3), or None."""
    return _drain(marker, nonce)


def _drain(marker, nonce):
    """Stops the marker taking connections and reads every connection queued in it to the
    end.  Returns the descriptors passed with FD_TAG + nonce (if nonce is given); every other
    descriptor anybody passed is closed harmlessly."""
    try:
        marker.shutdown(_socket.SHUT_RD)      # refuse new connections: the backlog is finite
    except OSError:
        pass
    got = None
    for _ in range(CLIENT_BACKLOG + 8):
        try:
            conn, _ = marker.accept()
        except (BlockingIOError, InterruptedError, OSError):
            break
        try:
            conn.shutdown(_socket.SHUT_RD)    # whatever is queued now is all there will be
        except OSError:
            pass
        for _ in range(MAX_STRAY_MESSAGES):
            msg = _read_message(conn)
            if msg is None:
                break
            data, fds, flags = msg
            if got is None and nonce is not None and data == FD_TAG + nonce and len(fds) in (1, 3) \
                    and not flags & _socket.MSG_CTRUNC:
                got, fds = fds, []
            defuse(fds)
        conn.close()
    return got


def close_marker(marker):
    """Closes a marker after draining it (_drain): never lets the kernel drop a stranger's
    descriptors in our process."""
    _drain(marker, None)
    marker.close()


def is_local_bind_error(exc):
    return exc.errno in (errno.EADDRNOTAVAIL, errno.EINVAL)
