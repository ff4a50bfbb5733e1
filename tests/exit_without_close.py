"""A server that answers and ends its process without closing the connection, as many
programs do, or answers from a forked child, for tests/test_faults.py.

server HOW SIZE: prints "port N", accepts one connection, reads "go\\n" (sleeping for it,
                 so the client's doorbell is rung), writes SIZE bytes (more than a ring
                 holds: the rest goes out as the client reads, or spills), then ends with
                 the socket still open: HOW is "exit" (sys.exit), "_exit" (os._exit) or
                 "kill" (SIGKILL to itself: none of its code runs after); or HOW "close"
                 closes it, then exits.
                 HOW "fork-close" or "fork-exit": a forking server.  After "go\\n" it
                 forks and closes its copy; the child writes SIZE bytes, waits in select
                 for "bye\\n" (which rings a doorbell that its read leaves) and reads it,
                 then closes the socket and exits, or exits (os._exit) with it open.
                 HOW "fork-late": the child writes SIZE bytes and exits; the parent waits
                 for it, then closes its copy, last, with a view of the ring from before
                 the child wrote.
                 HOW "fork-killed": after "go\\n" it forks a child that SIGKILLs itself
                 (it never gives its share of the socket back), reaps it, then answers as
                 the child of fork-close does.
client PORT SLEEP [bye|early]: connects, waits a moment, sends "go\\n" (and 0.3 s later
                 "bye\\n"; "early": at once, before the handshake has ended, so that the
                 client's SWITCH is due at its next call), sleeps SLEEP seconds before its
                 first read (the server's writes pile up), reads to the end of the stream,
                 prints {"bytes": n, "sha256": hex} or {"error": name, ...} as JSON."""
import hashlib
import json
import os
import select
import signal
import socket
import sys
import time


def pattern(size):
    block = hashlib.sha256(b"exit").digest() * 2048
    return (block * (size // len(block) + 1))[:size]


def server(how, size):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    print("port", s.getsockname()[1], flush=True)
    c, _ = s.accept()
    got = b""
    while not got.endswith(b"\n"):
        got += c.recv(10)
    if how.startswith("fork-"):
        answer_from_child(s, c, how, size)
    c.sendall(pattern(size))
    if how == "close":
        c.close()
        sys.exit(0)
    fd = c.detach()                     # Python's finalization must not close it for us
    assert fd >= 0
    if how == "_exit":
        os._exit(0)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)


def answer_from_child(listener, c, how, size):
    pid = os.fork()
    if how == "fork-killed":
        if not pid:
            os.kill(os.getpid(), signal.SIGKILL)
        os.waitpid(pid, 0)
        pid = 0                         # this process answers
    if pid:
        if how != "fork-late":
            c.close()                   # the child holds the connection now
        _, status = os.waitpid(pid, 0)
        if how == "fork-late":
            c.close()                   # last, with a view of the ring from before the child wrote
        os._exit(os.waitstatus_to_exitcode(status))
    listener.close()
    c.sendall(pattern(size))
    if how == "fork-late":
        os._exit(0)
    got = b""
    while not got.endswith(b"\n"):
        select.select([c], [], [], 30)
        got += c.recv(10)
    if how != "fork-exit":
        c.close()
    os._exit(0)


def client(port, sleep, opt):
    c = socket.create_connection(("127.0.0.1", port))
    if opt != "early":
        time.sleep(0.3)                 # the server sleeps in its recv: "go" rings a doorbell
    c.sendall(b"go\n")
    if opt == "bye":
        time.sleep(0.3)
        c.sendall(b"bye\n")
    time.sleep(sleep)
    h, n = hashlib.sha256(), 0
    try:
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            h.update(b)
            n += len(b)
    except OSError as e:
        print(json.dumps({"error": type(e).__name__, "errno": e.errno, "bytes": n}), flush=True)
        return
    print(json.dumps({"bytes": n, "sha256": h.hexdigest()}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(sys.argv[2], int(sys.argv[3]))
    else:
        client(int(sys.argv[2]), float(sys.argv[3]), (sys.argv[4:] or [""])[0])
