"""A server that waits for readability after its peer died, for tests/test_faults.py.

server HOW: prints "port N", accepts one connection, reads "hello", answers "ok", prints
            "served"; after a line on stdin (the test killed the client) waits for input
            (HOW: poll, select or epoll, level-triggered, 10 s at most), reads, and prints
            what it saw as JSON: {"readable": bool, "read": n or error name}.
client PORT: connects, sends "hello", reads "ok", prints "ready", then sleeps (to be killed)."""
import json
import select
import socket
import sys
import time


def wait_readable(c, how):
    if how == "poll":
        p = select.poll()
        p.register(c, select.POLLIN)
        return any(ev & select.POLLIN for _, ev in p.poll(10000))
    if how == "select":
        return bool(select.select([c], [], [], 10)[0])
    ep = select.epoll()
    ep.register(c.fileno(), select.EPOLLIN)
    try:
        return any(ev & select.EPOLLIN for _, ev in ep.poll(10))
    finally:
        ep.close()


def server(how):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    print("port", s.getsockname()[1], flush=True)
    c, _ = s.accept()
    got = b""
    while len(got) < 5:
        got += c.recv(5 - len(got))
    c.sendall(b"ok")
    print("served", flush=True)
    sys.stdin.readline()                    # the test killed the client
    readable = wait_readable(c, how)
    try:
        r = len(c.recv(100))
    except OSError as e:
        r = type(e).__name__
    print(json.dumps({"readable": readable, "read": r}), flush=True)


def client(port):
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(b"hello")
    got = b""
    while len(got) < 2:
        got += c.recv(2 - len(got))
    print("ready", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(sys.argv[2])
    else:
        client(int(sys.argv[2]))
