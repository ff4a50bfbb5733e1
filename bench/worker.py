"""One endpoint of the Python API ping-pong, run as its own (pinned) process by bench/pingpong.py.

usage: worker.py server IMPL PORTFILE          (serves one connection, any test)
       worker.py client IMPL PORT TEST SIZE N  (prints one JSON line)
IMPL is tcp (socket.socket) or rdmasock (rdmasock.socket)."""
import json
import os
import socket
import sys
import time


def sockmod(impl):
    if impl == "rdmasock":
        import rdmasock
        return rdmasock
    return socket


def recv_exact(s, view):
    got = 0
    n = len(view)
    while got < n:
        r = s.recv_into(view[got:], n - got)
        if r == 0:
            raise EOFError
        got += r


def serve(impl, portfile):
    mod = sockmod(impl)
    ls = mod.create_server(("127.0.0.1", 0))
    tmp = portfile + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(ls.getsockname()[1]))
    os.rename(tmp, portfile)
    s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = bytearray(16)
    hv = memoryview(hdr)
    while True:
        try:
            recv_exact(s, hv)
        except EOFError:
            break
        test, size, n = hdr[0], int.from_bytes(hdr[1:8], "little"), int.from_bytes(hdr[8:16], "little")
        buf = bytearray(max(size, 1))
        view = memoryview(buf)
        if test == 1:                       # ping-pong
            for _ in range(n):
                recv_exact(s, view[:size])
                s.sendall(view[:size])
        else:                               # stream: n writes of size bytes, then a 1-byte ack
            total = size * n
            big = bytearray(1 << 20)
            bv = memoryview(big)
            while total > 0:
                r = s.recv_into(bv, min(total, len(big)))
                if r == 0:
                    raise EOFError
                total -= r
            s.sendall(b"k")
    s.close()


def client(impl, port, test, size, n):
    mod = sockmod(impl)
    s = mod.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport = getattr(s, "transport", "tcp")
    code = 1 if test == "pingpong" else 2

    def run(count):
        s.sendall(bytes([code]) + size.to_bytes(7, "little") + count.to_bytes(8, "little"))
        buf = bytearray(size)
        view = memoryview(buf)
        t0 = time.perf_counter()
        if code == 1:
            for _ in range(count):
                s.sendall(view)
                recv_exact(s, view)
        else:
            for _ in range(count):
                s.sendall(view)
            ack = bytearray(1)
            recv_exact(s, memoryview(ack))
        return time.perf_counter() - t0

    run(max(10, n // 10))                   # warm-up
    dt = run(n)
    transport = getattr(s, "transport", "tcp")
    s.close()
    rate = n / dt
    print(json.dumps({"test": test, "impl": impl, "transport": transport, "size": size, "n": n,
                      "seconds": dt, "ops_per_s": rate, "mb_per_s": rate * size / 1e6}))


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve(sys.argv[2], sys.argv[3])
    else:
        client(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
