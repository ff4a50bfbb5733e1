"""pyverbs control plane of one RDMA connection (RC queue pair), see docs/RDMA.md.

One `Endpoint` per connection and side:

    ep = Endpoint()                                   # device per devices.choose(), own PD, CQ, RC QP (INIT)
    ep.register_ring(addr, length)                    # receive ring: LOCAL_WRITE | REMOTE_WRITE
    ep.register_credit(addr, 8)                       # credit word the peer writes: same access
    ep.register_source(addr, length)                  # local buffer RDMA WRITEs are sent from
    tcp.sendall(ep.local_params()); ep.connect(recv_exact(tcp, PARAMS_SIZE))   # INIT->RTR->RTS
    ep.post_write(src_off, n, dst_off, signaled=...)  # one RDMA WRITE, inline when n fits
    ep.poll()                                         # [Completion], never blocks

Memory is the caller's (e.g. an mmap'd ring): it is registered, never allocated or freed here,
and must stay mapped until close().  pyverbs is imported lazily.  An Endpoint is not
thread-safe: one thread posts and polls at a time.

Connection parameters travel as PARAMS (72 bytes, big endian, no padding):

    off size field
      0   4  magic b"RSRD"
      4   1  version (1)
      5   1  link layer (1 InfiniBand, 2 Ethernet)
      6   1  active MTU of the sender's port (enum ibv_mtu: 1=256 .. 5=4096)
      7   1  reserved, 0
      8   2  LID (InfiniBand; 0 on RoCE)
     10   2  reserved, 0
     12   4  QP number (24 bits)
     16   4  initial PSN (24 bits, random)
     20   4  rkey of the receive ring
     24  16  GID (raw)
     40   8  receive ring address
     48   8  receive ring length
     56   8  credit word address (the mirror of the peer's counters: remote write)
     64   4  credit word length
     68   4  rkey of the credit word
     72   8  words address (this side's own counters: remote read; 0 if none)
     80   4  words length
     84   4  rkey of the words
"""
import errno
import os
import secrets
import struct
import threading
import time
from collections import namedtuple

from . import config, devices
from .devices import RdmaUnavailable

PARAMS = struct.Struct(">4sBBBBHHIII16sQQQIIQII")
PARAMS_SIZE = PARAMS.size            # 88
PARAMS_MAGIC = b"RSRD"
PARAMS_VERSION = 2

Params = namedtuple("Params", "link_layer mtu lid qpn psn ring_rkey gid ring_addr ring_len "
                              "credit_addr credit_len credit_rkey words_addr words_len words_rkey")
Completion = namedtuple("Completion", "wr_id status opcode byte_len")

DEFAULT_SQ_DEPTH = 256
DEFAULT_RQ_DEPTH = 16
# RC timers: local ACK timeout 4.096 us * 2**14 = 67 ms, 7 retries, RNR retry "infinite" (7):
# a peer that vanished without closing its QP is noticed after about half a second.
ACK_TIMEOUT = 14
RETRY_CNT = 6
RNR_RETRY = 6
MIN_RNR_TIMER = 12
HOP_LIMIT = 64


class RdmaError(Exception):
    """A verbs failure on an established endpoint (post, poll, completion with error)."""

    def __init__(self, msg, status=None):
        super().__init__(msg)
        self.status = status


def _e():
    import pyverbs.enums as e
    return e


def _errno_of(exc):
    code = getattr(exc, "error_code", -1)
    return code if isinstance(code, int) and code > 0 else None


# One device context per device per process, shared by its endpoints: contexts are heavy
# (a uverbs file, doorbell pages); protection domains, CQs, QPs and MRs are per connection.
# The last endpoint's close closes the context: a device being removed (`rdma link delete`
# waits for every open context) is then released as soon as its connections end.
_contexts = {}          # name -> [Context, users]
_contexts_lock = threading.Lock()


def _context(name):
    from pyverbs.device import Context
    with _contexts_lock:
        entry = _contexts.get(name)
        if entry is None:
            entry = _contexts[name] = [Context(name=name), 0]
        entry[1] += 1
        return entry[0]


def _context_done(name):
    with _contexts_lock:
        entry = _contexts.get(name)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _contexts[name]
    try:
        entry[0].close()
    except Exception:
        pass


def forget_context(name):
    """Drop (and close) the cached context of a device, e.g. after it was removed."""
    with _contexts_lock:
        entry = _contexts.pop(name, None)
    if entry is not None:
        try:
            entry[0].close()
        except Exception:
            pass


def _gid_str(raw):
    h = bytes(raw).hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


class _Region:
    __slots__ = ("name", "addr", "length", "mr", "lkey", "rkey")

    def __init__(self, name, addr, length, mr):
        self.name, self.addr, self.length, self.mr = name, addr, length, mr
        self.lkey, self.rkey = mr.lkey, mr.rkey


class Endpoint:
    """One side of one RC connection: its own protection domain, CQ and QP."""

    def __init__(self, device=None, port=None, gid_index=None, sq_depth=DEFAULT_SQ_DEPTH,
                 rq_depth=DEFAULT_RQ_DEPTH, max_inline=None, env=None):
        env = os.environ if env is None else env
        self.choice = devices.choose(device, port, gid_index, env=env)
        e = _e()
        from pyverbs.pd import PD
        from pyverbs.cq import CQ
        self._closed = False
        self._regions = {}
        self.peer = None
        self.psn = secrets.randbits(24)
        self.sq_depth = sq_depth
        self.ctx = _context(self.choice.device)
        want_inline = max_inline if max_inline is not None else int(config.value(env, "RDMA_INLINE"))
        try:
            self.pd = PD(self.ctx)
            self.cq = CQ(self.ctx, sq_depth + rq_depth + 1)
        except Exception as exc:
            self.close()
            raise RdmaUnavailable("verbs_setup_failed", "PD/CQ on %s: %s" % (self.choice.device, exc))
        self.qp, self.max_inline = self._create_qp(sq_depth, rq_depth, want_inline)
        try:
            attr = self._attr(e.IBV_QPS_INIT)
            attr.pkey_index = 0
            attr.port_num = self.choice.port
            # Remote READ reaches only regions registered with it (the counters of
            # register_words); rings are remote-write only; no atomics.
            attr.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
            self.qp.modify(attr, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)
        except Exception as exc:
            self.close()
            raise RdmaUnavailable("verbs_setup_failed", "QP to INIT: %s" % exc)
        # Reused work request: pyverbs 44's SGE and SendWR never free their malloc'd memory
        # (their destructor is misspelt `__dealloc`), so building one per post leaks.
        from pyverbs.wr import SGE, SendWR
        self._sge = SGE(0, 0, 0)
        self._wr = SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[self._sge], send_flags=0)
        self._wr.sg_list = self._sge                              # post straight from _sge
        self._sge_lkey = 0
        self._remote = {}
        self._F_SIGNALED = e.IBV_SEND_SIGNALED
        self._F_INLINE = e.IBV_SEND_INLINE

    # ---------------------------------------------------------------- set-up
    @staticmethod
    def _attr(state):
        from pyverbs.qp import QPAttr
        a = QPAttr()
        a.qp_state = state
        return a

    def _create_qp(self, sq_depth, rq_depth, want_inline):
        e = _e()
        from pyverbs.qp import QP, QPInitAttr, QPCap
        n = max(0, want_inline)
        last = None
        while True:
            cap = QPCap(max_send_wr=sq_depth, max_recv_wr=rq_depth, max_send_sge=1, max_recv_sge=1,
                        max_inline_data=n)
            try:
                qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                            sq_sig_all=0, cap=cap))
                break
            except Exception as exc:
                last = exc
                if n == 0:
                    self.close()
                    raise RdmaUnavailable("verbs_setup_failed", "cannot create an RC QP on %s: %s"
                                          % (self.choice.device, last))
                n //= 2
        try:
            got = qp.query(e.IBV_QP_CAP)[1].cap.max_inline_data
        except Exception:
            got = n
        return qp, max(n, got)

    def _register(self, name, addr, length, access):
        if self._closed:
            raise RdmaError("endpoint closed")
        if name in self._regions:
            raise ValueError("%s already registered" % name)
        if not addr or length <= 0:
            raise ValueError("bad %s region %#x+%d" % (name, addr or 0, length))
        from pyverbs.mr import MR
        try:
            mr = MR(self.pd, length, access, address=addr)
        except Exception as exc:
            code = _errno_of(exc)
            if code in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
                ml = devices.memlock_limit()
                raise RdmaUnavailable("memlock", "registering %d bytes failed (%s); memlock limit %s"
                                      % (length, os.strerror(code), ml["soft"]))
            raise RdmaUnavailable("verbs_setup_failed", "registering %s: %s" % (name, exc))
        reg = self._regions[name] = _Region(name, addr, length, mr)
        return reg

    def register_ring(self, addr, length):
        """The receive ring the peer writes into: LOCAL_WRITE | REMOTE_WRITE (verbs requires
        LOCAL_WRITE with REMOTE_WRITE), never relaxed ordering, no remote read or atomics."""
        e = _e()
        return self._register("ring", addr, length, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)

    def register_credit(self, addr, length=8):
        """The credit word(s) the peer's consumer writes into; same access as the ring."""
        e = _e()
        return self._register("credit", addr, length, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)

    def register_words(self, addr, length):
        """This side's own counters, which the peer may RDMA READ (and nothing else)."""
        e = _e()
        return self._register("words", addr, length, e.IBV_ACCESS_REMOTE_READ)

    def register_local(self, name, addr, length):
        """A local buffer RDMA READ responses land in (no remote access)."""
        e = _e()
        return self._register(name, addr, length, e.IBV_ACCESS_LOCAL_WRITE)

    def register_source(self, addr, length, name="source"):
        """A local buffer RDMA WRITEs are sent from (no remote access at all)."""
        return self._register(name, addr, length, 0)

    def local_params(self):
        """This side's PARAMS (bytes) for the peer."""
        ring = self._regions.get("ring")
        credit = self._regions.get("credit")
        words = self._regions.get("words")
        c = self.choice
        return PARAMS.pack(PARAMS_MAGIC, PARAMS_VERSION, c.link_layer, c.active_mtu, 0, c.lid, 0,
                           self.qp.qp_num, self.psn, ring.rkey if ring else 0, bytes(c.gid),
                           ring.addr if ring else 0, ring.length if ring else 0,
                           credit.addr if credit else 0, credit.length if credit else 0,
                           credit.rkey if credit else 0, words.addr if words else 0,
                           words.length if words else 0, words.rkey if words else 0)

    @staticmethod
    def parse_params(data):
        """Validate and decode a peer's PARAMS; raises RdmaUnavailable('bad_params')."""
        if len(data) != PARAMS_SIZE:
            raise RdmaUnavailable("bad_params", "%d bytes, want %d" % (len(data), PARAMS_SIZE))
        (magic, version, ll, mtu, _r1, lid, _r2, qpn, psn, ring_rkey, gid, ring_addr, ring_len,
         credit_addr, credit_len, credit_rkey, words_addr, words_len, words_rkey) = PARAMS.unpack(data)
        if magic != PARAMS_MAGIC or version != PARAMS_VERSION:
            raise RdmaUnavailable("bad_params", "magic/version %r/%d" % (magic, version))
        if ll not in (1, 2) or not 1 <= mtu <= 5 or qpn >= 1 << 24 or psn >= 1 << 24 or not qpn:
            raise RdmaUnavailable("bad_params", "link layer %d mtu %d qpn %#x psn %#x" % (ll, mtu, qpn, psn))
        if (ring_len and not ring_addr) or (credit_len and not credit_addr) or (words_len and not words_addr):
            raise RdmaUnavailable("bad_params", "region without address")
        return Params(ll, mtu, lid, qpn, psn, ring_rkey, gid, ring_addr, ring_len,
                      credit_addr, credit_len, credit_rkey, words_addr, words_len, words_rkey)

    def connect(self, peer_params):
        """Import the peer's PARAMS and move the QP INIT -> RTR -> RTS."""
        e = _e()
        from pyverbs.addr import AHAttr, GlobalRoute, GID
        p = self.parse_params(bytes(peer_params))
        if p.link_layer != self.choice.link_layer:
            raise RdmaUnavailable("bad_params", "peer link layer %d, ours %d" % (p.link_layer, self.choice.link_layer))
        self.peer = p
        self._remote = {"ring": (p.ring_addr, p.ring_len, p.ring_rkey),
                        "credit": (p.credit_addr, p.credit_len, p.credit_rkey),
                        "words": (p.words_addr, p.words_len, p.words_rkey)}
        self.path_mtu = min(p.mtu, self.choice.active_mtu)
        gr = GlobalRoute(dgid=GID(_gid_str(p.gid)), sgid_index=self.choice.gid_index, hop_limit=HOP_LIMIT)
        try:
            a = self._attr(e.IBV_QPS_RTR)
            a.path_mtu = self.path_mtu
            a.dest_qp_num = p.qpn
            a.rq_psn = p.psn
            a.max_dest_rd_atomic = 1          # one READ of our counters at a time
            a.min_rnr_timer = MIN_RNR_TIMER
            a.ah_attr = AHAttr(dlid=p.lid, sl=0, is_global=1, port_num=self.choice.port, gr=gr)
            self.qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN |
                           e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
            a = self._attr(e.IBV_QPS_RTS)
            a.timeout = ACK_TIMEOUT
            a.retry_cnt = RETRY_CNT
            a.rnr_retry = RNR_RETRY
            a.sq_psn = self.psn
            a.max_rd_atomic = 1               # we READ the peer's counters, one at a time
            self.qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT |
                           e.IBV_QP_RNR_RETRY | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC)
        except Exception as exc:
            raise RdmaUnavailable("qp_connect_failed", str(exc))

    # ---------------------------------------------------------------- data
    def post_write(self, src_off, length, dst_off, src="source", dst="ring", inline=None,
                   signaled=False, wr_id=0):
        """One RDMA WRITE of `length` bytes from local region `src` at `src_off` to the peer's
        region `dst` ("ring" or "credit") at `dst_off`.  inline=None: inline when length <=
        max_inline.  Only signaled writes produce a completion; an unsignaled WR's send-queue
        slot is reclaimed when a later signaled one completes, so signal at least once every
        sq_depth posts.  Raises RdmaError if the post fails (QP in error, queue full)."""
        s = self._regions[src]
        raddr, rlen, rkey = self._remote[dst]
        if src_off < 0 or dst_off < 0 or length <= 0 or src_off + length > s.length or dst_off + length > rlen:
            raise ValueError("write %d+%d -> %s %d out of bounds" % (src_off, length, dst, dst_off))
        flags = self._F_SIGNALED if signaled else 0
        if inline is None:
            if length <= self.max_inline:
                flags |= self._F_INLINE
        elif inline:
            if length > self.max_inline:
                raise ValueError("%d bytes exceed max_inline_data %d" % (length, self.max_inline))
            flags |= self._F_INLINE
        sge, wr = self._sge, self._wr
        sge.addr = s.addr + src_off
        sge.length = length
        if s.lkey != self._sge_lkey:
            sge.lkey = self._sge_lkey = s.lkey
        wr.wr_id = wr_id
        wr.send_flags = flags
        wr.set_wr_rdma(rkey, raddr + dst_off)
        try:
            self.qp.post_send(wr)
        except Exception as exc:
            raise RdmaError("post_send failed: %s" % exc)

    def poll(self, max_entries=16):
        """Completions now available (possibly none); never blocks."""
        n, wcs = self.cq.poll(num_entries=max_entries)
        return [Completion(w.wr_id, w.status, w.opcode, w.byte_len) for w in wcs[:n]] if n else []

    def wait(self, count=1, timeout=10.0, yield_cpu=True):
        """Poll until `count` completions arrived; raises RdmaError on an error status or
        timeout.  Returns the completions."""
        e = _e()
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            batch = self.poll(count - len(got))
            for c in batch:
                if c.status != e.IBV_WC_SUCCESS:
                    raise RdmaError("completion wr_id=%d status %d (%s)" % (c.wr_id, c.status, wc_status_str(c.status)),
                                    c.status)
            got += batch
            if not batch:
                if time.monotonic() > deadline:
                    raise RdmaError("no completion within %.1f s (%d of %d)" % (timeout, len(got), count))
                if yield_cpu:
                    os.sched_yield()        # rxe does its work in kernel threads: let them run
        return got

    def qp_state(self):
        e = _e()
        return self.qp.query(e.IBV_QP_STATE)[0].qp_state

    def region(self, name):
        return self._regions[name]

    # ---------------------------------------------------------------- C data path
    def native(self):
        """C pointers behind the pyverbs objects, for a C data plane that posts with
        libibverbs directly: {'qp': struct ibv_qp *, 'send_cq': struct ibv_cq *, 'pd': ...,
        'context': ...} as integers, plus the lkeys/rkeys.  Valid until close()."""
        qp = native_qp_pointer(self.qp)
        head = _read_mem(qp, 64)
        ctx, _qpc, pd, scq, rcq = struct.unpack_from("<5Q", head, 0)
        out = {"qp": qp, "context": ctx, "pd": pd, "send_cq": scq, "recv_cq": rcq,
               "qp_num": self.qp.qp_num, "max_inline": self.max_inline}
        for name, r in self._regions.items():
            out[name] = {"addr": r.addr, "length": r.length, "lkey": r.lkey, "rkey": r.rkey}
        return out

    def async_events(self):
        """Pending asynchronous events of this endpoint's device context (never blocks):
        e.g. ["IBV_EVENT_PORT_ERR"].  The context is shared by the process's endpoints on
        that device, so device/port events reach whichever endpoint asks first."""
        import select
        from pyverbs.device import translate_event_type
        fd = self.async_fd()
        out = []
        poller = select.poll()                     # select() cannot take descriptors above 1023
        poller.register(fd, select.POLLIN)
        while poller.poll(0):
            ev = self.ctx.get_async_event()
            out.append(translate_event_type(ev.event_type))
            ev.ack()
        return out

    def async_fd(self):
        """The device context's async event fd (readable when an event is pending)."""
        if getattr(self, "_async_fd", None) is None:
            self._async_fd = context_async_fd(self.native()["context"], self.ctx.cmd_fd)
        return self._async_fd

    # ---------------------------------------------------------------- teardown
    def close(self):
        """Release QP, MRs, CQ and PD (in that order); idempotent."""
        if self.__dict__.get("_released"):
            return
        self._released = self._closed = True
        if getattr(self, "qp", None) is not None:
            _quiet_close(self.qp)
        for r in list(getattr(self, "_regions", {}).values()):
            _quiet_close(r.mr)
        self._regions = {}
        # _wr.sg_list points at _sge's memory: free it once, through _sge only.
        self._wr = None
        for attr in ("_sge", "cq", "pd"):
            obj = getattr(self, attr, None)
            if obj is not None:
                _quiet_close(obj)
                setattr(self, attr, None)
        self.qp = None
        if getattr(self, "ctx", None) is not None:
            self.ctx = None
            _context_done(self.choice.device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _quiet_close(obj):
    try:
        obj.close()
    except Exception:
        pass


WC_STATUS = {0: "success", 1: "local length error", 2: "local QP operation error",
             4: "local protection error", 5: "work request flushed", 6: "memory window bind error",
             9: "remote invalid request", 10: "remote access error", 11: "remote operation error",
             12: "transport retry counter exceeded", 13: "RNR retry counter exceeded",
             21: "fatal error", 22: "response timeout", 23: "general error"}


def wc_status_str(status):
    return WC_STATUS.get(status, "status %d" % status)


# ------------------------------------------------------------------ native pointers
_mem_fd = None


def _read_mem(addr, n):
    """Read n bytes of this process's memory at addr; OSError (EIO) if unmapped, never a crash."""
    global _mem_fd
    if _mem_fd is None:
        _mem_fd = os.open("/proc/self/mem", os.O_RDONLY | os.O_CLOEXEC)
    data = os.pread(_mem_fd, n, addr)
    if len(data) != n:
        raise OSError(errno.EIO, "short read at %#x" % addr)
    return data


def native_qp_pointer(qp):
    """The `struct ibv_qp *` wrapped by a pyverbs QP.

    pyverbs keeps it in a Cython attribute (`cdef v.ibv_qp *qp`) with no Python accessor.
    We look for it among the first pointer-sized fields of the object and accept a candidate
    only if the memory it points to reads as a struct ibv_qp (public ABI of verbs.h: context,
    qp_context, pd, send_cq, recv_cq, srq pointers, then u32 handle, qp_num, state, qp_type)
    whose qp_num and qp_type are this QP's, with non-NULL context, pd and send_cq.  All reads
    go through /proc/self/mem, so a wrong guess cannot crash the process.  Exactly one
    candidate must match."""
    base = id(qp)
    want_num, want_type = qp.qp_num, qp.qp_type
    found = []
    raw = _read_mem(base, 16 + 8 * 12)
    for off in range(16, len(raw), 8):
        (ptr,) = struct.unpack_from("<Q", raw, off)
        if ptr < 4096 or ptr >= 1 << 47 or ptr % 8:
            continue
        try:
            head = _read_mem(ptr, 64)
        except OSError:
            continue
        ctx, _qpc, pd, scq, _rcq, _srq = struct.unpack_from("<6Q", head, 0)
        _handle, qp_num, _state, qp_type = struct.unpack_from("<4I", head, 48)
        if qp_num == want_num and qp_type == want_type and ctx and pd and scq:
            found.append(ptr)
    if len(set(found)) != 1:
        raise RdmaError("cannot locate struct ibv_qp in the pyverbs QP object (%d candidates)" % len(found))
    return found[0]


def context_async_fd(ctx_ptr, cmd_fd):
    """async_fd of a struct ibv_context (verbs.h: ..., int cmd_fd; int async_fd; ...) given
    its address: the int following the one equal to cmd_fd, accepted only if that fd is an
    "anon_inode:[infinibandevent]" of this process."""
    raw = _read_mem(ctx_ptr, 1024)
    for off in range(8, len(raw) - 8, 4):
        a, b = struct.unpack_from("<ii", raw, off)
        if a == cmd_fd and b > 2:
            try:
                if os.readlink("/proc/self/fd/%d" % b) == "anon_inode:[infinibandevent]":
                    return b
            except OSError:
                pass
    raise RdmaError("cannot find the async event fd of the device context")
