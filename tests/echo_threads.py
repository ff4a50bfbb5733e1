"""A threaded echo server and a threaded client, for tests of a whole process under the
preload (tests/test_faults.py, tests/test_preload_misc.py).

server N: accepts N connections, echoes on each in a thread of its own; once every
          connection has ended prints how they ended, e.g. {"eof": N}.
client PORT N [wait]: N threads connect at the same moment (the first of them loads the
          engine), each writes a little right after its connect (some of it before the
          server answers the handshake) and reads the echo; prints "ready", then waits
          (to be killed) or closes and exits."""
import collections
import json
import socket
import sys
import threading
import time


def server(n):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(n)
    print("port", s.getsockname()[1], flush=True)
    ends, lock = collections.Counter(), threading.Lock()

    def serve(c):
        try:
            while True:
                d = c.recv(100)
                if not d:
                    end = "eof"
                    break
                c.sendall(d)
        except OSError as e:
            end = type(e).__name__
        with lock:
            ends[end] += 1

    threads = []
    for _ in range(n):
        c, _ = s.accept()
        threads.append(threading.Thread(target=serve, args=(c,)))
        threads[-1].start()
    for t in threads:
        t.join()                           # bounded by the test, which kills this process
    print(json.dumps(dict(ends)), flush=True)


def client(port, n, wait):
    start = threading.Barrier(n)
    conns, errors = [], []

    def one(i):
        try:
            start.wait(30)
            c = socket.create_connection(("127.0.0.1", port))
            msg = b"hi %d" % i
            c.sendall(msg)
            assert c.recv(100) == msg
            conns.append(c)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    print("ready" if not errors else "errors %s" % errors[:3], flush=True)
    if wait:
        time.sleep(120)
    for c in conns:
        c.close()


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]))
    else:
        client(int(sys.argv[2]), int(sys.argv[3]), len(sys.argv) > 4)
