"""`rdmasock.socket`: a drop-in for `socket.socket` whose TCP connections to other
rdmasock programs travel through a ring (shared memory on this host, RDMA to others).

The kernel TCP socket stays open underneath: `fileno()` is that socket, it carries the
handshake and doorbell bytes, and select/selectors/asyncio wait on it.  Each upgraded
socket is the same C object the preload library uses (shim/rs_sock.c): its state machine,
handshake steps (rdmasock/engine.py) and data path.  This class maps Python's calls onto
it (shim/api/rs_api.c) and keeps only what is Python's own: timeouts and exceptions."""
import errno
import io
import math
import operator
import os
import socket as _socket
import struct
import threading
import time
import weakref

from . import config, engine, reasons
from .handshake import HandshakeError
from ._native import ffi, lib

_base = _socket.socket

_NONBLOCK_FLAGS = int(_socket.MSG_DONTWAIT)     # a plain int: IntFlag arithmetic costs ~1 us
_RBUF_SIZE = 65536
_EINTR = -errno.EINTR
_PLAIN = lib.RS_API_PLAIN
_CMSGHDR = struct.Struct("@Nii")        # struct cmsghdr: cmsg_len, cmsg_level, cmsg_type
_VIRTUAL_TCP_OPTS = (_socket.TCP_NODELAY, _socket.TCP_CORK)   # kept off on a doorbell socket
_rs_send, _rs_recv = lib.rs_api_send, lib.rs_api_recv      # bound once: the per-call path stays short
_from_buffer, _unpack = ffi.from_buffer, ffi.unpack

# The C objects that Python objects share: several objects for one socket (dup(),
# socket.fromfd(), socket(fileno=...)) hold one rs_sock, as several descriptors do.
_shared = {}            # socket inode -> [rs_sock, gen, holders]
_detached = {}          # descriptor -> (rs_sock, gen, inode): a detach()ed object's hold, for the next object
_shared_lock = threading.Lock()


# ---- the control plane's entry points for the C object (shim/api/rs_api.h) -------------

def _quiet(exc, val, tb):
    try:
        engine.internal_error(exc, val, tb)  # to the log file, never to the program's stderr
    except BaseException:
        pass                                 # (cffi would print an error of this one there)


@ffi.def_extern(error=-errno.EIO, onerror=_quiet)
def rs_api_py_step(handle, wait_ms, out):
    return engine.step(handle, wait_ms, out)


@ffi.def_extern(onerror=_quiet)
def rs_api_py_drop(handle):
    engine.drop(handle)


@ffi.def_extern(onerror=_quiet)
def rs_api_py_unlisten(handle):
    engine.unlisten(handle)


@ffi.def_extern(onerror=_quiet)
def rs_api_py_release(conn):
    engine.release(int(ffi.cast("uintptr_t", conn)))


@ffi.def_extern(onerror=_quiet)
def rs_api_py_fell_back(fd, role, conn):
    engine.fell_back(fd, role, int(ffi.cast("uintptr_t", conn)))


lib.rs_api_install()


def _is_stream_inet(family, type_):
    return family in (_socket.AF_INET, _socket.AF_INET6) and (type_ & 0xF) == _socket.SOCK_STREAM


def _inode(fd):
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _abandoned(s, gen, inode, fd):
    """A socket object collected without close(): its descriptor is closed already."""
    if lib.rs_sock_get_gen(s, gen):
        lib.rs_sock_put(s)
        _forget(s, inode, fd, lib.rs_sock_abandon_fd)


def _forget(s, inode, fd, release):
    """One holder of s is gone; release(s, fd) drops its hold in C."""
    with _shared_lock:
        entry = _shared.get(inode)
        if entry is not None and entry[0] == s:
            entry[2] -= 1
            if entry[2] <= 0:
                del _shared[inode]
    release(s, fd)


def _tx_stamps_asked(level, name, value):
    """True if this option or control message asks for transmit timestamps, which the
    kernel makes only on its own path of the bytes (reason tx_timestamps; the test is
    shim/rs_sock.c's)."""
    try:
        raw = struct.pack("@i", value) if isinstance(value, int) else bytes(value)
    except (TypeError, struct.error):
        return False                    # the kernel's own call reports what is wrong with it
    return lib.rs_tx_stamps_asked(level, name, raw, len(raw)) != 0


class socket(_base):
    """socket.socket with transparent acceleration.  Extra attributes: `transport`
    ("shm", "rdma" or "tcp") and `fallback_reason` (None or a reason code)."""

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
        self._s = None             # the C object (struct rs_sock *) once this socket has one
        self._gen = 0              # ...and which life of that pooled object it is
        self._ino = None           # ...and the socket's inode (the key other objects find it by)
        self._fin = None           # weakref.finalize: the object is collected without close()
        self._reason = None        # plain TCP for a reason decided before any C object
        self._transport = "tcp"    # what transport said last (kept after close)
        self._wrote_to_gone = False  # declined server: the one write TCP takes after the peer's close
        self._rbuf = None
        self._tmo = self._timeout_ms()
        self._inet = _is_stream_inet(self.family, self.type)   # other families stay plain
        if fileno is not None and self._inet and (_shared or _detached):
            self._join(fileno)

    # ---- the C object ----------------------------------------------------------------

    def _adopt(self, s, gen, counted=False):
        """This object holds s (one hold, for its descriptor).  counted: the holder count
        includes it already (a detached object's hold)."""
        fd = self.fileno()
        self._s, self._gen, self._ino = s, gen, _inode(fd)
        self._fin = weakref.finalize(self, _abandoned, s, gen, self._ino, fd)
        self._fin.atexit = False
        with _shared_lock:
            entry = _shared.get(self._ino)
            if entry is None or entry[0] != s:
                _shared[self._ino] = [s, gen, 1]
            elif not counted:
                entry[2] += 1

    def _track(self, state, handle, role):
        s = lib.rs_api_new(self.fileno(), state, handle, role)
        if s == ffi.NULL:
            engine.drop(handle)
            return None
        self._adopt(s, s.gen)
        return s

    def _join(self, fd):
        """A new object for a socket that another object already holds: share its C object."""
        inode = _inode(fd)
        with _shared_lock:
            held = _detached.pop(fd, None)
            if held is not None and held[2] != inode:
                held = None                         # that descriptor was closed; the number is another socket's
            entry = _shared.get(inode) if held is None else None
        if held is not None:
            s, gen, _ = held                        # the detached object's hold, taken over
            if lib.rs_sock_get_gen(s, gen):
                lib.rs_sock_put(s)
                self._adopt(s, gen, counted=True)
            return
        if entry is not None and lib.rs_api_hold(entry[0], entry[1], fd):
            self._adopt(entry[0], entry[1])

    def _enter(self):
        """A call reference on this object's C object, or None (plain TCP)."""
        s = self._s
        if s is not None and lib.rs_sock_get_gen(s, self._gen):
            return s
        return None

    def _state(self):
        s = self._s
        return lib.RS_PLAIN if s is None else s.state

    @property
    def _conn(self):
        """The ring connection, while upgraded."""
        s = self._s
        return s.conn if s is not None and s.state == lib.RS_RING else None

    # ---- visible state ---------------------------------------------------------------

    @property
    def transport(self):
        """"shm", "rdma" or "tcp".  While the peer's answer is outstanding this makes
        non-blocking progress and reports "tcp"."""
        s = self._s
        if s is None:
            return self._transport
        st = lib.rs_api_step(s, self._gen, 0)
        t = "tcp" if st != lib.RS_RING or s.stat == ffi.NULL else reasons.TRANSPORTS.get(s.stat.transport, "tcp")
        self._transport = t
        return t

    @property
    def fallback_reason(self):
        """None, or the reason code (rdmasock.reasons) why this connection is plain TCP."""
        s = self._s
        if s is None:
            return self._reason
        self.transport
        code = s.stat.reason if s.stat != ffi.NULL else s.reason
        return reasons.name(code) if code else None

    def _keep_outcome(self):
        """transport and fallback_reason stay readable after close() and detach()."""
        if self._s is not None:
            self._transport, self._reason = self.transport, self.fallback_reason

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

    def _fail(self, r):
        """Raises the exception for a negative errno from the C data path."""
        e = -r
        if e == errno.EAGAIN:
            if self.gettimeout():
                raise TimeoutError("timed out")
            raise BlockingIOError(e, os.strerror(e))
        msg = os.strerror(e)
        s = self._s
        if s is not None:
            c = s.conn if s.state in (lib.RS_RING, lib.RS_PRE_RX) else ffi.NULL
            if c != ffi.NULL and c.err == e and lib.rs_conn_errmsg(c)[0] != b"\0":
                msg = ffi.string(lib.rs_conn_errmsg(c)).decode(errors="replace")    # says which failure
            elif s.state == lib.RS_BROKEN and s.reason:
                why = reasons.name(s.reason)
                msg = "rdmasock: handshake failed: %s (%s)" % (reasons.REASONS[s.reason][1], why)
                if e == errno.EPROTO:
                    raise HandshakeError(why, msg)
        raise OSError(e, msg)                # OSError picks the subclass (ConnectionResetError...)

    # ---- connection set-up ---------------------------------------------------------

    def connect(self, address):
        if not self._inet or engine.PRELOADED or self._s is not None:
            return _base.connect(self, address)
        infos = _socket.getaddrinfo(address[0], address[1], self.family, _socket.SOCK_STREAM)
        sockaddr = infos[0][4] if infos else address
        handle = engine.plan_connect(self.fileno(), sockaddr)
        try:
            _base.connect(self, sockaddr)
        except (BlockingIOError, InterruptedError):
            if handle <= 0:
                raise
            # Loopback connects finish at once unless the backlog is full: wait a moment so
            # the HELLO leaves now, not at the application's next call.
            if not _writable(self.fileno(), 0.05):
                s = self._track(lib.RS_CLIENT_HS, handle, lib.RS_ROLE_CLIENT)
                if s is not None:
                    s.hello_pending = 1
                raise
            err = _base.getsockopt(self, _socket.SOL_SOCKET, _socket.SO_ERROR)
            if err:
                engine.drop(handle)
                raise OSError(err, os.strerror(err))
        except BaseException:
            if handle > 0:
                engine.drop(handle)
            raise
        if handle < 0:
            self._reason = reasons.name(-handle)
            engine.plain(self.fileno(), -handle)
        elif handle > 0 and self._track(lib.RS_CLIENT_HS, handle, lib.RS_ROLE_CLIENT) is not None:
            lib.rs_api_step(self._s, self._gen, 0)       # the HELLO leaves (rs_sock.c step)

    def connect_ex(self, address):
        try:
            self.connect(address)
        except OSError as exc:
            return exc.errno or errno.EIO
        return 0

    def listen(self, backlog=None):
        # The rendezvous name first, so that any client that can connect finds it; a socket
        # that listen() itself binds to a port registers after.
        ours = self._inet and not engine.PRELOADED and self._s is None
        first = ours and self.getsockname()[1] != 0
        handle = engine.listen(self.fileno()) if first else 0
        try:
            _base.listen(self, *(() if backlog is None else (backlog,)))
        except BaseException:
            if handle > 0:
                engine.unlisten(handle)
            raise
        if ours and not first:
            handle = engine.listen(self.fileno())
        if handle > 0:
            self._track(lib.RS_LISTEN, handle, 0)

    def accept(self):
        if not self._inet:
            return _base.accept(self)
        fd, addr = self._accept()
        sock = socket(self.family, self.type, self.proto, fileno=fd)
        if _socket.getdefaulttimeout() is None and self.gettimeout():
            sock.setblocking(True)
        if engine.PRELOADED:
            return sock, addr                     # the preloaded engine handles this socket
        handle = engine.accept(self.fileno(), fd)
        if handle < 0:
            sock._reason = reasons.name(-handle)
        elif handle > 0 and sock._track(lib.RS_SERVER_HS, handle, lib.RS_ROLE_SERVER) is not None:
            # A blocking listener may wait briefly for the HELLO (the client sends it right
            # after connect); a nonblocking one (event loops) never waits here.
            wait = 0 if self.gettimeout() == 0 else int(config.get().handshake_timeout * 1000)
            lib.rs_api_step(sock._s, sock._gen, wait)
        return sock, addr

    # ---- data ----------------------------------------------------------------------

    def recv(self, bufsize, flags=0):
        s = self._s
        if s is None:
            return _base.recv(self, bufsize, flags)
        if bufsize < 0:
            raise ValueError("negative buffersize in recv")
        if bufsize <= _RBUF_SIZE:
            buf = self._rbuf
            if buf is None:
                buf = self._rbuf = ffi.new("char[]", _RBUF_SIZE)
        else:
            buf = ffi.new("char[]", bufsize)
        while True:
            r = _rs_recv(s, self._gen, buf, bufsize, flags, 0 if flags & _NONBLOCK_FLAGS else self._tmo)
            if r >= 0:
                return _unpack(buf, r)
            if r == _PLAIN:
                return _base.recv(self, bufsize, flags)
            if r != _EINTR:
                self._fail(r)

    def recv_into(self, buffer, nbytes=0, flags=0):
        s = self._s
        if s is None:
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
            r = _rs_recv(s, self._gen, p, size, flags, 0 if flags & _NONBLOCK_FLAGS else self._tmo)
            if r >= 0:
                return r
            if r == _PLAIN:
                return _base.recv_into(self, buffer, nbytes, flags)
            if r != _EINTR:
                self._fail(r)

    def _plain(self):
        """True if this socket is plain TCP now."""
        return self._state() == lib.RS_PLAIN

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
        s = self._enter() if ancbufsize else None
        if s is None:
            return [], 0
        try:
            if s.state != lib.RS_RING:
                return [], 0
            buf, trunc = ffi.new("char[]", ancbufsize), ffi.new("int *")
            used = lib.rs_conn_rx_ancillary(s.conn, self.fileno(), buf, ancbufsize, trunc)
        finally:
            lib.rs_sock_put(s)
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
        s = self._s
        if s is None:
            return _base.send(self, data, flags)
        p = _from_buffer(data)
        while True:
            r = _rs_send(s, self._gen, p, len(p), flags, 0 if flags & _NONBLOCK_FLAGS else self._tmo)
            if r >= 0:
                return r
            if r == _PLAIN:
                return self._plain_send(_base.send, data, flags)
            if r != _EINTR:
                self._fail(r)

    def _plain_send(self, send, data, flags):
        """The kernel's send.  A declined server before the client's SWITCH: a client that
        closed during its handshake answered our DECLINE with a reset, which TCP would not
        have had: as over TCP after a peer's close, the first write succeeds and later ones
        fail."""
        s = self._s
        declined = s is not None and s.state == lib.RS_PRE_RX
        try:
            return send(self, data, flags)
        except (BrokenPipeError, ConnectionResetError):
            if not declined:
                raise
            if self._wrote_to_gone or s.state != lib.RS_PRE_RX:
                raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)) from None
            self._wrote_to_gone = True
            return None if send is _base.sendall else len(memoryview(data).cast("B"))

    def sendall(self, data, flags=0):
        s = self._s
        if s is None:
            return _base.sendall(self, data, flags)
        if self._tmo < 0 and not flags & _NONBLOCK_FLAGS:
            p = _from_buffer(data)          # blocking without timeout: one call sends it all
            n = len(p)
            while True:
                r = _rs_send(s, self._gen, p, n, flags, -1)
                if r == n:
                    return None
                if r >= 0:
                    p, n = p + r, n - r
                elif r == _PLAIN:
                    return self._plain_send(_base.sendall, ffi.buffer(p, n), flags)
                elif r != _EINTR:
                    self._fail(r)
        view = memoryview(data).cast("B")
        t = self.gettimeout()
        deadline = None if not t else time.monotonic() + t
        while view:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("timed out")
            if self._plain():
                return self._plain_send(_base.sendall, view, flags)
            n = self.send(view, flags)
            view = view[n:]

    def sendmsg(self, buffers, ancdata=(), flags=0, address=None):
        if self._plain():
            return _base.sendmsg(self, buffers, ancdata, flags, *([address] if address else []))
        buffers, ancdata = list(buffers), list(ancdata)
        addr = [address] if address is not None else []
        if any(isinstance(i, tuple) and len(i) == 3 and _tx_stamps_asked(*i) for i in ancdata):
            self._move_tx("tx_timestamps", flags)
            return _base.sendmsg(self, buffers, ancdata, flags, *addr)
        if ancdata or address is not None:
            # The kernel checks the arguments and the ancillary data (a TCP socket accepts
            # and ignores what it has no use for), with no byte of the stream; the ring
            # carries the bytes.
            _base.sendmsg(self, [], ancdata, flags | _NONBLOCK_FLAGS, *addr)
        return self.send(b"".join(bytes(memoryview(b).cast("B")) for b in buffers), flags)

    def sendto(self, data, *flags_addr):
        if self._plain():
            return _base.sendto(self, data, *flags_addr)
        if len(flags_addr) not in (1, 2):
            raise TypeError("sendto() takes 2 or 3 arguments (%d given)" % (len(flags_addr) + 1))
        # TCP ignores the address of a connected socket
        return self.send(data, flags_addr[0] if len(flags_addr) == 2 else 0)

    def _move_tx(self, reason, flags=0):
        """Our direction moves to TCP behind every byte sent before: what follows is the
        kernel's to send (docs/PROTOCOL.md 6.8)."""
        s = self._s
        while s is not None:
            r = lib.rs_api_move_tx(s, self._gen, reasons.CODE_BY_NAME[reason],
                                   flags | (_NONBLOCK_FLAGS if self._tmo == 0 else 0))
            if r in (0, _PLAIN):
                return
            if r != _EINTR:
                self._fail(r)

    def sendfile(self, file, offset=0, count=None):
        if self._plain():
            return _base.sendfile(self, file, offset, count)
        return self._sendfile_use_send(file, offset, count)

    def _sendfile_use_sendfile(self, file, offset=0, count=None):
        if self._plain():
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
        s = self._s
        r = _PLAIN if s is None else lib.rs_api_shutdown(s, self._gen, how, self._tmo == 0)
        if r == _PLAIN:
            return _base.shutdown(self, how)
        if r < 0:
            self._fail(r)

    def _release(self, release):
        self._keep_outcome()
        s, self._s = self._s, None
        fin, self._fin = self._fin, None
        if fin is not None:
            fin.detach()
        if s is not None and lib.rs_sock_get_gen(s, self._gen):
            lib.rs_sock_put(s)
            _forget(s, self._ino, self.fileno(), release)

    def _real_close(self):
        # The C object sends the FIN record (or RESET) and frees the ring when the last
        # holder goes, while this descriptor is still open.
        self._release(lib.rs_sock_release_fd)
        super()._real_close()

    def detach(self):
        """The descriptor leaves this object, the connection stays with it: an object made
        later for that descriptor (socket(fileno=fd)) takes it over."""
        self._keep_outcome()
        s, gen, fin, inode = self._s, self._gen, self._fin, self._ino
        self._s = self._fin = None
        if fin is not None:
            fin.detach()
        fd = super().detach()
        if s is not None:
            with _shared_lock:
                _detached[fd] = (s, gen, inode)
        return fd

    # ---- readiness helpers (used by tests and tools) ---------------------------------

    def pending_bytes(self):
        """Bytes receivable without waiting (like ioctl FIONREAD)."""
        c = self._conn
        if c is None:
            import fcntl
            import termios
            return struct.unpack("i", fcntl.ioctl(self.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        return lib.rs_rx_available(c)

    def setsockopt(self, level, optname, value, optlen=None):
        s = self._enter()
        if s is None:
            return _base.setsockopt(self, level, optname, value) if optlen is None else \
                _base.setsockopt(self, level, optname, value, optlen)
        try:
            if s.state == lib.RS_RING and level == _socket.IPPROTO_TCP and optname in _VIRTUAL_TCP_OPTS:
                v = 1 if value else 0            # the doorbell socket keeps Nagle and the cork off
                if optname == _socket.TCP_NODELAY:
                    s.app_nodelay = v
                else:
                    s.app_cork = v
                return None
            if optlen is None and _tx_stamps_asked(level, optname, value):
                self._move_tx("tx_timestamps")     # the kernel stamps only its own path
            if optlen is None:
                _base.setsockopt(self, level, optname, value)
                raw = struct.pack("@i", value) if isinstance(value, int) else bytes(value)
                lib.rs_sock_setopt_seen(s, level, optname, raw, len(raw))
            else:
                _base.setsockopt(self, level, optname, value, optlen)
                lib.rs_sock_setopt_seen(s, level, optname, ffi.NULL, 0)
        finally:
            lib.rs_sock_put(s)

    def getsockopt(self, *args):
        s = self._enter()
        if s is None:
            return _base.getsockopt(self, *args)
        try:
            level, name = args[0], args[1]
            if s.state == lib.RS_RING and level == _socket.IPPROTO_TCP and name in _VIRTUAL_TCP_OPTS and len(args) == 2:
                return s.app_nodelay if name == _socket.TCP_NODELAY else s.app_cork
            value = _base.getsockopt(self, *args)
            if (level, name) == (_socket.IPPROTO_TCP, _socket.TCP_INFO) and len(args) == 3:
                info = bytearray(value)            # counts the stream, not the socket
                lib.rs_sock_tcp_info(s, ffi.from_buffer(info), len(info))
                return bytes(info)
            if (level, name) == (_socket.SOL_SOCKET, _socket.SO_ERROR) and len(args) == 2:
                value = lib.rs_sock_so_error(s, value)
                # asyncio finishes a nonblocking connect by reading SO_ERROR: the HELLO leaves now
                if value == 0 and s.state == lib.RS_CLIENT_HS and s.hello_pending:
                    lib.rs_api_step(s, self._gen, 0)
            return value
        finally:
            lib.rs_sock_put(s)

    def __repr__(self):
        return _base.__repr__(self)[:-1] + ", transport=%s>" % self.transport

    def stats(self):
        c = self._conn
        if c is None:
            return {"transport": self.transport, "fallback_reason": self.fallback_reason}
        return {"transport": self.transport, "bytes_sent": c.tx.bytes, "bytes_received": c.rx.bytes,
                "records_sent": c.tx.records, "records_received": c.rx.records, "bytes_spilled": c.tx.spilled,
                "doorbells_sent": c.bells_sent, "sleeps": c.rx.sleeps, "word_sleeps": c.rx.word_sleeps,
                "word_timeouts": c.rx.word_timeouts, "word_wake": bool(c.word_wake_ok),
                "quiet_wake": bool(c.quiet_wake_ok), "state": _describe(c)}


def _describe(conn):
    """The C connection's positions and control words, one line (for diagnosis)."""
    buf = ffi.new("char[1024]")
    lib.rs_conn_describe(conn, buf, len(buf))
    return ffi.string(buf).decode()


def _writable(fd, seconds):
    import select
    p = select.poll()
    p.register(fd, select.POLLOUT)
    try:
        return bool(p.poll(int(seconds * 1000)))
    except InterruptedError:
        return False


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
