"""An edge-triggered epoll writer against a reader that takes nothing for a second
(tests/test_preload_misc.py).

server: prints its port; for its one connection, exchanges a byte each way (the handshake
        is then over), reads nothing for 1 s, then reads TOTAL bytes; prints
        "got N OK|BAD".
client PORT: the same byte exchange, then TOTAL bytes from a non-blocking socket, writing
        until EAGAIN and then waiting for EPOLLOUT|EPOLLET (5 s at most per wait); prints
        "sent N waits W"."""
import hashlib
import select
import socket
import sys
import time

TOTAL = 8 << 20
DATA = hashlib.sha256(b"et").digest() * (TOTAL // 32)


def server():
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    print(ls.getsockname()[1], flush=True)
    c, _ = ls.accept()
    c.settimeout(60)
    assert c.recv(1) == b"x"
    c.sendall(b"y")
    time.sleep(1.0)
    got = bytearray()
    while len(got) < TOTAL:
        d = c.recv(1 << 20)
        if not d:
            break
        got += d
    print("got %d %s" % (len(got), "OK" if bytes(got) == DATA else "BAD"), flush=True)


def client(port):
    c = socket.create_connection(("127.0.0.1", port), timeout=60)
    c.sendall(b"x")
    assert c.recv(1) == b"y"
    c.setblocking(False)
    ep = select.epoll()
    ep.register(c.fileno(), select.EPOLLOUT | select.EPOLLET)
    sent = waits = 0
    end = time.monotonic() + 30
    while sent < TOTAL and time.monotonic() < end:
        try:
            while sent < TOTAL:
                sent += c.send(DATA[sent:sent + 65536])
        except BlockingIOError:
            waits += 1
            if not ep.poll(5):
                break                      # a lost wake-up: reported by the count below
    print("sent %d waits %d" % (sent, waits), flush=True)
    time.sleep(2)                          # the reader takes the rest before the close


if __name__ == "__main__":
    server() if sys.argv[1] == "server" else client(int(sys.argv[2]))
