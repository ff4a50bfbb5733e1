"""A hostile peer: connects (or accepts) like a real rdmasock peer, then rewrites every field
of the live shared segment while it sends and receives (tests/test_hostile.py).

    python hostile_peer.py client PORT SECONDS MODE SEED
    python hostile_peer.py server 0 SECONDS MODE SEED     (prints "port N")

MODE: zeros, ones, counters, huge, random, records (records that look valid: right
footers, bogus lengths), or all (each in turn).  The segment is found in this process's
own mappings (/memfd:rdmasock), where the legitimate handshake put it.
"""
import ctypes
import os
import random
import struct
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import rdmasock  # noqa: E402

HDR = 4096
CTL = 64                        # struct rs_dir_ctl pairs start here, 128 bytes each
# (offset, size) of every field in the header page (rs_wire.h)
FIELDS = [(0, 4), (4, 4), (8, 4), (12, 4), (16, 8)]
for d in (0, 1):
    base = CTL + 128 * d
    FIELDS += [(base + o, s) for o, s in ((0, 8), (8, 8), (16, 4), (20, 4), (24, 8),
                                          (64, 8), (72, 8), (80, 4), (84, 4))]


def segments():
    """(address, length) of every rdmasock segment mapped in this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:rdmasock" in line and "rdmasock-stats" not in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                out.append((lo, hi - lo))
    return out


def footer(salt, seq, lw):
    m = (1 << 64) - 1
    x = salt ^ ((seq * 0x9E3779B97F4A7C15) & m) ^ ((lw << 32) | lw)
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & m
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & m
    x ^= x >> 33
    f = (x ^ (x >> 32)) & 0xFFFFFFFF
    return f or 0x5A5A5A5A


class Scribbler(threading.Thread):
    def __init__(self, addr, length, mode, seed):
        super().__init__(daemon=True)
        self.addr, self.length, self.mode = addr, length, mode
        self.rnd = random.Random(seed)
        self.stop = False
        self.writes = 0
        hdr = (ctypes.c_uint8 * HDR).from_address(addr)
        self.ring = struct.unpack_from("<I", bytes(hdr), 8)[0]
        self.salt = struct.unpack_from("<Q", bytes(hdr), 16)[0]
        self.counter = 0

    def value(self, size, mode):
        r = self.rnd
        if mode == "zeros":
            return 0
        if mode == "ones":
            return (1 << (8 * size)) - 1
        if mode == "counters":
            self.counter += r.randint(1, 5000)
            return self.counter & ((1 << (8 * size)) - 1)
        if mode == "huge":
            return r.choice([(1 << (8 * size)) - 1, 1 << (8 * size - 1), self.ring, self.ring * 4 + 1, 0x7FFFFFFF])
        return r.getrandbits(8 * size)

    def poke(self, off, size, v):
        if off + size > self.length:
            return
        if size == 8:
            ctypes.c_uint64.from_address(self.addr + off).value = v
        else:
            ctypes.c_uint32.from_address(self.addr + off).value = v & 0xFFFFFFFF
        self.writes += 1

    def run(self):
        modes = ["zeros", "ones", "counters", "huge", "random", "records"]
        i = 0
        while not self.stop:
            mode = modes[(i // 2000) % len(modes)] if self.mode == "all" else self.mode
            i += 1
            r = self.rnd
            what = r.random()
            if what < 0.4:                                   # a header or control word
                off, size = r.choice(FIELDS)
                self.poke(off, size, self.value(size, mode))
            elif mode == "records":                          # valid-looking records, bogus lengths
                ring0 = HDR + r.choice((0, self.ring))
                off = r.randrange(0, self.ring, 8)
                lw = r.choice([self.ring, self.ring * 2, 0xFFFFFF42, 1 << 31, self.ring // 4 - 7,
                               self.ring - off, 0xFFFFFFFD, 0xFFFFFFFF])
                self.poke(ring0 + off, 4, lw)
                rec = 8 if lw >= 0xFFFFFF00 else ((lw + 15) & ~7)
                foff = ring0 + off + rec - 4
                if HDR <= foff < self.length - 4:
                    self.poke(foff, 4, footer(self.salt, r.randrange(0, 1 << 20), lw))
            else:                                            # anywhere in the rings
                off = HDR + r.randrange(0, 2 * self.ring - 8, 4)
                self.poke(off, r.choice((4, 8)), self.value(8, mode))
            if i % 64 == 0:
                time.sleep(0.0002)


def session(sock, seconds, mode, seed):
    """Talk and scribble for `seconds`.  Returns what happened, for the log."""
    settle = time.monotonic() + 3                    # the handshake's answer may be on its way
    while sock.transport == "tcp" and sock.fallback_reason is None and time.monotonic() < settle:
        time.sleep(0.005)
    segs = segments()
    if sock.transport != "shm" or not segs:
        return "not upgraded (%s, %s)" % (sock.transport, sock.fallback_reason)
    addr, length = segs[-1]
    sc = Scribbler(addr, length, mode, seed)
    sc.start()
    sock.setblocking(False)
    end = time.monotonic() + seconds
    out = "ran"
    try:
        while time.monotonic() < end:
            try:
                sock.send(os.urandom(random.randint(1, 70000)))
            except (BlockingIOError, InterruptedError):
                pass
            try:
                sock.recv(1 << 17)
            except (BlockingIOError, InterruptedError):
                pass
            time.sleep(0.0005)
    except OSError as exc:
        out = "error %s" % exc.errno
    sc.stop = True
    sc.join(5)
    return "%s, %d writes" % (out, sc.writes)


def main():
    role, port, seconds, mode, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    end = time.monotonic() + seconds
    n = 0
    if role == "server":
        srv = rdmasock.create_server(("127.0.0.1", port))
        print("port %d" % srv.getsockname()[1], flush=True)
        srv.settimeout(1)
    while time.monotonic() < end:
        try:
            if role == "server":
                sock, _ = srv.accept()
            else:
                sock = rdmasock.create_connection(("127.0.0.1", port), timeout=2)
        except OSError:
            time.sleep(0.05)
            continue
        n += 1
        res = session(sock, min(1.5, max(0.1, end - time.monotonic())), mode, seed + n)
        print("session %d: %s" % (n, res), flush=True)
        try:
            sock.close()
        except OSError:
            pass


if __name__ == "__main__":
    main()
