"""Helpers of the RDMA inner tests (run inside the Soft-RoCE VM, or directly on a host with an
RDMA device): registered buffers, the parameter exchange over TCP, and a small test framing
of messages in a ring (length | seq | payload | footer, like the product's wire format)."""
import ctypes
import hashlib
import mmap
import os
import random
import socket
import struct
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from rdmasock import rdma_setup  # noqa: E402


class Buffer:
    """Anonymous shared mapping, zeroed, page aligned: what a ring will be in the product."""

    def __init__(self, size):
        self.size = size
        self.map = mmap.mmap(-1, size)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def u32(self, off):
        return struct.unpack_from("<I", self.map, off)[0]

    def u64(self, off):
        return struct.unpack_from("<Q", self.map, off)[0]


def log(*a):
    print("[%s %d]" % (os.path.basename(sys.argv[0]), os.getpid()), *a, flush=True)


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        d = sock.recv(n - len(buf))
        if not d:
            raise EOFError("peer closed after %d of %d bytes" % (len(buf), n))
        buf += d
    return buf


def listen(host, port):
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, port))
    ls.listen(1)
    return ls


def connect(host, port, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=timeout)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def exchange(ep, sock, server):
    """Swap PARAMS over the TCP socket and bring the QP to RTS.  The acceptor (server)
    answers READY only once its QP is past RTR, so the client's first WRITE is never dropped
    by a QP still in INIT."""
    sock.sendall(ep.local_params())
    peer = recv_exact(sock, rdma_setup.PARAMS_SIZE)
    ep.connect(peer)
    if server:
        sock.sendall(b"R")
    else:
        assert recv_exact(sock, 1) == b"R"
    return peer


# --------------------------------------------------------------------------- test framing
HDR = 8           # u32 length, u32 sequence number
FTR = 4           # u32 footer derived from the sequence number
WRAP = 0xFFFFFFFF


def footer(seq):
    return ((seq * 2654435761) ^ 0x5A17C3E1) & 0xFFFFFFFF | 1


def rec_size(n):
    return (HDR + n + FTR + 7) & ~7


def payload(seq, n):
    rnd = random.Random(seq)
    return rnd.randbytes(n) if n else b""


def sizes(count, seed, max_size):
    """Message sizes: mostly small (inline), some large, a few exactly at boundaries."""
    rnd = random.Random(seed)
    out = []
    for i in range(count):
        r = rnd.random()
        out.append(rnd.randint(1, 120) if r < 0.6 else rnd.randint(121, max_size) if r < 0.95 else
                   rnd.choice([1, 240, 244, 248, max_size]))
    return out


class RingSender:
    """Writes framed messages into the peer's ring with one RDMA WRITE each; waits for credit
    (the consumer's position, written by the peer into our credit word)."""

    def __init__(self, ep, ring_size, src, credit, signal_every=16):
        self.ep, self.size, self.src, self.credit = ep, ring_size, src, credit
        self.tail = 0               # bytes produced (monotonic)
        self.seq = 0
        self.posted = 0
        self.done_upto = 0          # posts known complete
        self.signal_every = signal_every
        self.inline_posts = 0
        self.credit_waits = 0

    def _reap(self, block):
        while True:
            for c in self.ep.poll(8):
                if c.status != 0:
                    raise rdma_setup.RdmaError("write completion status %d (%s)" % (c.status, rdma_setup.wc_status_str(c.status)), c.status)
                self.done_upto = max(self.done_upto, c.wr_id + 1)
            if not block or self.posted - self.done_upto < self.ep.sq_depth - 2:
                return
            os.sched_yield()

    def _space(self, need, timeout=60.0):
        deadline = time.monotonic() + timeout
        while self.tail + need - self.credit.u64(0) > self.size:
            self.credit_waits += 1
            self._reap(False)
            if time.monotonic() > deadline:
                raise TimeoutError("no credit: tail %d credit %d" % (self.tail, self.credit.u64(0)))
            os.sched_yield()

    def _post(self, pos, n):
        signaled = self.posted % self.signal_every == self.signal_every - 1
        if n <= self.ep.max_inline:
            self.inline_posts += 1
        self.ep.post_write(pos, n, pos, signaled=signaled, wr_id=self.posted)
        self.posted += 1
        self._reap(self.posted - self.done_upto >= self.ep.sq_depth - 2)

    def send(self, data):
        n = len(data)
        size = rec_size(n)
        assert size <= self.size // 2
        pos = self.tail % self.size
        if pos + size > self.size:                       # does not fit before the end: wrap marker
            self._space(self.size - pos)
            struct.pack_into("<II", self.src.map, pos, WRAP, footer(self.seq))
            self._post(pos, 8)
            self.tail += self.size - pos
            pos = 0
        self._space(size)
        struct.pack_into("<II", self.src.map, pos, n, self.seq)
        self.src.map[pos + HDR:pos + HDR + n] = data
        struct.pack_into("<I", self.src.map, pos + HDR + n, footer(self.seq))
        self._post(pos, HDR + n + FTR)
        self.tail += size
        self.seq += 1

    def flush(self, timeout=30.0):
        """Make sure every posted WRITE completed (one last signaled zero-effect write is not
        needed: wait for the peer's final credit instead)."""
        deadline = time.monotonic() + timeout
        while self.credit.u64(0) < self.tail:
            self._reap(False)
            if time.monotonic() > deadline:
                raise TimeoutError("final credit %d of %d" % (self.credit.u64(0), self.tail))
            os.sched_yield()


class RingReceiver:
    """Polls the ring for complete records (footer valid), checks, zeroes, returns credit."""

    def __init__(self, ep, ring, credit_src, ring_size):
        self.ep, self.ring, self.csrc, self.size = ep, ring, credit_src, ring_size
        self.head = 0
        self.seq = 0
        self.credited = 0
        self.posted = 0

    def _credit(self, force=False):
        if force or self.head - self.credited >= self.size // 4:
            struct.pack_into("<Q", self.csrc.map, 0, self.head)
            signaled = self.posted % 16 == 15 or force
            self.ep.post_write(0, 8, 0, dst="credit", signaled=signaled, wr_id=self.posted)
            self.posted += 1
            if signaled:
                self.ep.wait(1, timeout=30)
            self.credited = self.head

    def recv(self, timeout=60.0):
        deadline = time.monotonic() + timeout
        m = self.ring.map
        while True:
            pos = self.head % self.size
            n = self.ring.u32(pos)
            if n == WRAP:
                if self.ring.u32(pos + 4) == footer(self.seq):
                    m[pos:self.size] = bytes(self.size - pos)
                    self.head += self.size - pos
                    continue
            elif n:
                if n > self.size - pos - HDR - FTR:
                    raise AssertionError("length %d at %d exceeds the ring" % (n, pos))
                if self.ring.u32(pos + HDR + n) == footer(self.seq):
                    seq = self.ring.u32(pos + 4)
                    if seq != self.seq & 0xFFFFFFFF:
                        raise AssertionError("sequence %d, expected %d" % (seq, self.seq))
                    data = bytes(m[pos + HDR:pos + HDR + n])
                    size = rec_size(n)
                    m[pos:pos + size] = bytes(size)
                    self.head += size
                    self.seq += 1
                    self._credit()
                    return data
            if time.monotonic() > deadline:
                raise TimeoutError("no message %d at ring offset %d (head %d)" % (self.seq, pos, self.head))
            os.sched_yield()


def digest(chunks):
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()
