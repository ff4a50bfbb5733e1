"""Two halves of a test of a client process that dies (tests/test_faults.py).

server N: accepts N connections and echoes on each; prints {"eof": k, "ConnectionResetError": m}
          once every connection has ended.
client PORT N: opens N connections, writes a little on each right after connect (some
          of it before the server answers the handshake), reads the echo, says "ready"
          and waits to be killed."""
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


def client(port, n):
    conns = []
    for i in range(n):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"hi")
        assert c.recv(10) == b"hi"
        conns.append(c)
    print("ready", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]))
    else:
        client(int(sys.argv[2]), int(sys.argv[3]))
