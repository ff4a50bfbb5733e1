"""The control plane of the socket object (shim/rs_sock.c), for both of its hosts: the
preloaded program (librdmasock.so, shim/preload/, through the cffi-embedded
rdmasock._engine library) and the Python API (rdmasock/api.py, shim/api/).

The C side calls these functions only at connection set-up and teardown: register a
listener, plan a connect, take an accepted socket, advance a handshake.  The data path
never enters Python.  The handshakes themselves are upgrade.py's.  The descriptors belong
to the application, so the engine works on duplicates it closes itself."""
import errno
import fcntl
import os
import socket as _socket
import threading
import time

from . import config, handshake as hs, log, reasons, rendezvous, upgrade
from ._native import ffi, lib

STEP_PENDING, STEP_RING, STEP_TCP = lib.RS_STEP_PENDING, lib.RS_STEP_RING, lib.RS_STEP_TCP
STEP_PRE_RX, STEP_CONNECTING = lib.RS_STEP_PRE_RX, lib.RS_STEP_CONNECTING

PRELOADED = False      # this process runs the preload library: rdmasock.socket stays plain
_listeners = {}        # handle -> rendezvous marker socket
_handshakes = {}       # handle -> _Handshake
_next = [1]
_next_lock = threading.Lock()   # threads of the program connect at once (the GIL may switch between bytecodes)


class AppSocket(_socket.socket):
    """A socket object over a duplicate of the application's descriptor (the same open
    file).  The engine works on its own duplicate, never on the application's number:
    that number may be closed and reused while a handshake is in progress."""

    def __init__(self, app_fd, dup=True):
        fd = os.dup(app_fd) if dup else app_fd
        # The duplicate shares the open file, and with it O_NONBLOCK.  A socket object made
        # while the host program has a socket.setdefaulttimeout() switches its file to
        # non-blocking: the application's own socket would change under it.
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            super().__init__(fileno=fd)
        except BaseException:
            os.close(fd)
            raise
        if fcntl.fcntl(fd, fcntl.F_GETFL) != flags:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)


class _Handshake:
    def __init__(self, sock, side, role, peer=None):
        self.sock, self.side, self.role = sock, side, role
        # Addresses now: by the end of the handshake the peer may already have closed.
        try:
            self.local = sock.getsockname()
            self.peer = peer or sock.getpeername()
        except OSError:
            self.peer = peer

    def close(self):
        self.side.close()
        self.sock.close()


def _new_handle(table, item):
    with _next_lock:
        n = _next[0]
        _next[0] = n + 1 if n < 0x7FFFFFF0 else 1
        table[n] = item
    return n


def _log(role, sock, transport, reason):
    # Each on its own: after the peer closed getpeername fails, getsockname still works.
    local = peer = "-"
    try:
        local = sock.getsockname()
        peer = sock.getpeername()
    except OSError:
        pass
    log.connection(role, local, peer, transport, reason)


def listen(fd, marker_out=None, answer=0):
    """A listener: its rendezvous name (none if another listener of the port holds it).
    Returns a handle (> 0) or 0; marker_out[0] gets
    the name's descriptor (a forked child that has not entered the engine closes its copy
    itself, then tells unlisten to detach it); `answer`, the address of a struct rs_answer,
    is filled if C may plan the sockets it accepts (shim/rs_answer.c)."""
    cfg = config.get()
    if cfg.disabled or ("shm" not in cfg.transports and "rdma" not in cfg.transports):
        return 0
    s = AppSocket(fd)
    try:
        name = s.getsockname()
        if cfg.excluded(name[0], name[1]):
            return 0
        marker = rendezvous.register_listener(s)
    finally:
        s.close()
    if marker is None:
        # Another listener of the port holds the name (SO_REUSEPORT, or the same socket
        # listened on again in another process): clients that find it send a HELLO to
        # whichever socket of the port accepts them, so this one answers too.
        log.line("pid=%d role=listener local=%s:%s not registered: its rendezvous name is taken; "
                 "its connections are answered all the same" % (os.getpid(), name[0], name[1]), level=3)
    elif marker_out is not None:
        marker_out[0] = marker.fileno()
    if answer and upgrade.c_may_plan(name):
        upgrade.plan_answer(ffi.cast("struct rs_answer *", answer), rendezvous.client_prefix())
    return _new_handle(_listeners, marker)


def unlisten(handle, detach=0):
    m = _listeners.pop(handle, None)
    if m is not None and detach:
        m.detach()                              # already closed by the front, in a fork's child
    elif m is not None:
        rendezvous.close_marker(m)


def connect_plan(fd, sockaddr_bytes):
    """Before the application's connect: offer an upgrade?  Returns a handle, or -reason
    code (plain TCP; logged by plain() once connected)."""
    import struct
    return plan_connect(fd, _socket_address(struct.unpack_from("=H", sockaddr_bytes)[0], sockaddr_bytes))


def plan_connect(fd, addr):
    """connect_plan for an address tuple (host, port[, flowinfo, scope])."""
    s = AppSocket(fd)
    try:
        reason, marker, reserved = upgrade.plan_client(s, s.family, addr)
    except BaseException:
        s.close()
        raise
    if reason is not None:
        s.close()
        return -reasons.CODE_BY_NAME[reason]
    return _new_handle(_handshakes, _Handshake(s, upgrade.Client(s, marker, reserved), "client", addr))


def plain(fd, code):
    """A connect that stays plain TCP (connect_plan's reason), now that it has addresses."""
    s = AppSocket(fd)
    try:
        _log("client", s, "tcp", reasons.name(code))
    finally:
        s.close()


def _socket_address(family, raw):
    """(host, port[, flowinfo, scope]) from a struct sockaddr."""
    import struct
    if family == _socket.AF_INET:
        port = struct.unpack_from(">H", raw, 2)[0]
        return _socket.inet_ntop(_socket.AF_INET, raw[4:8]), port
    port, flow = struct.unpack_from(">HI", raw, 2)
    scope = struct.unpack_from("<I", raw, 24)[0] if len(raw) >= 28 else 0
    return _socket.inet_ntop(_socket.AF_INET6, raw[8:24]), port, flow, scope


def accept(lfd, fd, answer=0):
    """An accepted socket: a HELLO follows if its client registered a rendezvous name (or
    is listed in RDMASOCK_PEERS).  `answer`: the address of a struct rs_answer, filled if a
    HELLO that offers shm may be answered in C (shim/rs_answer.c); 0 if the caller cannot."""
    if config.get().disabled:
        return 0
    s = AppSocket(fd)
    try:
        local, peer = s.getsockname(), s.getpeername()
        why, decline_shm = upgrade.server_plan(s, local, peer)
        if why is not None:
            _log("server", s, "tcp", why)
            s.close()
            return -reasons.CODE_BY_NAME[why]
    except OSError as e:
        log.line("pid=%d role=server fd=%d transport=tcp: accepted socket not planned: %s" % (os.getpid(), fd, e), level=3)
        s.close()
        return 0
    if answer and decline_shm is None:
        upgrade.plan_answer(ffi.cast("struct rs_answer *", answer), rendezvous.client_name(peer[0], peer[1]), s.fileno())
    return _new_handle(_handshakes, _Handshake(s, upgrade.Server(s, decline_shm), "server"))


def accept_late(fd):
    """A handshake C planned at accept and cannot finish (shim/rs_answer.c): the engine
    takes it over, on `fd`, a duplicate of the socket made for it.  What C found at accept
    stands (the client's name was its own then, so a HELLO is on its way)."""
    s = AppSocket(fd, dup=False)
    return _new_handle(_handshakes, _Handshake(s, upgrade.Server(s), "server"))


def drop(handle, detach=0):
    """A handshake that ends without the engine: the socket was closed, or (detach) its
    HELLO was answered in C, which closed the engine's descriptor already."""
    h = _handshakes.pop(handle, None)
    if h is not None and detach:
        h.sock.detach()
    elif h is not None:
        h.close()


_PEER_ENDED = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN)


def step(handle, wait_ms, out):
    """Advances a handshake.  Returns a STEP_* code (out[0] = C connection address for
    STEP_RING and STEP_PRE_RX) or -errno when the handshake failed."""
    h = _handshakes.get(handle)
    if h is None:
        return STEP_TCP
    deadline = None if wait_ms == 0 else float("inf") if wait_ms < 0 else time.monotonic() + wait_ms / 1000
    side = h.side
    try:
        if isinstance(side, upgrade.Client) and not side.hello_sent and not side.connected(None):
            if deadline is None:
                return STEP_CONNECTING
            if not side.connected(deadline):
                return STEP_CONNECTING
        outcome = side.step(deadline)
    except hs.HandshakeError as exc:
        _finish(handle, h, "tcp", exc.reason)
        out[1] = reasons.CODE_BY_NAME.get(exc.reason, 0)
        return -errno.EPROTO
    except OSError as exc:
        # a reset (or a socket already shut) met the handshake: the peer's end came first
        reason = "closed_during_handshake" if exc.errno in _PEER_ENDED else "handshake_garbage"
        _finish(handle, h, "tcp", reason)
        out[1] = reasons.CODE_BY_NAME[reason]
        return -(exc.errno or errno.EIO)
    if outcome is None:
        return STEP_PENDING
    try:
        pre = upgrade.after_answer(side, outcome, h.sock.fileno())
    except MemoryError:
        _finish(handle, h, "tcp", "shm_unavailable")
        return -errno.ENOMEM
    out[1] = reasons.CODE_BY_NAME.get(outcome.reason, 0) if outcome.reason else 0
    code = STEP_TCP
    if outcome.conn is not None:
        ffi.gc(outcome.conn, None)                   # from now on C owns it (rs_conn_free)
        out[0], code = int(ffi.cast("uintptr_t", outcome.conn)), STEP_RING
    elif pre is not None:
        out[0], code = int(ffi.cast("uintptr_t", pre)), STEP_PRE_RX
    _finish(handle, h, outcome.transport, outcome.reason)
    return code


def _finish(handle, h, transport, reason):
    _handshakes.pop(handle, None)
    local = getattr(h, "local", None)
    if not local or local[1] == 0:
        # A client towards another host (RDMASOCK_PEERS) is not bound before its connect,
        # so its address is only known now; getsockname still works after the peer closed.
        try:
            local = h.sock.getsockname()
        except OSError:
            pass
    log.connection(h.role, local, h.peer, transport, reason)
    h.close()


def release(conn_addr):
    """The C side frees the connection at conn_addr: rdma's verbs objects go first."""
    from . import transport_rdma
    transport_rdma.release(conn_addr)


def fell_back(fd, role, conn_addr):
    """A connection went on over TCP mid-stream: its RDMA transport failed, or its shm
    ring stalled (shim/rs_fallback.c)."""
    reason, why = reasons.moved_to_tcp(ffi.cast("rs_conn *", conn_addr))
    s = AppSocket(fd)
    try:
        _log("client" if role == 1 else "server", s, "tcp", "%s (%s)" % (reason, why))
    finally:
        s.close()


def internal_error(exc, val, tb):
    """An exception escaped the engine: the connection falls back or reports EPROTO;
    the traceback goes to the log file (if any), never to the program's stderr."""
    import traceback
    log.line("engine error: " + " | ".join("".join(traceback.format_exception(exc, val, tb)).splitlines()))


def set_up_preloaded():
    """Called once by the embedded engine (rdmasock/_build_engine.py) of a preloaded
    program.  Marks the process as preloaded: rdmasock.socket() then stays out of the way.
    At log level debug, says which Python the engine runs in (`rdmasock doctor` reads it)."""
    global PRELOADED
    PRELOADED = True
    if config.get().log_level >= config.LOG_LEVELS.index("debug"):
        import sys
        from . import devices
        ok, why = devices.pyverbs_available()
        log.line("engine=ready python=%s executable=%s package=%s pyverbs=%s"
                 % (sys.version.split()[0], sys.executable, os.path.dirname(os.path.abspath(__file__)),
                    "yes" if ok else "no (%s)" % why), level=3)
