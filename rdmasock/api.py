"""`rdmasock.socket`: a drop-in for `socket.socket` whose TCP connections to other
rdmasock programs on this host travel through a shared-memory ring.

The kernel TCP socket stays open underneath: `fileno()` is that socket, it carries the
handshake and doorbell bytes, and select/selectors/asyncio wait on it.  Data moves through
the C ring code in rdmasock._native; this class only decides which path a call takes."""
import errno
import fcntl
import io
import math
import operator
import os
import select
import socket as _socket
import struct
import threading
import time

from . import config, handshake as hs, log, reasons, rendezvous, upgrade
from ._native import ffi, lib

_base = _socket.socket
# TCP options of an upgraded socket's TCP socket, which carries doorbells: value kept
_DOORBELL_TCP_OPTS = ((_socket.TCP_NODELAY, 1), (_socket.TCP_CORK, 0))
_links = {}            # socket inode -> _Link: the connection behind several objects
_links_lock = threading.Lock()
PRELOADED = False      # set by the preload engine: it upgrades every socket of the process

_NONBLOCK_FLAGS = int(_socket.MSG_DONTWAIT)     # a plain int: IntFlag arithmetic costs ~1 us
_RBUF_SIZE = 65536
_EINTR = -errno.EINTR
_CMSGHDR = struct.Struct("@Nii")        # struct cmsghdr: cmsg_len, cmsg_level, cmsg_type
_SO_TIMESTAMPING = 37                   # <asm-generic/socket.h>; the socket module has no name for it
_SOF_TX_STAMPS = 0x1 | 0x2 | 0x100 | 0x200   # SOF_TIMESTAMPING_TX_HARDWARE/_SOFTWARE/_SCHED/_ACK


def _tx_stamps_asked(level, name, value):
    """True if this option or control message asks for transmit timestamps, which the
    kernel makes only on its own path of the bytes (reason tx_timestamps)."""
    if level != _socket.SOL_SOCKET or name != _SO_TIMESTAMPING:
        return False
    if isinstance(value, int):
        return bool(value & _SOF_TX_STAMPS)
    try:
        raw = bytes(value)
    except TypeError:
        return False                    # the kernel's own call reports what is wrong with it
    return len(raw) >= 4 and bool(struct.unpack_from("@i", raw)[0] & _SOF_TX_STAMPS)


def _anc_tx_stamps_asked(ancdata):
    """_tx_stamps_asked for sendmsg's control messages; malformed ones are left to the
    kernel's call to reject, with its own error."""
    return any(isinstance(item, tuple) and len(item) == 3 and _tx_stamps_asked(*item) for item in ancdata)
_rs_send, _rs_recv = lib.rs_send, lib.rs_recv     # bound once: the per-call path stays short
_from_buffer, _unpack = ffi.from_buffer, ffi.unpack


def _is_stream_inet(family, type_):
    return family in (_socket.AF_INET, _socket.AF_INET6) and (type_ & 0xF) == _socket.SOCK_STREAM


class _Link:
    """An upgraded connection that more than one socket object refers to: objects made by
    dup(), socket.fromfd() or socket(fileno=...) for the same socket, and a detach()ed
    one.  Each object holds one reference; the connection is torn down (FIN record,
    rings freed) when the last goes, as TCP sends its FIN when the last descriptor
    closes."""
    __slots__ = ("inode", "conn", "rxpre", "transport", "reason", "role", "refs", "detached", "own_fd")

    def __init__(self, sock, inode):
        self.inode, self.own_fd = inode, None
        self.conn, self.rxpre = sock._conn, sock._rxpre
        self.transport, self.reason, self.role = sock._transport, sock._reason, sock._role
        self.refs, self.detached = 1, 0


def _inode(fd):
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


class socket(_base):
    """socket.socket with transparent same-host acceleration.  Extra attributes:
    `transport` ("shm" or "tcp") and `fallback_reason` (None or a reason code)."""

    def __new__(cls, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is not None and (family == -1 or type == -1):
            probe = _base(fileno=fileno)
            family = probe.family if family == -1 else family
            type = probe.type if type == -1 else type
            probe.detach()
        if family == -1:
            family = _socket.AF_INET
        if type == -1:
            type = _socket.SOCK_STREAM
        return super().__new__(cls, family, type, proto, fileno)

    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        super().__init__(family, type, proto, fileno)
        self._conn = None          # C connection when upgraded
        self._role = "-"           # "client" or "server" once the handshake settled (log lines)
        self._hs = None            # upgrade.Client / upgrade.Server while handshaking
        self._app_tcp = {}         # TCP_NODELAY/TCP_CORK as the application set them (upgraded sockets)
        self._rxpre = None         # server that declined: C reader of the client's preamble
        self._broken = None        # exception to raise (bad handshake)
        self._wrote_to_gone = False  # declined server: the one write TCP takes after the peer's close
        self._lmarker = None       # listener rendezvous registration
        self._rbuf = None
        self._pre_sent = 0         # client: payload sent in preamble frames (TCP_INFO's byte counts)
        self._hs_lock = threading.RLock()   # handshake progress vs. queued writes, across threads
        self._transport = "tcp"
        self._reason = None
        self._tmo = self._timeout_ms()
        self._inet = _is_stream_inet(self.family, self.type)   # other families stay plain
        self._link = self._own_fd = None
        if fileno is not None and self._inet and _links:
            self._join(_inode(fileno))

    def _join(self, inode):
        """A new object for a socket that an upgraded object already holds: share its
        connection."""
        with _links_lock:
            link = _links.get(inode)
            if link is None:
                return
            if link.detached:
                link.detached -= 1              # the detached object's reference, taken over
            else:
                link.refs += 1
            if link.own_fd is None:
                # The connection's own calls (doorbells, waits) leave the first object's
                # descriptor, which may close first: a private duplicate, kept to the end.
                link.own_fd = fcntl.fcntl(self.fileno(), fcntl.F_DUPFD_CLOEXEC, 1024)
                for c in (link.conn, link.rxpre):
                    if c is not None:
                        lib.rs_conn_move_fd(c, link.own_fd)
        self._link = link
        self._conn, self._rxpre = link.conn, link.rxpre
        self._transport, self._reason, self._role = link.transport, link.reason, link.role

    def _share(self):
        """This object's connection may now be held by others too (dup, detach)."""
        if self._link is None and (self._conn is not None or self._rxpre is not None):
            inode = _inode(self.fileno())
            with _links_lock:
                self._link = _links[inode] = _Link(self, inode)
        return self._link

    def _leave(self):
        """Drops this object's reference; True if it was the last (tear the connection
        down), False if other objects still hold it."""
        link, self._link = self._link, None
        if link is None:
            return True
        with _links_lock:
            link.refs -= 1
            if link.refs > 0 or link.detached:
                return False
            if _links.get(link.inode) is link:
                del _links[link.inode]
        self._conn, self._rxpre = link.conn, link.rxpre   # what the last holder frees
        self._own_fd = link.own_fd
        return True

    # ---- visible state ---------------------------------------------------------------

    @property
    def transport(self):
        """"shm" or "tcp" ("rdma" with the RDMA transport).  While the peer's answer is
        outstanding this makes non-blocking progress and reports "tcp"."""
        if self._hs is not None:
            try:
                self._drive(None)
            except OSError:
                pass
        c = self._conn
        if c is not None and c.fb and self._transport != "tcp":
            # the ring went on over TCP mid-stream (shim/rs_fallback.c)
            self._reason, why = reasons.moved_to_tcp(c)
            self._transport = "tcp"
            self._log(self._role, detail=why)
        return self._transport

    @transport.setter
    def transport(self, value):
        self._transport = value

    @property
    def fallback_reason(self):
        """None, or the reason code (rdmasock.reasons) why this connection is plain TCP."""
        self.transport
        return self._reason

    @fallback_reason.setter
    def fallback_reason(self, value):
        self._reason = value

    # ---- helpers -------------------------------------------------------------------

    def settimeout(self, value):
        _base.settimeout(self, value)
        self._tmo = self._timeout_ms()

    def setblocking(self, flag):
        _base.setblocking(self, flag)
        self._tmo = self._timeout_ms()

    def _timeout_ms(self):
        t = self.gettimeout()
        if t is None:
            return -1
        return 0 if t == 0 else max(1, math.ceil(t * 1000))

    def _deadline(self):
        t = self.gettimeout()
        if t is None:
            return float("inf")
        return None if t == 0 else time.monotonic() + t

    def _fail(self, r, c=None):
        """Raises the exception for a negative errno from the C data path."""
        e = -r
        if e == errno.EAGAIN:
            if self.gettimeout():
                raise TimeoutError("timed out")
            raise BlockingIOError(e, os.strerror(e))
        c = c if c is not None else self._conn
        msg = os.strerror(e)
        if c is not None and c.err == e and lib.rs_conn_errmsg(c)[0] != b"\0":
            msg = ffi.string(lib.rs_conn_errmsg(c)).decode(errors="replace")    # says which failure
        raise OSError(e, msg) if e not in _ERRCLS else _ERRCLS[e](e, msg)

    def _log(self, role, detail=None):
        try:
            local, peer = self._addrs = self.getsockname(), self.getpeername()
        except OSError:
            # a later line (the ring moved to TCP) may come after both ends closed
            local, peer = getattr(self, "_addrs", (None, None))
        reason = self._reason if detail is None else "%s (%s)" % (self._reason, detail)
        log.connection(role, local, peer, self._transport, reason)

    def _settle(self, outcome, role):
        """The handshake ended: switch to the ring or stay on TCP, then flush."""
        h, self._hs = self._hs, None
        h.close()
        self.transport = outcome.transport
        self.fallback_reason = outcome.reason
        self._role = role
        self._log(role)

    def _drive(self, deadline):
        """Advances a pending handshake.  Returns True when it is over."""
        with self._hs_lock:
            return self._drive_locked(deadline)

    def _drive_locked(self, deadline):
        h = self._hs
        if h is None:
            return True
        try:
            outcome = h.step(deadline)
        except hs.HandshakeError as exc:
            self._hs = None
            h.close()
            self.fallback_reason = exc.reason
            self._broken = exc
            self._log("client" if isinstance(h, upgrade.Client) else "server")
            raise
        if outcome is None:
            return False
        client = isinstance(h, upgrade.Client)
        if outcome.conn is not None:
            # The TCP socket now carries only doorbell bytes: Nagle would hold a bell
            # behind an unacknowledged one for a delayed-ACK time, a cork for up to 200 ms.
            # The application's own settings are kept virtually (getsockopt/setsockopt).
            for opt, want in _DOORBELL_TCP_OPTS:
                self._app_tcp[opt] = _base.getsockopt(self, _socket.IPPROTO_TCP, opt)
                if self._app_tcp[opt] != want:
                    _base.setsockopt(self, _socket.IPPROTO_TCP, opt, want)
        self._rxpre = upgrade.after_answer(h, outcome, self.fileno())
        # Publish the connection before clearing _hs: a thread that sees _hs gone is then
        # sure to see the ring (see _plain), never the bare TCP socket.
        self._conn = outcome.conn
        self._settle(outcome, "client" if client else "server")
        self._share()                 # socket.fromfd() and dup() of it find the connection
        return True

    def _ready_for_io(self, for_write):
        """Makes sure the handshake is over before data moves.  Returns False for a
        client's write while the server has not answered: the caller sends a preamble
        frame.  A server never writes before it has answered (it waits for the HELLO,
        which the client sends as soon as its connect completes)."""
        if self._broken is not None:
            raise self._broken
        h = self._hs
        if h is None:
            return True
        if self._drive(None):
            return True
        if for_write and isinstance(h, upgrade.Client):
            if not h.hello_sent:
                if not h.connected(None):
                    raise BlockingIOError(errno.EAGAIN, "rdmasock: connect in progress")
                h.start()
            return False
        if for_write:
            if self._drive(time.monotonic() + config.get().handshake_timeout):
                return True
            exc = hs.HandshakeError("handshake_timeout", "rdmasock: handshake: the client announced "
                                    "rdmasock but sent no HELLO in time")
            self._hs = None
            h.close()
            self.fallback_reason, self._broken = exc.reason, exc
            self._log("server")
            raise exc
        if self._deadline() is None:
            raise BlockingIOError(errno.EAGAIN, "rdmasock: handshake in progress")
        if not self._drive(self._deadline()):
            raise TimeoutError("timed out")
        return True

    def _send_preamble(self, data, flags):
        """A client's write before the server's answer: one preamble frame on the TCP
        stream.  None if the handshake finished meanwhile (send normally)."""
        p = _from_buffer(data)
        nonblock = bool(flags & _NONBLOCK_FLAGS) or self._tmo == 0
        deadline = self._deadline()
        while True:
            # One frame at a time under the lock (SWITCH never lands inside a frame); the
            # wait for room happens outside it, so a reader thread can take the answer.
            with self._hs_lock:
                if self._ready_for_io(True):
                    return None
                r = lib.rs_pre_send(self.fileno(), p, len(p), 1, 0)
            if r >= 0:
                self._pre_sent += r
                return r
            if r not in (-errno.EAGAIN, _EINTR):
                self._fail(r)
            if nonblock:
                self._fail(r)
            if deadline is not None and deadline != float("inf") and time.monotonic() >= deadline:
                raise TimeoutError("timed out")
            upgrade._wait(self.fileno(), select.POLLOUT | select.POLLIN,
                          min(deadline, time.monotonic() + 0.05) if deadline else time.monotonic() + 0.05)

    def _plain(self):
        """True if this socket is (now) plain TCP.  _hs is read first: the handshake
        publishes _conn/_rxpre before it clears _hs, so no thread mistakes a socket that
        was just upgraded for a plain one."""
        return self._hs is None and self._broken is None and self._conn is None and self._rxpre is None

    def _plain_tx(self):
        """True if writes go to the TCP socket as they are (plain, or a server that
        declined: only the client's direction carries preamble frames)."""
        return self._hs is None and self._broken is None and self._conn is None

    def _slow_rx(self):
        """The C connection a read uses outside the fast path, or None for plain TCP."""
        if self._plain():
            return None
        if self._rxpre is not None:
            return self._rxpre
        if self._hs is not None or self._broken is not None:
            self._ready_for_io(False)
        return self._conn if self._conn is not None else self._rxpre

    def _preamble_done(self):
        """The declined server has unwrapped the client's preamble: plain TCP from now on
        (a reader shared with other objects is freed by the last of them)."""
        c = self._rxpre
        if c is not None and not c.rx.pre.active:
            self._rxpre = None
            if self._link is None:
                lib.rs_conn_free(c)

    # ---- connection set-up ---------------------------------------------------------

    def _client_plan(self, address):
        """Decides whether to offer an upgrade.  Returns (sockaddr, upgrade.Client|None)."""
        host, port = address[0], address[1]
        infos = _socket.getaddrinfo(host, port, self.family, _socket.SOCK_STREAM)
        sockaddr = infos[0][4] if infos else address
        if self._conn is not None or self._hs is not None or PRELOADED:
            return sockaddr, None
        reason, marker, reserved = upgrade.plan_client(self, self.family, sockaddr)
        if reason:
            self.fallback_reason = reason
            return sockaddr, None
        return sockaddr, upgrade.Client(self, marker, reserved)

    def connect(self, address):
        if not self._inet:
            return _base.connect(self, address)
        sockaddr, client = self._client_plan(address)
        if client is None:
            _base.connect(self, sockaddr)
            if self._hs is None and self._conn is None:
                self._log("client")
            return
        self._hs = client
        try:
            _base.connect(self, sockaddr)
        except (BlockingIOError, InterruptedError):
            # Loopback connects finish at once unless the backlog is full: wait a moment so
            # the HELLO leaves now, not at the application's next call.
            if not client.connected(time.monotonic() + 0.05):
                raise
        except BaseException:
            self._hs = None
            client.close()
            raise
        client.start()
        self._drive(None)

    def connect_ex(self, address):
        try:
            self.connect(address)
        except OSError as exc:
            return exc.errno or errno.EIO
        return 0

    def listen(self, backlog=None):
        if backlog is None:
            _base.listen(self)
        else:
            _base.listen(self, backlog)
        if not self._inet:
            return
        cfg = config.get()
        if self._lmarker is None and not cfg.disabled and not PRELOADED \
                and ("shm" in cfg.transports or "rdma" in cfg.transports) \
                and not cfg.excluded(*self.getsockname()[:2]):
            self._lmarker = rendezvous.register_listener(self)

    def accept(self):
        if not self._inet:
            return _base.accept(self)
        fd, addr = self._accept()
        sock = socket(self.family, self.type, self.proto, fileno=fd)
        if _socket.getdefaulttimeout() is None and self.gettimeout():
            sock.setblocking(True)
        cfg = config.get()
        why, decline_shm = (None, None) if PRELOADED else upgrade.server_plan(sock, self.getsockname(), addr)
        if PRELOADED:
            pass                                  # the preloaded engine handles this socket
        elif why is not None:
            sock.fallback_reason = why
            sock._log("server")
        else:
            sock._hs = upgrade.Server(sock, decline_shm)
            # A blocking listener may wait briefly for the HELLO (the client sends it right
            # after connect); a nonblocking one (event loops) never waits here.
            wait = None if self.gettimeout() == 0 else time.monotonic() + cfg.handshake_timeout
            try:
                sock._drive(wait)
            except hs.HandshakeError:
                pass                              # raised again at the first I/O
        return sock, addr

    # ---- data ----------------------------------------------------------------------

    def recv(self, bufsize, flags=0):
        c = self._conn
        if c is None:
            c = self._slow_rx()
            if c is None:
                return _base.recv(self, bufsize, flags)
        if flags & _socket.MSG_OOB:
            return _base.recv(self, bufsize, flags)     # urgent data only ever comes over TCP (send)
        if bufsize <= _RBUF_SIZE:
            buf = self._rbuf
            if buf is None:
                buf = self._rbuf = ffi.new("char[]", _RBUF_SIZE)
        elif bufsize < 0:
            raise ValueError("negative buffersize in recv")
        else:
            buf = ffi.new("char[]", bufsize)
        while True:
            r = _rs_recv(c, buf, bufsize, flags, 0 if flags & _NONBLOCK_FLAGS else self._tmo)
            if r >= 0:
                if self._rxpre is not None:
                    self._preamble_done()
                return _unpack(buf, r)
            if r != _EINTR:
                self._fail(r, c)

    def recv_into(self, buffer, nbytes=0, flags=0):
        c = self._conn
        if c is None:
            c = self._slow_rx()
            if c is None:
                return _base.recv_into(self, buffer, nbytes, flags)
        if flags & _socket.MSG_OOB:
            return _base.recv_into(self, buffer, nbytes, flags)
        p = _from_buffer(buffer, require_writable=True)
        size = len(p)
        if nbytes < 0:
            raise ValueError("negative buffersize in recv_into")
        if nbytes > size:
            raise ValueError("buffer too small for requested bytes")
        if nbytes:
            size = nbytes
        while True:
            r = _rs_recv(c, p, size, flags, 0 if flags & _NONBLOCK_FLAGS else self._tmo)
            if r >= 0:
                if self._rxpre is not None:
                    self._preamble_done()
                return r
            if r != _EINTR:
                self._fail(r, c)

    def recvfrom(self, bufsize, flags=0):
        if self._plain():
            return _base.recvfrom(self, bufsize, flags)
        return self.recv(bufsize, flags), None

    def recvfrom_into(self, buffer, nbytes=0, flags=0):
        if self._plain():
            return _base.recvfrom_into(self, buffer, nbytes, flags)
        if nbytes > len(memoryview(buffer).cast("B")):
            raise ValueError("nbytes is greater than the length of the buffer")
        return self.recv_into(buffer, nbytes, flags), None

    def recvmsg(self, bufsize, ancbufsize=0, flags=0):
        if self._plain() or operator.index(flags) & _socket.MSG_ERRQUEUE:
            return _base.recvmsg(self, bufsize, ancbufsize, flags)   # the error queue is the kernel's
        if operator.index(bufsize) < 0 or operator.index(ancbufsize) < 0:
            raise ValueError("negative buffer size in recvmsg()")
        data = self.recv(bufsize, flags)
        return (data, *self._rx_ancillary(ancbufsize if data else 0), None)

    def _rx_ancillary(self, ancbufsize):
        """(ancdata, msg_flags) a TCP socket gives with received bytes: timestamps and
        TCP_INQ, as the program asked for them (shim/rs_report.c)."""
        c = self._conn
        if not ancbufsize or c is None:
            return [], 0
        buf, trunc = ffi.new("char[]", ancbufsize), ffi.new("int *")
        used = lib.rs_conn_rx_ancillary(c, self.fileno(), buf, ancbufsize, trunc)
        raw, items, off = ffi.buffer(buf, used)[:], [], 0
        hdr = _socket.CMSG_LEN(0)
        while off + hdr <= used:
            length, level, kind = _CMSGHDR.unpack_from(raw, off)
            items.append((level, kind, raw[off + hdr:off + length]))
            off += _socket.CMSG_SPACE(length - hdr)
        return items, _socket.MSG_CTRUNC if trunc[0] else 0

    def recvmsg_into(self, buffers, ancbufsize=0, flags=0):
        if self._plain() or operator.index(flags) & _socket.MSG_ERRQUEUE:
            return _base.recvmsg_into(self, buffers, ancbufsize, flags)
        buffers = list(buffers)
        if any(memoryview(b).readonly for b in buffers):
            raise TypeError("recvmsg_into() argument 1 must be an iterable of single-segment read-write buffers")
        if operator.index(ancbufsize) < 0:
            raise ValueError("negative buffer size in recvmsg_into()")
        operator.index(flags)
        total = 0
        for b in buffers:
            n = len(memoryview(b).cast("B"))
            got = self.recv_into(b, n, flags if not total else flags | _socket.MSG_DONTWAIT) if n else 0
            total += got
            if got < n:
                break
        return (total, *self._rx_ancillary(ancbufsize if total else 0), None)

    def send(self, data, flags=0):
        c = self._conn
        if c is None:
            if self._plain_tx():
                if self._rxpre is not None:
                    return self._declined_send(_base.send, data, flags)
                return _base.send(self, data, flags)       # plain, or a declined server
            n = self._send_preamble(data, flags)
            if n is not None:
                return n
            return self.send(data, flags)
        if flags & _socket.MSG_OOB:
            return self._send_urgent(c, data, flags)
        p = _from_buffer(data)
        while True:
            r = _rs_send(c, p, len(p), 1 if flags & _NONBLOCK_FLAGS else 0, self._tmo)
            if r >= 0:
                return r
            if r != _EINTR:
                self._fail(r)

    def _declined_send(self, send, data, flags):
        """A declined server before the client's SWITCH.  A client that closed during its
        handshake answered our DECLINE with a reset, which TCP would not have had: as over
        TCP after a peer's close, the first write succeeds and later ones fail."""
        try:
            return send(self, data, flags)
        except (BrokenPipeError, ConnectionResetError):
            if self._wrote_to_gone or not self._rxpre.rx.pre.active:
                raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)) from None
            self._wrote_to_gone = True
            return None if send is _base.sendall else len(memoryview(data).cast("B"))

    def _send_urgent(self, c, data, flags):
        """Urgent data exists only in TCP: the connection moves there first, behind every
        byte sent before (reason urgent_data), then the kernel sends and marks it."""
        self._move_tx(c, "urgent_data", flags)
        return _base.send(self, data, flags)

    def _move_tx(self, c, reason, flags=0):
        """Our direction moves to TCP behind every byte sent before: what follows is the
        kernel's to send (docs/PROTOCOL.md 6.8)."""
        while True:
            r = lib.rs_fb_move_tx(c, reasons.CODE_BY_NAME[reason], 0 if flags & _NONBLOCK_FLAGS else self._tmo)
            if r == 0:
                self.transport                          # logs the move
                return
            if r != _EINTR:
                self._fail(r)

    def sendall(self, data, flags=0):
        c = self._conn
        if c is not None and self._tmo < 0 and not flags & _NONBLOCK_FLAGS:
            p = _from_buffer(data)          # blocking without timeout: one call sends it all
            n = len(p)
            while True:
                r = _rs_send(c, p, n, 0, -1)
                if r == n:
                    return None
                if r >= 0:
                    p, n = p + r, n - r
                elif r != _EINTR:
                    self._fail(r)
        if c is None and self._plain_tx():
            if self._rxpre is not None:
                return self._declined_send(_base.sendall, data, flags)
            return _base.sendall(self, data, flags)
        view = memoryview(data).cast("B")
        deadline = self._deadline()
        while view:
            if deadline not in (None, float("inf")) and time.monotonic() >= deadline:
                raise TimeoutError("timed out")
            n = self.send(view, flags)
            view = view[n:]

    def sendmsg(self, buffers, ancdata=(), flags=0, address=None):
        if self._plain():
            return _base.sendmsg(self, buffers, ancdata, flags, *([address] if address else []))
        buffers, ancdata = list(buffers), list(ancdata)
        c = self._conn
        if c is not None and _anc_tx_stamps_asked(ancdata):
            self._move_tx(c, "tx_timestamps", flags)
            return _base.sendmsg(self, buffers, ancdata, flags, *([address] if address is not None else []))
        if ancdata or address is not None:
            # The kernel checks the arguments and the ancillary data (a TCP socket accepts
            # and ignores what it has no use for), with no byte of the stream; the ring
            # carries the bytes.
            _base.sendmsg(self, [], ancdata, flags | _NONBLOCK_FLAGS, *([address] if address is not None else []))
        return self.send(b"".join(bytes(memoryview(b).cast("B")) for b in buffers), flags)

    def sendto(self, data, *flags_addr):
        if self._plain():
            return _base.sendto(self, data, *flags_addr)
        if len(flags_addr) not in (1, 2):
            raise TypeError("sendto() takes 2 or 3 arguments (%d given)" % (len(flags_addr) + 1))
        # TCP ignores the address of a connected socket
        return self.send(data, flags_addr[0] if len(flags_addr) == 2 else 0)

    def sendfile(self, file, offset=0, count=None):
        if self._plain_tx():
            return _base.sendfile(self, file, offset, count)
        return self._sendfile_use_send(file, offset, count)

    def _sendfile_use_sendfile(self, file, offset=0, count=None):
        if self._plain_tx():
            return _base._sendfile_use_sendfile(self, file, offset, count)
        # os.sendfile would write around the ring: the bytes go through send(), after the
        # checks (and the give-ups, for files that are not regular) of the original
        self._check_sendfile_params(file, offset, count)
        try:
            if not os.fstat(file.fileno()).st_size:
                return 0
        except (AttributeError, io.UnsupportedOperation, OSError) as err:
            raise _socket._GiveupOnSendfile(err)
        return self._sendfile_use_send(file, offset, count)

    # ---- teardown ------------------------------------------------------------------

    def shutdown(self, how):
        how = operator.index(how)
        if not -0x80000000 <= how <= 0x7FFFFFFF:
            raise OverflowError("signed integer is greater than maximum" if how > 0 else
                                "signed integer is less than minimum")
        if how not in (_socket.SHUT_RD, _socket.SHUT_WR, _socket.SHUT_RDWR):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        if self._hs is not None:
            self._finish_handshake_for_close()
        c = self._conn
        if c is None:
            return _base.shutdown(self, how)
        if how in (_socket.SHUT_RD, _socket.SHUT_RDWR):
            lib.rs_shutdown_rd(c)
        if how in (_socket.SHUT_WR, _socket.SHUT_RDWR):
            lib.rs_send_fin(c)

    def _finish_handshake_for_close(self):
        """shutdown()/detach() while the peer has not answered: the half-close must travel
        the way the data will, so wait (bounded) for the answer.  Without one the socket
        stays plain TCP with reason handshake_timeout."""
        try:
            self._drive(time.monotonic() + config.get().handshake_timeout)
        except (OSError, hs.HandshakeError):
            pass
        h = self._hs
        if h is None:
            return
        self._hs = None
        h.close()
        self.fallback_reason = "handshake_timeout"

    def _real_close(self):
        if not self._leave():
            self._conn = self._rxpre = None     # others hold the connection: only our fd goes
            return super()._real_close()
        # Unread handshake bytes (the client's SWITCH) or doorbells would make the kernel's
        # close a reset, which TCP would not have sent.
        pre, self._rxpre = self._rxpre, None
        if pre is not None:
            lib.rs_quiesce_bells(pre)
            lib.rs_conn_free(pre)
        c, self._conn = self._conn, None
        if c is not None:
            lib.rs_quiesce_bells(c)
            lib.rs_send_fin(c)
            upgrade.release(c)
        own, self._own_fd = self._own_fd, None
        if own is not None:
            os.close(own)
        h, self._hs = self._hs, None
        if h is not None:
            if isinstance(h, upgrade.Client):
                # The server's answer may arrive after the close and provoke a reset, which
                # would overtake the end of what we sent: our FIN goes first, as TCP's
                # close sends it.
                try:
                    _base.shutdown(self, _socket.SHUT_WR)
                except OSError:
                    pass
            h.close()
        if self._lmarker is not None:
            rendezvous.close_marker(self._lmarker)
            self._lmarker = None
        super()._real_close()

    def detach(self):
        """The descriptor leaves this object, the connection stays with it: an object made
        later for that descriptor (socket(fileno=fd)) takes it over."""
        if self._hs is not None:
            self._finish_handshake_for_close()
        link = self._share()
        if link is not None:
            with _links_lock:
                link.refs -= 1
                link.detached += 1
        self._link = self._conn = self._rxpre = None
        if self._lmarker is not None:
            rendezvous.close_marker(self._lmarker)
            self._lmarker = None
        return super().detach()

    def dup(self):
        """A second object for the same connection (the handshake settles first, bounded,
        so that both objects read the same stream)."""
        if self._hs is not None:
            self._finish_handshake_for_close()
        self._share()
        return super().dup()

    # ---- readiness helpers (used by tests and tools) ---------------------------------

    def pending_bytes(self):
        """Bytes receivable without waiting (like ioctl FIONREAD)."""
        if self._conn is None:
            import fcntl
            import termios
            return struct.unpack("i", fcntl.ioctl(self.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        return lib.rs_rx_available(self._conn)

    def setsockopt(self, level, optname, value, optlen=None):
        if self._conn is not None and level == _socket.IPPROTO_TCP and optname in self._app_tcp:
            self._app_tcp[optname] = 1 if value else 0     # the doorbell socket keeps Nagle and the cork off
            return None
        if self._conn is not None and optlen is None and _tx_stamps_asked(level, optname, value):
            self._move_tx(self._conn, "tx_timestamps")     # the kernel stamps only its own path
        if optlen is None:
            _base.setsockopt(self, level, optname, value)
        else:
            _base.setsockopt(self, level, optname, value, optlen)
        if self._conn is not None:
            lib.rs_conn_sockopt_set(self._conn)            # receive options: asked again at the next recvmsg

    def getsockopt(self, *args):
        c = self._conn
        if c is not None and args[0] == _socket.IPPROTO_TCP and args[1] in self._app_tcp and len(args) == 2:
            return self._app_tcp[args[1]]
        if c is not None and args[:2] == (_socket.IPPROTO_TCP, _socket.TCP_INFO) and len(args) == 3:
            info = bytearray(_base.getsockopt(self, *args))     # counts the stream, not the socket
            lib.rs_conn_tcp_info(c, c.rx.bytes + c.rx.pre.bytes, c.tx.bytes + self._pre_sent,
                                 ffi.from_buffer(info), len(info))
            return bytes(info)
        h = self._hs
        if h is not None and isinstance(h, upgrade.Client) and not h.hello_sent and args[:2] == (_socket.SOL_SOCKET, _socket.SO_ERROR):
            # asyncio finishes a nonblocking connect by reading SO_ERROR: send the HELLO now.
            err = _base.getsockopt(self, *args)
            if err == 0 and h.connected(None):
                h.start()
            return err
        return _base.getsockopt(self, *args)

    def __repr__(self):
        return _base.__repr__(self)[:-1] + ", transport=%s>" % self._transport

    def stats(self):
        c = self._conn
        if c is None:
            return {"transport": self.transport, "fallback_reason": self.fallback_reason}
        return {"transport": self.transport, "bytes_sent": c.tx.bytes, "bytes_received": c.rx.bytes,
                "records_sent": c.tx.records, "records_received": c.rx.records, "bytes_spilled": c.tx.spilled,
                "doorbells_sent": c.bells_sent, "sleeps": c.rx.sleeps}


_ERRCLS = {
    errno.ECONNRESET: ConnectionResetError,
    errno.EPIPE: BrokenPipeError,
    errno.ECONNABORTED: ConnectionAbortedError,
    errno.ECONNREFUSED: ConnectionRefusedError,
}


def fromfd(fd, family, type, proto=0):
    """Like socket.fromfd: an rdmasock socket for a duplicate of fd (which shares the
    connection of an upgraded socket that fd belongs to)."""
    return socket(family, type, proto, os.dup(fd))


def create_connection(address, timeout=_socket._GLOBAL_DEFAULT_TIMEOUT, source_address=None, *, all_errors=False):
    """Like socket.create_connection, returning an rdmasock socket."""
    host, port = address
    exceptions = []
    for family, type_, proto, _, sa in _socket.getaddrinfo(host, port, 0, _socket.SOCK_STREAM):
        sock = None
        try:
            sock = socket(family, type_, proto)
            if timeout is not _socket._GLOBAL_DEFAULT_TIMEOUT:
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sa)
            exceptions.clear()
            return sock
        except OSError as exc:
            exceptions.append(exc)
            if sock is not None:
                sock.close()
    if exceptions:
        if all_errors:
            raise ExceptionGroup("create_connection failed", exceptions)
        raise exceptions[0]
    raise OSError("getaddrinfo returns an empty list")


def create_server(address, *, family=_socket.AF_INET, backlog=None, reuse_port=False, dualstack_ipv6=False):
    """Like socket.create_server, returning an rdmasock listening socket."""
    if reuse_port and not hasattr(_socket, "SO_REUSEPORT"):
        raise ValueError("SO_REUSEPORT not supported on this platform")
    if dualstack_ipv6:
        if not _socket.has_dualstack_ipv6():
            raise ValueError("dualstack_ipv6 not supported on this platform")
        if family != _socket.AF_INET6:
            raise ValueError("dualstack_ipv6 requires AF_INET6 family")
    sock = socket(family, _socket.SOCK_STREAM)
    try:
        if os.name not in ("nt", "cygwin") and hasattr(_socket, "SO_REUSEADDR"):
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEPORT, 1)
        if family == _socket.AF_INET6 and hasattr(_socket, "IPPROTO_IPV6"):
            sock.setsockopt(_socket.IPPROTO_IPV6, _socket.IPV6_V6ONLY, 0 if dualstack_ipv6 else 1)
        sock.bind(address)
        sock.listen(backlog) if backlog is not None else sock.listen()
        return sock
    except BaseException:
        sock.close()
        raise
