"""A server that pushes 8 MiB through a level-triggered poll() loop to a client that
stays quiet for a second after its handshake (tests/test_preload_misc.py).

server: prints "port N"; for its one connection, reads the client's first byte, then
        writes 8 MiB without blocking, each write after poll() said POLLOUT; prints
        {"spurious": writes that found no room, "sent": bytes}.
client PORT: connects, writes one byte at once (it travels before the handshake's
        answer), polls a moment (which settles the handshake), sleeps 1 s, reads all,
        prints the SHA-256 of what it read."""
import hashlib
import json
import select
import socket
import sys
import time

TOTAL = 8 << 20


def payload():
    return hashlib.sha256(b"seed").digest() * (TOTAL // 32)


def server():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    print("port", s.getsockname()[1], flush=True)
    c, _ = s.accept()
    assert c.recv(1) == b"x"
    c.setblocking(False)
    data, sent, spurious = memoryview(payload()), 0, 0
    p = select.poll()
    p.register(c, select.POLLOUT)
    deadline = time.monotonic() + 60
    while sent < TOTAL and time.monotonic() < deadline:
        if not p.poll(2000):
            continue
        try:
            sent += c.send(data[sent:sent + 65536])
        except BlockingIOError:
            spurious += 1
    c.close()
    print(json.dumps({"spurious": spurious, "sent": sent}), flush=True)


def client(port):
    c = socket.create_connection(("127.0.0.1", int(port)))
    c.sendall(b"x")
    select.select([c], [], [], 0.2)
    time.sleep(1)
    h, got = hashlib.sha256(), 0
    while True:
        d = c.recv(1 << 20)
        if not d:
            break
        h.update(d)
        got += len(d)
    print(got, h.hexdigest(), flush=True)


if __name__ == "__main__":
    server() if sys.argv[1] == "server" else client(sys.argv[2])
