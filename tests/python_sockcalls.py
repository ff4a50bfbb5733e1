"""A Python program that uses sockets the way Python programs do, for
tests/test_preload_python.py: run plain and under the preload library, it must behave the
same.  Prints one JSON line of outcomes.

    python_sockcalls.py server     listens, prints "port N", then serves each connection
                                   in a thread of its own, as the client's first line says
    python_sockcalls.py client PORT

Each case has its own connection.  The client writes one line naming the case; the
server then does its part."""
import json
import os
import signal
import socket
import struct
import sys
import threading
import time

DELAY = 0.4


def serve(c):
    c.settimeout(10)
    case = b""
    while not case.endswith(b"\n"):
        b = c.recv(1)
        if not b:
            break
        case += b
    case = case.strip().decode()
    if case == "late_byte":
        time.sleep(DELAY)
        c.sendall(b"L")
    elif case == "silent":
        time.sleep(2 * DELAY)
    elif case == "read_then_close":      # takes a little of a long stream, closes on the rest
        c.recv(1024)
        c.close()
        return case
    elif case == "linger0":
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    time.sleep(0.05)
    c.close()
    return case


def server():
    ls = socket.create_server(("127.0.0.1", 0))
    print("port %d" % ls.getsockname()[1], flush=True)
    ls.settimeout(0.1)
    done, end = [], time.monotonic() + 60
    while not done and time.monotonic() < end:
        try:
            c, _ = ls.accept()
        except OSError:
            continue
        threading.Thread(target=lambda c=c: done.append(1) if serve(c) == "quit" else None).start()


def outcome(fn):
    t0 = time.monotonic()
    try:
        r = fn()
        res = {"result": r if isinstance(r, (int, str)) else repr(r)}
    except OSError as exc:
        res = {"error": type(exc).__name__, "errno": exc.errno}
    res["ms"] = int((time.monotonic() - t0) * 1000)
    return res


def client(port):
    out = {}

    def conn(case):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(case.encode() + b"\n")
        return c

    c = conn("silent")                   # SO_RCVTIMEO on a blocking socket: EAGAIN
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 300000))
    out["so_rcvtimeo"] = outcome(lambda: c.recv(1))
    c.close()

    c = conn("silent")                   # settimeout: TimeoutError
    c.settimeout(0.3)
    out["settimeout"] = outcome(lambda: c.recv(1))
    c.close()

    c = conn("late_byte")                # a signal during a blocking recv: PEP 475 retries
    hits = []
    old = signal.signal(signal.SIGALRM, lambda *a: hits.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    out["signal_retry"] = outcome(lambda: c.recv(1).decode())
    out["signal_retry"]["handler_runs"] = len(hits)
    signal.signal(signal.SIGALRM, old)
    c.close()

    c = conn("linger0")                  # the peer resets
    time.sleep(0.3)
    out["reset"] = outcome(lambda: c.recv(1))
    out["after_reset"] = outcome(lambda: c.recv(1))
    c.close()

    # A writer with a small send buffer (SO_SNDBUF, set after connect as asyncio's tests do)
    # whose peer reads a little and closes: its wait for room ends, and the stream fails,
    # long before 4 MiB are written (over rdmasock: the ring holds no more than the buffer
    # the program sized, and a wait for room wakes when the peer is gone).
    c = conn("read_then_close")
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    c.settimeout(5)
    out["small_sndbuf_peer_closes"] = outcome(lambda: c.sendall(b"x" * (4 << 20)))
    c.close()

    c = conn("late_byte")                # no urgent data pending: EINVAL, and the stream is intact
    time.sleep(2 * DELAY)
    out["recv_oob"] = outcome(lambda: c.recv(1, socket.MSG_OOB))
    out["after_oob"] = outcome(lambda: c.recv(1).decode())
    c.close()

    # socket.setdefaulttimeout() in the program, then a blocking socket (CPython's test_socket
    # NetworkConnectionAttributesTest.testTimeoutNone): connect blocks, the socket stays blocking
    socket.setdefaulttimeout(30)
    try:
        def connect_and_close():
            s = socket.create_connection(("127.0.0.1", port), timeout=None)
            s.close()
            return "connected"
        out["default_timeout_connect"] = outcome(connect_and_close)
    finally:
        socket.setdefaulttimeout(None)
    c = socket.create_connection(("127.0.0.1", port))
    socket.setdefaulttimeout(30)
    try:
        c2 = socket.create_connection(("127.0.0.1", port), timeout=None)
        c2.sendall(b"late_byte\n")
        out["default_timeout_blocking"] = outcome(lambda: "%s %s %s" % (c2.gettimeout(), os.get_blocking(c2.fileno()),
                                                                        c2.recv(1).decode()))
        c2.close()
    finally:
        socket.setdefaulttimeout(None)
    c.close()

    c = conn("quit")
    c.recv(1)                            # until the server closes
    c.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server()
    else:
        client(int(sys.argv[2]))
