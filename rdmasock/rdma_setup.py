"""Control plane of one RDMA connection (RC queue pair), see docs/RDMA.md.

pyverbs chooses the device, port and GID (rdmasock/devices.py); the verbs objects
themselves (PD, CQ, QP, memory regions) are made in C through libibverbs' public API
(shim/rs_verbs.c), so the queue pair the data path posts on is one C created, whatever the
installed pyverbs looks like inside.  One `Endpoint` per connection and side:

    ep = Endpoint()                                   # device per devices.choose(), own PD, CQ, RC QP (INIT)
    ep.register_ring(addr, length)                    # receive ring: LOCAL_WRITE | REMOTE_WRITE
    ep.register_credit(addr, 8)                       # credit word the peer writes: same access
    ep.register_source(addr, length)                  # local buffer RDMA WRITEs are sent from
    tcp.sendall(ep.local_params()); ep.connect(recv_exact(tcp, PARAMS_SIZE))   # INIT->RTR->RTS
    ep.post_write(src_off, n, dst_off, signaled=...)  # one RDMA WRITE, inline when n fits
    ep.poll()                                         # [Completion], never blocks

Memory is the caller's (e.g. an mmap'd ring): it is registered, never allocated or freed here,
and must stay mapped until close().  pyverbs is imported lazily.

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
import struct
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
QPS_RTS, QPS_ERR = 3, 6              # enum ibv_qp_state


class RdmaError(Exception):
    """A verbs failure on an established endpoint (post, poll, completion with error)."""

    def __init__(self, msg, status=None):
        super().__init__(msg)
        self.status = status


def _native():
    from ._native import ffi, lib
    return ffi, lib


def _err_buf(ffi):
    return ffi.new("char[200]")


class _Region:
    __slots__ = ("name", "addr", "length", "lkey", "rkey")

    def __init__(self, name, addr, length, lkey, rkey):
        self.name, self.addr, self.length, self.lkey, self.rkey = name, addr, length, lkey, rkey


class Endpoint:
    """One side of one RC connection: its own protection domain, CQ and QP (shim/rs_verbs.c)."""

    def __init__(self, device=None, port=None, gid_index=None, sq_depth=DEFAULT_SQ_DEPTH,
                 rq_depth=DEFAULT_RQ_DEPTH, max_inline=None, env=None):
        env = os.environ if env is None else env
        self.choice = devices.choose(device, port, gid_index, env=env)
        ffi, lib = self._ffi, self._lib = _native()
        self._v = None
        self._regions = {}
        self.peer = None
        self.psn = int.from_bytes(os.urandom(3), "little")
        self.sq_depth = sq_depth
        want_inline = max_inline if max_inline is not None else int(config.value(env, "RDMA_INLINE"))
        err = _err_buf(ffi)
        v = lib.rs_verbs_open(self.choice.device.encode(), self.choice.port, sq_depth, rq_depth,
                              max(0, want_inline), err, len(err))
        if v == ffi.NULL:
            raise RdmaUnavailable("verbs_setup_failed", ffi.string(err).decode(errors="replace"))
        self._v = v
        self.qp_num = lib.rs_verbs_qp_num(v)
        self.max_inline = lib.rs_verbs_max_inline(v)
        self._wc = ffi.new("struct rs_verbs_wc[16]")

    def _live(self):
        if self._v is None:
            raise RdmaError("endpoint closed")
        return self._v

    # ---------------------------------------------------------------- set-up
    def _register(self, name, addr, length, access):
        v = self._live()
        if name in self._regions:
            raise ValueError("%s already registered" % name)
        if not addr or length <= 0:
            raise ValueError("bad %s region %#x+%d" % (name, addr or 0, length))
        ffi, lib = self._ffi, self._lib
        keys = ffi.new("uint32_t[2]")
        rc = lib.rs_verbs_reg(v, ffi.cast("void *", addr), length, access, keys, keys + 1)
        if rc in (-errno.ENOMEM, -errno.EPERM, -errno.EAGAIN):
            ml = devices.memlock_limit()
            raise RdmaUnavailable("memlock", "registering %d bytes failed (%s); memlock limit %s"
                                  % (length, os.strerror(-rc), ml["soft"]))
        if rc < 0:
            raise RdmaUnavailable("verbs_setup_failed", "registering %s: %s" % (name, os.strerror(-rc)))
        reg = self._regions[name] = _Region(name, addr, length, keys[0], keys[1])
        return reg

    def register_ring(self, addr, length):
        """The receive ring the peer writes into: LOCAL_WRITE | REMOTE_WRITE (verbs requires
        LOCAL_WRITE with REMOTE_WRITE), never relaxed ordering, no remote read or atomics."""
        lib = self._lib
        return self._register("ring", addr, length, lib.RS_VERBS_LOCAL_WRITE | lib.RS_VERBS_REMOTE_WRITE)

    def register_credit(self, addr, length=8):
        """The credit word(s) the peer's consumer writes into; same access as the ring."""
        lib = self._lib
        return self._register("credit", addr, length, lib.RS_VERBS_LOCAL_WRITE | lib.RS_VERBS_REMOTE_WRITE)

    def register_words(self, addr, length):
        """This side's own counters, which the peer may RDMA READ (and nothing else)."""
        return self._register("words", addr, length, self._lib.RS_VERBS_REMOTE_READ)

    def register_local(self, name, addr, length):
        """A local buffer RDMA READ responses land in (no remote access)."""
        return self._register(name, addr, length, self._lib.RS_VERBS_LOCAL_WRITE)

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
                           self.qp_num, self.psn, ring.rkey if ring else 0, bytes(c.gid),
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
        v = self._live()
        ffi, lib = self._ffi, self._lib
        p = self.parse_params(bytes(peer_params))
        if p.link_layer != self.choice.link_layer:
            raise RdmaUnavailable("bad_params", "peer link layer %d, ours %d" % (p.link_layer, self.choice.link_layer))
        self.peer = p
        self._remote = {"ring": (p.ring_addr, p.ring_len, p.ring_rkey),
                        "credit": (p.credit_addr, p.credit_len, p.credit_rkey),
                        "words": (p.words_addr, p.words_len, p.words_rkey)}
        self.path_mtu = min(p.mtu, self.choice.active_mtu)
        path = ffi.new("struct rs_verbs_path *")
        path.dest_qpn, path.rq_psn, path.sq_psn = p.qpn, p.psn, self.psn
        path.dlid, path.path_mtu, path.sgid_index = p.lid, self.path_mtu, self.choice.gid_index
        path.dgid = bytes(p.gid)
        err = _err_buf(ffi)
        if lib.rs_verbs_connect(v, path, err, len(err)) < 0:
            raise RdmaUnavailable("qp_connect_failed", ffi.string(err).decode(errors="replace"))

    # ---------------------------------------------------------------- data (tests, probes)
    def post_write(self, src_off, length, dst_off, src="source", dst="ring", inline=None,
                   signaled=False, wr_id=0):
        """One RDMA WRITE of `length` bytes from local region `src` at `src_off` to the peer's
        region `dst` ("ring" or "credit") at `dst_off`.  inline=None: inline when length <=
        max_inline.  Only signaled writes produce a completion; an unsignaled WR's send-queue
        slot is reclaimed when a later signaled one completes, so signal at least once every
        sq_depth posts.  Raises RdmaError if the post fails (QP in error, queue full)."""
        v = self._live()
        lib = self._lib
        s = self._regions[src]
        raddr, rlen, rkey = self._remote[dst]
        if src_off < 0 or dst_off < 0 or length <= 0 or src_off + length > s.length or dst_off + length > rlen:
            raise ValueError("write %d+%d -> %s %d out of bounds" % (src_off, length, dst, dst_off))
        flags = lib.RS_VERBS_SIGNALED if signaled else 0
        if inline is None:
            if length <= self.max_inline:
                flags |= lib.RS_VERBS_INLINE
        elif inline:
            if length > self.max_inline:
                raise ValueError("%d bytes exceed max_inline_data %d" % (length, self.max_inline))
            flags |= lib.RS_VERBS_INLINE
        rc = lib.rs_verbs_post_write(v, s.addr + src_off, length, s.lkey, raddr + dst_off, rkey, flags, wr_id)
        if rc < 0:
            raise RdmaError("post_send failed: %s" % os.strerror(-rc))

    def poll(self, max_entries=16):
        """Completions now available (possibly none); never blocks."""
        n = self._lib.rs_verbs_poll(self._live(), self._wc, min(16, max_entries))
        if n < 0:
            raise RdmaError("completion queue failed: %s" % os.strerror(-n))
        return [Completion(w.wr_id, w.status, w.opcode, w.byte_len) for w in self._wc[0:n]]

    def wait(self, count=1, timeout=10.0, yield_cpu=True):
        """Poll until `count` completions arrived; raises RdmaError on an error status or
        timeout.  Returns the completions."""
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            batch = self.poll(count - len(got))
            for c in batch:
                if c.status != 0:
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
        """enum ibv_qp_state (QPS_RTS 3, QPS_ERR 6)."""
        return self._lib.rs_verbs_qp_state(self._live())

    def qp_access_flags(self):
        return self._lib.rs_verbs_qp_access(self._live())

    def force_error(self):
        """Moves the QP to the error state (fault injection)."""
        rc = self._lib.rs_verbs_qp_error(self._live())
        if rc < 0:
            raise RdmaError("cannot move the QP to the error state: %s" % os.strerror(-rc))

    def region(self, name):
        return self._regions[name]

    def fill_params(self, p):
        """The C connection's struct rs_rdma_params: our QP, CQ and inline size."""
        self._lib.rs_verbs_params(self._live(), p)

    def native(self):
        """{'qp': struct ibv_qp *, 'send_cq': struct ibv_cq *, 'qp_num', 'max_inline'} as
        integers, plus each region's addr/length/lkey/rkey: for C code that posts on this
        endpoint.  Valid until close()."""
        ffi = self._ffi
        p = ffi.new("struct rs_rdma_params *")
        self.fill_params(p)
        out = {"qp": int(ffi.cast("uintptr_t", p.qp)), "send_cq": int(ffi.cast("uintptr_t", p.cq)),
               "qp_num": self.qp_num, "max_inline": self.max_inline}
        for name, r in self._regions.items():
            out[name] = {"addr": r.addr, "length": r.length, "lkey": r.lkey, "rkey": r.rkey}
        return out

    def port_state(self):
        """enum ibv_port_state of our port (4: active), or -errno."""
        return self._lib.rs_verbs_port_state(self._live())

    def async_fd(self):
        """The device context's async event fd (readable when an event is pending)."""
        return self._lib.rs_verbs_async_fd(self._live())

    def async_events(self):
        """Pending asynchronous events of this endpoint's device context (never blocks):
        e.g. ["IBV_EVENT_PORT_ERR"].  The context is shared by the process's endpoints on
        that device, so device/port events reach whichever endpoint asks first."""
        from pyverbs.device import translate_event_type
        out = []
        for _ in range(64):
            ev = self._lib.rs_verbs_async_event(self._live())
            if ev < 0:
                break
            out.append(translate_event_type(ev))
        return out

    # ---------------------------------------------------------------- teardown
    def close(self):
        """Release QP, MRs, CQ and PD (in that order); idempotent."""
        v, self._v = self.__dict__.get("_v"), None
        if v is not None:
            self._lib.rs_verbs_close(v)
        self._regions = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


WC_STATUS = {0: "success", 1: "local length error", 2: "local QP operation error",
             4: "local protection error", 5: "work request flushed", 6: "memory window bind error",
             9: "remote invalid request", 10: "remote access error", 11: "remote operation error",
             12: "transport retry counter exceeded", 13: "RNR retry counter exceeded",
             21: "fatal error", 22: "response timeout", 23: "general error"}


def wc_status_str(status):
    return WC_STATUS.get(status, "status %d" % status)
