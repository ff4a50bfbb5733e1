"""Who owns a TCP endpoint on this host: the uid the kernel records for a socket.

The rendezvous (rendezvous.py) proves that the process on the other end of an abstract
UNIX socket is the one on the other end of the TCP connection, by comparing the UNIX
peer's SO_PEERCRED uid with the uid of the TCP socket.  That uid comes from the kernel's
sock_diag interface (netlink, the interface `ss` uses): one exact lookup by address and
port (shim/rs_diag.c), which any user may make, like reading /proc/net/tcp.  The
listeners of a port are a dump, read here.  /proc/net/tcp{,6} is the fallback where
netlink is unavailable."""
import errno
import ipaddress
import os
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
TCP_ESTABLISHED, TCP_LISTEN = 1, 10
NOCOOKIE = 0xFFFFFFFF

NLMSGHDR = struct.Struct("=IHHII")
SOCKID = struct.Struct(">HH16s16s")                 # ports and addresses are big endian
REQ_HEAD = struct.Struct("=BBBBI")                  # family, protocol, ext, pad, states
REQ_TAIL = struct.Struct("=III")                    # if, cookie[2]
MSG_HEAD = struct.Struct("=BBBB")                   # family, state, timer, retrans
MSG_TAIL = struct.Struct("=IIIII")                  # expires, rqueue, wqueue, uid, inode
MSG_LEN = MSG_HEAD.size + SOCKID.size + REQ_TAIL.size + MSG_TAIL.size
TIMEOUT = 1.0


class Unavailable(OSError):
    """Neither sock_diag nor /proc/net/tcp could answer."""


def _raw(ip):
    """(family, 16 raw bytes) of an address; IPv4-mapped IPv6 is looked up as IPv4."""
    a = ipaddress.ip_address(str(ip).split("%")[0])
    if a.version == 6 and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    if a.version == 4:
        return socket.AF_INET, a.packed + b"\0" * 12
    return socket.AF_INET6, a.packed


def _mapped(raw4):
    """The IPv4-mapped IPv6 form of _raw's IPv4 bytes: an AF_INET6 socket's view of them."""
    return b"\0" * 10 + b"\xff\xff" + raw4[:4]


def _dump_request(family, states):
    body = (REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, states) + SOCKID.pack(0, 0, b"\0" * 16, b"\0" * 16)
            + REQ_TAIL.pack(0, NOCOOKIE, NOCOOKIE))
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + body


def _query(req):
    """[(state, sport, dport, src16, dst16, uid, inode)] of the kernel's dump."""
    out = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as s:
        s.settimeout(TIMEOUT)
        s.sendto(req, (0, 0))
        for _ in range(100000):                       # a dump ends with NLMSG_DONE
            data = s.recv(65536)
            pos = 0
            while pos + NLMSGHDR.size <= len(data):
                length, mtype, _flags, _seq, _pid = NLMSGHDR.unpack_from(data, pos)
                if length < NLMSGHDR.size or pos + length > len(data):
                    raise OSError(errno.EPROTO, "sock_diag: malformed netlink message")
                body = data[pos + NLMSGHDR.size:pos + length]
                pos += (length + 3) & ~3
                if mtype == NLMSG_DONE:
                    return out
                if mtype == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", body)[0] if len(body) >= 4 else errno.EIO
                    if code == 0:
                        return out
                    raise OSError(code, "sock_diag: %s" % os.strerror(code))
                if mtype != SOCK_DIAG_BY_FAMILY or len(body) < MSG_LEN:
                    continue
                _fam, state, _t, _r = MSG_HEAD.unpack_from(body)
                sport, dport, src, dst = SOCKID.unpack_from(body, MSG_HEAD.size)
                _e, _rq, _wq, uid, inode = MSG_TAIL.unpack_from(body, MSG_HEAD.size + SOCKID.size + REQ_TAIL.size)
                out.append((state, sport, dport, src, dst, uid, inode))
    raise OSError(errno.EPROTO, "sock_diag: no end of dump")


def _proc_rows(family):
    """(state, sport, dport, src16, dst16, uid, inode) rows of /proc/net/tcp or tcp6."""
    path = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
    rows = []
    with open(path) as f:
        next(f, None)
        for line in f:
            p = line.split()
            if len(p) < 10:
                continue
            (la, lp), (ra, rp) = p[1].split(":"), p[2].split(":")

            def addr(h):
                raw = bytes.fromhex(h)
                # /proc prints each 32-bit word in host (little endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                return raw + b"\0" * (16 - len(raw))
            rows.append((int(p[3], 16), int(lp, 16), int(rp, 16), addr(la), addr(ra), int(p[7]), int(p[9])))
    return rows


def _rows(family, states):
    try:
        return _query(_dump_request(family, states))
    except OSError as netlink_error:
        try:
            return [r for r in _proc_rows(family) if states & (1 << r[0])]
        except OSError as exc:
            raise Unavailable(exc.errno, "neither sock_diag (%s) nor /proc/net/tcp (%s)" % (netlink_error, exc))


def connection_owner(local, remote):
    """uid of the TCP socket whose local end is `local` and remote end `remote` ((ip, port)
    tuples), or None if there is no such connection.  One exact lookup (shim/rs_diag.c,
    which the C server side uses too); /proc/net/tcp where netlink cannot answer."""
    from ._native import lib
    fam, src = _raw(local[0])
    fam2, dst = _raw(remote[0])
    if fam != fam2:
        return None
    uid = lib.rs_diag_tcp_owner(fam, src, local[1], dst, remote[1])
    if uid >= 0:
        return uid
    if uid == -errno.ENOENT:
        return None
    try:
        rows = _proc_rows(fam)
    except OSError as exc:
        raise Unavailable(exc.errno, "neither sock_diag (%s) nor /proc/net/tcp (%s)" % (os.strerror(-uid), exc))
    for state, sport, dport, s, d, uid, _inode in rows:
        if sport == local[1] and dport == remote[1] and s == src and d == dst:
            return uid
    if fam == socket.AF_INET:                 # an AF_INET6 socket with IPv4-mapped addresses
        try:
            rows = _proc_rows(socket.AF_INET6)
        except OSError:                        # no IPv6 in this kernel
            rows = []
        for state, sport, dport, s, d, uid, _inode in rows:
            if sport == local[1] and dport == remote[1] and s == _mapped(src) and d == _mapped(dst):
                return uid
    return None


def listener_owners(ip, port):
    """uids of the TCP listeners that accept connections to (ip, port): bound to that
    address or to the wildcard of a family that reaches it."""
    fam, raw = _raw(ip)
    # a dual-stack :: listener, or one of family AF_INET6 bound to the IPv4-mapped address
    families = [fam] + ([socket.AF_INET6] if fam == socket.AF_INET else [])
    uids = set()
    for f in families:
        try:
            rows = _rows(f, 1 << TCP_LISTEN)
        except Unavailable:
            if f == fam:
                raise
            continue
        for state, sport, _dport, src, _dst, uid, _inode in rows:
            if sport != port:
                continue
            if src == (raw if f == fam else _mapped(raw)) or src == b"\0" * 16:
                uids.add(uid)
    return uids


UNIX_REQ = struct.Struct("=BBHIIIII")               # family, protocol, pad, states, ino, show, cookie[2]
UDIAG_SHOW_NAME = 0x01
UDIAG_SHOW_UID = 0x40


def abstract_listeners(names):
    """{name: uid} of those of the abstract UNIX names (bytes, without the leading NUL) that
    are listening sockets, from the kernel's unix_diag (UNIX_DIAG_UID: Linux 5.3).  The
    kernel cannot filter by name: the dump lists every listener, and is scanned in C
    (shim/rs_diag.c)."""
    from ._native import ffi, lib
    wanted = [b"\0" + n for n in names]
    joined = b"".join(wanted)
    lens = ffi.new("uint32_t[]", [len(w) for w in wanted])
    uids = ffi.new("int64_t[]", [-1] * len(wanted))
    body = UNIX_REQ.pack(socket.AF_UNIX, 0, 0, 1 << TCP_LISTEN, 0, UDIAG_SHOW_NAME | UDIAG_SHOW_UID,
                         NOCOOKIE, NOCOOKIE)
    req = NLMSGHDR.pack(NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + body
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as s:
            s.settimeout(TIMEOUT)
            s.sendto(req, (0, 0))
            for _ in range(1000000):
                data = s.recv(1 << 16)
                r = lib.rs_diag_unix_scan(data, len(data), joined, lens, len(wanted), uids)
                if r == -errno.EPROTO:
                    raise Unavailable(errno.EPROTO, "unix_diag: malformed netlink message")
                if r < 0:
                    raise Unavailable(-r, "unix_diag: %s" % os.strerror(-r))
                if r == 1:
                    break
            else:
                raise Unavailable(errno.EPROTO, "unix_diag: no end of dump")
    except Unavailable:
        raise
    except OSError as exc:
        raise Unavailable(exc.errno, "unix_diag: %s" % exc)
    if any(uids[i] == lib.RS_DIAG_NO_UID for i in range(len(wanted))):
        raise Unavailable(errno.EOPNOTSUPP, "unix_diag reports no socket owner (Linux < 5.3)")
    return {n: uids[i] for i, n in enumerate(names) if uids[i] >= 0}
