"""Drives the upgrade handshake of one connection (control plane; see handshake.py).

Both sides make progress lazily: `step()` is called from the socket's operations and
returns None while the peer's message has not arrived, so nonblocking sockets and event
loops never wait here.  Only this module reads the handshake bytes, always by peeking
first, so bytes that are not a handshake are left to the application untouched."""
import errno
import os
import select
import socket as _s
import time
import _socket as _c        # the C socket type: its methods even when socket.socket is patched

from . import config, handshake as hs, log, reasons, rendezvous, transport_rdma, transport_shm
from ._native import ffi, lib
from .devices import RdmaUnavailable

_sendall = _c.socket.sendall


def _recv(sock, n, flags):
    """recv that never waits (flags include MSG_DONTWAIT) whatever the socket's timeout."""
    buf = ffi.new("char[]", n)
    r = lib.rs_fd_recv(sock.fileno(), buf, n, flags | _s.MSG_DONTWAIT)
    if r < 0:
        if -r in (errno.EAGAIN, errno.EINTR):
            raise BlockingIOError(-r, os.strerror(-r))
        raise OSError(-r, os.strerror(-r))
    return ffi.unpack(buf, r)


def _stream_ended(sock):
    """True if the peer's end of the stream is what the socket holds next."""
    try:
        return _recv(sock, 1, _s.MSG_PEEK) == b""
    except OSError:
        return False            # nothing yet; or a reset, which the reads that follow report



def _agreed(conn, features):
    """A shm connection's optional features, as the server's ACCEPT lists them."""
    conn.spill_ok = bool(features & hs.F_SPILL)
    conn.word_wake_ok = bool(features & hs.F_FUTEX_WAKE)
    conn.quiet_wake_ok = bool(features & hs.F_QUIET_WAKE) and conn.word_wake_ok


def _features():
    """The handshake features this process offers: all it supports, less SPILL, FUTEX_WAKE,
    EVENT_BELL and QUIET_WAKE where RDMASOCK_SPILL, RDMASOCK_WORD_WAKE, RDMASOCK_EVENT_BELL
    or RDMASOCK_QUIET_WAKE turns them off (QUIET_WAKE needs FUTEX_WAKE)."""
    cfg = config.get()
    off = ((0 if cfg.spill else hs.F_SPILL) | (0 if cfg.word_wake else hs.F_FUTEX_WAKE | hs.F_QUIET_WAKE) |
           (0 if cfg.event_bell else hs.F_EVENT_BELL) | (0 if cfg.quiet_wake else hs.F_QUIET_WAKE))
    return hs.SUPPORTED & ~off


def _close_all(fds):
    for fd in fds:
        os.close(fd)


def _keep_bells(conn, own, peer, close):
    """The connection takes its event bells (shim/rs_bells.c); if it refuses them (not
    eventfds, or the process's share of descriptors is spent), `close` disposes of them,
    the socket's doorbell bytes wake it, and a debug line says why."""
    r = lib.rs_conn_set_bells(conn, own, peer)
    if r < 0:
        close([own, peer])
        log.line("event bells not kept (doorbell bytes instead): %s" % os.strerror(-r), level=3)


class Outcome:
    """How a handshake ended.  `preamble`: the server answered a HELLO, so the client's
    first bytes arrive as preamble frames ending in SWITCH (docs/PROTOCOL.md 2.9);
    `lazy_switch`: that SWITCH comes only with the client's first records, TCP byte or read."""
    __slots__ = ("transport", "reason", "conn", "preamble", "lazy_switch")

    def __init__(self, transport, reason=None, conn=None, preamble=False):
        self.transport, self.reason, self.conn, self.preamble = transport, reason, conn, preamble
        self.lazy_switch = False


def _ready_now(fd, events):
    """poll() without waiting (select() cannot take descriptors above 1023)."""
    p = select.poll()
    p.register(fd, events)
    return bool(p.poll(0))


def _wait(fd, events, deadline):
    """Waits for events until deadline (monotonic seconds, inf = forever). True if ready."""
    p = select.poll()
    p.register(fd, events)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ms = -1 if left == float("inf") else max(1, int(left * 1000))
        if p.poll(min(ms, 1000) if ms >= 0 else 1000):
            return True


def plan_client(sock, family, sockaddr):
    """Before connect: may this client offer an upgrade?  An unbound socket is bound to a
    local address on the destination's side, so its rendezvous name is known before the
    first byte; that name is registered.  Returns (None, marker, reserved) or (reason, None,
    0); `reserved`: ring memory held for the segment shm will map."""
    cfg = config.get()
    host, port = sockaddr[0], sockaddr[1]
    if cfg.disabled:
        return "disabled", None, 0
    if cfg.excluded(host, port):
        return "excluded", None, 0
    status, _detail = rendezvous.listener_status(host, port)
    if status == "unverified":
        return "peer_unverified", None, 0        # a name whose owner is not the listener's
    if status == "absent":
        # Another host (or network namespace): no rendezvous reaches it, so only a peer
        # listed in RDMASOCK_PEERS gets a HELLO, and only rdma can carry it.
        if not cfg.listed_peer(host, port):
            return "peer_not_rdmasock", None, 0
        return (None, None, 0) if "rdma" in cfg.transports else ("no_common_transport", None, 0)
    if "shm" not in cfg.transports and "rdma" not in cfg.transports:
        return "no_common_transport", None, 0
    local = sock.getsockname()
    if local[1] == 0:
        ip = host
        if rendezvous.norm_ip(ip) == "*":
            ip = "127.0.0.1" if family == _s.AF_INET else "::1"
        try:
            sock.bind((ip, 0) + tuple(sockaddr[2:]))
        except OSError as exc:
            if not rendezvous.is_local_bind_error(exc):
                raise
            return "not_local", None, 0
        local = sock.getsockname()
    elif rendezvous.norm_ip(local[0]) == "*":
        return "excluded", None, 0              # wildcard-bound client port: name unknowable
    reserved = 0
    if "shm" in cfg.transports:
        reserved = transport_shm.reserve(cfg.ring_size)
        if reserved is None:
            return "ring_memory_limit", None, 0
    marker = rendezvous.register_client(sock, local[0], local[1])
    if marker is None:
        transport_shm.unreserve(reserved)
        return "marker_busy", None, 0
    return None, marker, reserved


def server_plan(sock, local, peer):
    """After accept: will this client send a HELLO?  Returns (reason, decline_shm): reason
    None if a handshake follows, else why the connection stays TCP; decline_shm, if set, is
    the reason the handshake must not hand a segment to the client's name.  The client's
    own registration decides, not ours (with SO_REUSEPORT another listener may hold the
    listener name), or RDMASOCK_PEERS for clients on other hosts."""
    cfg = config.get()
    if cfg.disabled:
        return "disabled", None
    if cfg.excluded(local[0], local[1]):
        return "excluded", None
    if "shm" not in cfg.transports and "rdma" not in cfg.transports:
        return "no_common_transport", None
    status, _detail = rendezvous.client_status(peer, local)
    if status == "ok":
        return None, None
    why = "peer_unverified" if status == "unverified" else "peer_not_rdmasock"
    listed = cfg.listed_peer(peer[0], local[1])
    if listed or _hello_waiting(sock):
        # A client on another host (RDMASOCK_PEERS: rdma only), or an rdmasock client whose
        # name is not its own: its HELLO is answered, so that no handshake byte reaches the
        # program; no segment goes to a name we cannot trust.  One whose name is gone gave
        # up its handshake before we accepted (it closed): its HELLO is read, not answered
        # (Server.step).
        return None, "closed_during_handshake" if status == "absent" and not listed else why
    return why, None


def plan_answer(answer, name, engine_fd=-1):
    """Lets C answer a HELLO that offers shm as _choose_shm would (shim/rs_answer.c): fills
    the struct rs_answer with what this process offers and `name`, the client's verified
    rendezvous name (engine_fd: our duplicate of its socket), or a listener's prefix of
    them (rendezvous.client_prefix)."""
    cfg = config.get()
    if "shm" not in cfg.transports or len(name) > len(answer.name):
        return
    answer.engine_fd = engine_fd
    answer.features = _features()
    answer.spin_ns = max(0, cfg.spin_us) * 1000
    answer.ring_log2 = min(cfg.ring_size.bit_length() - 1, 30)
    answer.log_level = cfg.log_level
    ffi.memmove(answer.name, name, len(name))
    answer.name_len = len(name)


def c_may_plan(sockname):
    """May C plan the sockets a listener at sockname accepts (rs_answer_plan)?  Not where
    server_plan would look at more than the client's name: remote peers listed, or address
    filters that a wildcard listener's accepted sockets may or may not match."""
    cfg = config.get()
    if cfg.peers:
        return False
    wildcard = rendezvous.norm_ip(sockname[0]) == "*"
    return not (wildcard and any(net is not None for net, _port in cfg.include + cfg.exclude))


def _hello_waiting(sock):
    try:
        return _recv(sock, len(hs.MAGIC), _s.MSG_PEEK) == hs.MAGIC
    except OSError:
        return False


def release(conn):
    """Frees a C connection made by a handshake (rdma: its last WRITEs leave and its verbs
    objects go first)."""
    transport_rdma.release(int(ffi.cast("uintptr_t", conn)))
    ffi.release(conn)


def _keepalive(sock):
    """An rdma connection's TCP socket carries only doorbells: TCP keepalive is what notices
    a peer host that vanished without closing it (RDMASOCK_KEEPALIVE=idle,interval,count)."""
    ka = config.get().keepalive
    if not ka:
        return
    try:
        _c.socket.setsockopt(sock, _s.SOL_SOCKET, _s.SO_KEEPALIVE, 1)
        _c.socket.setsockopt(sock, _s.IPPROTO_TCP, _s.TCP_KEEPIDLE, ka[0])
        _c.socket.setsockopt(sock, _s.IPPROTO_TCP, _s.TCP_KEEPINTVL, ka[1])
        _c.socket.setsockopt(sock, _s.IPPROTO_TCP, _s.TCP_KEEPCNT, ka[2])
    except OSError:
        pass


def _rdma_reason(exc):
    return reasons.RDMA_REASONS.get(exc.reason, "rdma_setup_failed")


def after_answer(side, outcome, fd):
    """What both ends do once the handshake is over (docs/PROTOCOL.md 2.9): the client
    ends its preamble with SWITCH; a server that answered a HELLO reads the client's
    preamble first (rx_pre on the ring, or a ring-less reader after a DECLINE, returned)."""
    if isinstance(side, Client):
        if outcome.conn is not None:
            lib.rs_pre_switch_later(outcome.conn)   # with our first records, TCP byte or read
        elif outcome.reason != "closed_during_handshake":
            lib.rs_pre_switch(fd)               # our last preamble frame; failure shows later
        return None
    if not outcome.preamble:
        return None
    pre = outcome.conn
    if pre is None:
        pre = lib.rs_conn_new_tcp(fd)
        if pre == ffi.NULL:
            raise MemoryError("rdmasock: no memory for a connection")
    pre.rx.pre.active = 1
    # A lazy client sends SWITCH lazily only after an ACCEPT: then there is none in flight
    # to wait for at close (rs_pre_quiesce); after a DECLINE it comes at once.
    pre.rx.pre.lazy = outcome.lazy_switch and outcome.conn is not None
    return None if outcome.conn is not None else pre


class _Side:
    """Handshake state common to both sides."""

    def __init__(self, sock):
        self.sock = sock
        self.partial_since = None    # first time a partial message was seen (truncation timeout)

    def read(self, ops, deadline):
        """One message of the given opcodes; None if not (yet) there; 'plain' if the stream
        does not begin with a handshake message at all."""
        sock, cfg = self.sock, config.get()
        while True:
            try:
                data = _recv(sock, hs.MSG_LEN, _s.MSG_PEEK | _s.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                data = None
            if data == b"":
                return "eof"                           # peer closed before any handshake byte
            if data:
                if hs.classify(data) == "no":
                    return "plain"
                if len(data) >= 16:
                    length = hs.declared_length(data)
                    if length < hs.MSG_LEN or length > hs.MAX_LEN:
                        self._discard()
                        raise hs.HandshakeError("handshake_garbage",
                                                "rdmasock: handshake: bogus message length %d" % length)
                    full = _recv(sock, length, _s.MSG_PEEK | _s.MSG_DONTWAIT) if length > len(data) else data
                    if len(full) >= length:
                        try:
                            msg = hs.parse(full, ops)
                        finally:
                            self._consume(length)
                        return msg
                now = time.monotonic()
                if self.partial_since is None:
                    self.partial_since = now
                elif now - self.partial_since > cfg.handshake_timeout:
                    self._discard()
                    raise hs.HandshakeError("handshake_timeout", "rdmasock: handshake: truncated message (%d bytes)" % len(data))
                if deadline is None or now >= deadline:
                    return None
                time.sleep(0.001)
                continue
            if deadline is None or not _wait(sock.fileno(), select.POLLIN, deadline):
                return None

    def _consume(self, n):
        while n > 0:
            got = _recv(self.sock, n, _s.MSG_DONTWAIT)
            if not got:
                break
            n -= len(got)

    def _discard(self):
        try:
            while _recv(self.sock, 65536, _s.MSG_DONTWAIT):
                pass
        except OSError:
            pass


class Client(_Side):
    """Client side: HELLO after connect, then ACCEPT (+ descriptor) or DECLINE."""

    def __init__(self, sock, marker, reserved=0):
        super().__init__(sock)
        self.marker = marker
        self.reserved = reserved     # ring memory held for the segment (transport_shm.reserve)
        # os.urandom, not the secrets module: that would load hashlib and libcrypto into
        # every preloaded program (3 MiB and more of each process's memory).
        self.nonce = os.urandom(16)
        self.hello_sent = False
        self.rdma = None             # transport_rdma.Side while rdma is offered
        self.local_reason = None     # why this side could not offer rdma

    def start(self):
        """Sends HELLO: shm to a local listener (marker registered), else rdma (its set-up
        happens here, so its PARAMS travel in the HELLO)."""
        cfg = config.get()
        offer, ext = 0, b""
        if self.marker is not None and "shm" in cfg.transports:
            offer |= hs.T_SHM
        elif "rdma" in cfg.transports:
            try:
                self.rdma = transport_rdma.Side(cfg.ring_size)
                ext = self.rdma.params()
                offer |= hs.T_RDMA
            except RdmaUnavailable as exc:
                self.local_reason = _rdma_reason(exc)
                self.rdma = None
        hello = hs.Message(hs.OP_HELLO, features=_features(), transports=offer, nonce=self.nonce,
                           ring_log2=cfg.ring_size.bit_length() - 1, pid=os.getpid(), ext=ext)
        _sendall(self.sock, hello.pack())
        self.hello_sent = True

    def connected(self, deadline):
        """For a deferred (nonblocking) connect: True once established; raises if it failed."""
        fd = self.sock.fileno()
        if deadline is not None and not _wait(fd, select.POLLOUT, deadline):
            return False
        if deadline is None and not _ready_now(fd, select.POLLOUT):
            return False
        err = _c.socket.getsockopt(self.sock, _s.SOL_SOCKET, _s.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))
        return True

    def step(self, deadline):
        if not self.hello_sent:
            if not self.connected(deadline):
                return None
            self.start()
        msg = self.read((hs.OP_ACCEPT, hs.OP_DECLINE), deadline)
        if msg is None:
            return None
        if msg == "eof":
            return Outcome("tcp", "closed_during_handshake")
        if msg == "plain":
            raise hs.HandshakeError("handshake_garbage", "rdmasock: handshake: the server did not answer with a handshake")
        if msg.nonce != self.nonce:
            raise hs.HandshakeError("handshake_garbage", "rdmasock: handshake: reply does not echo our nonce")
        if msg.op == hs.OP_DECLINE:
            reason = reasons.name(msg.reason)
            if self.local_reason and reason == "no_common_transport":
                reason = self.local_reason      # we offered nothing: say why
            return Outcome("tcp", reason)
        if msg.features & hs.REQUIRED != hs.REQUIRED:
            raise hs.HandshakeError("handshake_garbage", "rdmasock: handshake: ACCEPT without the required features")
        if msg.transports == hs.T_RDMA and self.rdma is not None:
            return self._accept_rdma(msg)
        if msg.transports != hs.T_SHM or self.marker is None:
            raise hs.HandshakeError("handshake_garbage", "rdmasock: handshake: ACCEPT of a transport we did not offer")
        if msg.ring_log2 > config.get().ring_size.bit_length() - 1:
            # the segment would take more of the ring memory budget than we reserved
            raise hs.HandshakeError("handshake_garbage", "rdmasock: handshake: ACCEPT grants a larger ring than offered")
        fds = rendezvous.recv_fd(self.marker, self.nonce)   # passed before the ACCEPT was sent
        if fds is None:
            raise hs.HandshakeError("fd_pass_failed", "rdmasock: handshake: shared memory descriptor never arrived")
        fd, bells = fds[0], fds[1:]
        reserved, self.reserved = self.reserved, 0
        try:
            conn = transport_shm.attach(fd, self.sock.fileno(), False, config.get().spin_us, reserved)
        except OSError as exc:
            rendezvous.defuse(bells)
            raise hs.HandshakeError("shm_unavailable", "rdmasock: handshake: cannot map the peer's segment: %s" % exc)
        finally:
            os.close(fd)
        if conn.salt != msg.salt or conn.ring_size != 1 << msg.ring_log2:
            rendezvous.defuse(bells)
            transport_shm.release(conn)
            raise hs.HandshakeError("handshake_garbage", "rdmasock: handshake: segment does not match ACCEPT")
        _agreed(conn, msg.features)
        if bells and msg.features & hs.F_EVENT_BELL:
            # [the server's bell, ours]; the server passes what it likes: a refused
            # descriptor is closed harmlessly, and the socket's doorbell bytes, which the
            # server's wait holds too, wake us (rs_bells.c)
            _keep_bells(conn, bells[1], bells[0], rendezvous.defuse)
        else:
            rendezvous.defuse(bells)
        return Outcome("shm", conn=conn)

    def _accept_rdma(self, msg):
        side, self.rdma = self.rdma, None
        try:
            if msg.ring_log2 != config.get().ring_size.bit_length() - 1:
                raise RdmaUnavailable("bad_params", "ACCEPT grants ring 2^%d, we offered 2^%d"
                                      % (msg.ring_log2, config.get().ring_size.bit_length() - 1))
            conn = side.connect(msg.ext, self.sock.fileno(), msg.salt, config.get().spin_us)
        except RdmaUnavailable as exc:
            side.close()
            raise hs.HandshakeError(_rdma_reason(exc), "rdmasock: handshake: rdma: %s" % exc)
        _keepalive(self.sock)
        return Outcome("rdma", conn=conn)

    def close(self):
        transport_shm.unreserve(self.reserved)
        self.reserved = 0
        if self.marker is not None:
            rendezvous.close_marker(self.marker)
            self.marker = None
        if self.rdma is not None:
            self.rdma.close()
            self.rdma = None


class Server(_Side):
    """Server side: never sends first; answers a HELLO with ACCEPT or DECLINE."""

    def __init__(self, sock, decline_shm=None):
        super().__init__(sock)
        self.decline_shm = decline_shm      # reason not to offer shm (server_plan)

    def step(self, deadline):
        msg = self.read((hs.OP_HELLO,), deadline)
        if msg is None:
            return None
        if msg == "eof":
            return Outcome("tcp", "closed_during_handshake")
        if msg == "plain":
            return Outcome("tcp", "peer_not_rdmasock")
        if _stream_ended(self.sock):
            # The client closed right after its HELLO: an answer would only provoke a reset,
            # which the application would see where TCP shows it the end of the stream.
            return Outcome("tcp", "closed_during_handshake")
        if self.decline_shm == "closed_during_handshake":
            # Its name is gone: it closed before we accepted, having written frames.  The
            # reset an answer would provoke would also destroy those still on their way;
            # they are read unanswered, to their end.
            outcome = Outcome("tcp", "closed_during_handshake")
            outcome.preamble = bool(msg.features & hs.F_PREAMBLE)
            return outcome
        reply = hs.Message(hs.OP_DECLINE, nonce=msg.nonce, pid=os.getpid())
        outcome = self._choose(msg, reply)
        outcome.preamble = bool(msg.features & hs.F_PREAMBLE)   # an older client sends plain bytes
        outcome.lazy_switch = bool(msg.features & hs.F_LAZY_SWITCH)
        try:
            _sendall(self.sock, reply.pack())
        except OSError:
            pass          # the client is gone: the reads that follow report it
        return outcome

    def _choose(self, hello, reply):
        cfg = config.get()
        if hello.features & hs.REQUIRED != hs.REQUIRED:
            reply.reason = reasons.CODE_BY_NAME["version_mismatch"]
            return Outcome("tcp", "version_mismatch")
        reason = "no_common_transport"
        if hello.transports & hs.T_SHM and self.decline_shm:
            reason = self.decline_shm
        elif hello.transports & hs.T_SHM and "shm" in cfg.transports:
            outcome = self._choose_shm(hello, reply)
            if outcome.conn is not None:
                return outcome
            reason = outcome.reason
        if hello.transports & hs.T_RDMA and "rdma" in cfg.transports:
            outcome = self._choose_rdma(hello, reply)
            if outcome.conn is not None:
                return outcome
            reason = outcome.reason
        reply.op, reply.transports = hs.OP_DECLINE, 0
        reply.reason = reasons.CODE_BY_NAME[reason]
        return Outcome("tcp", reason)

    def _choose_rdma(self, hello, reply):
        """The client's ring size is granted as offered: both sides allocated their rings
        before they knew each other's configuration."""
        cfg = config.get()
        if not 12 <= hello.ring_log2 <= 30:
            return Outcome("tcp", "rdma_connect_failed")
        salt = int.from_bytes(os.urandom(8), "little")
        side = None
        try:
            side = transport_rdma.Side(1 << hello.ring_log2)
            params = side.params()
            conn = side.connect(hello.ext, self.sock.fileno(), salt, cfg.spin_us)
        except RdmaUnavailable as exc:
            if side is not None:
                side.close()
            return Outcome("tcp", _rdma_reason(exc))
        reply.op, reply.transports, reply.features = hs.OP_ACCEPT, hs.T_RDMA, hello.features & _features()
        reply.ring_log2, reply.salt, reply.ext = hello.ring_log2, salt, params
        _keepalive(self.sock)
        return Outcome("rdma", conn=conn)

    def _choose_shm(self, hello, reply):
        cfg = config.get()
        ring_log2 = min(max(hello.ring_log2, 12), cfg.ring_size.bit_length() - 1, 30)
        salt = int.from_bytes(os.urandom(8), "little")
        features = hello.features & _features()
        stage = "shm_unavailable"
        memfd = None
        bells = []
        try:
            memfd = transport_shm.create_segment(1 << ring_log2, salt)
            conn = transport_shm.attach(memfd, self.sock.fileno(), True, cfg.spin_us)
            bells = self._event_bells(features)
            if not bells:
                features &= ~hs.F_EVENT_BELL
            stage = "fd_pass_failed"
            peer = self.sock.getpeername()
            rendezvous.send_fd(peer[0], peer[1], hello.nonce, [memfd] + bells)
        except transport_shm.RingMemoryLimit:
            return Outcome("tcp", "ring_memory_limit")
        except OSError:
            _close_all(bells)
            if stage == "fd_pass_failed":
                transport_shm.release(conn)
            return Outcome("tcp", stage)
        finally:
            if memfd is not None:
                os.close(memfd)
        if bells:
            _keep_bells(conn, bells[0], bells[1], _close_all)   # [ours, the client's]
        reply.op, reply.transports, reply.features = hs.OP_ACCEPT, hs.T_SHM, features
        reply.ring_log2, reply.salt = ring_log2, salt
        _agreed(conn, reply.features)
        return Outcome("shm", conn=conn)

    @staticmethod
    def _event_bells(features):
        """Both event bells of an shm connection, [the server's, the client's], if both ends
        speak EVENT_BELL and the process's share of descriptors allows; else []."""
        if not features & hs.F_EVENT_BELL:
            return []
        fds = ffi.new("int[2]")
        r = lib.rs_bells_create(fds)
        if r < 0:
            log.line("event bells not made (doorbell bytes instead): %s" % os.strerror(-r), level=3)
            return []
        return [fds[0], fds[1]]

    def close(self):
        pass
