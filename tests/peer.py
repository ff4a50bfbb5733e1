"""Peer programs for the tests, run in their own process.

usage: peer.py MODE IMPL [ARGS]   IMPL: rdmasock or plain
  echo-server IMPL         : prints "port N", echoes every connection until EOF (one at a time)
  sink-server IMPL         : prints "port N", reads one connection to EOF, prints "got N sha256"
  source-server IMPL N     : prints "port N", sends N pseudo-random bytes (seed 7) then closes
  stream-client IMPL PORT N: connects, sends N pseudo-random bytes, prints progress lines "sent K"
  hold-client IMPL PORT    : connects, prints "ready", sends nothing, waits (to be killed)
Every line printed also says the transport at the end when known."""
import hashlib
import random
import socket
import sys
import time


def mod(impl):
    if impl == "rdmasock":
        import rdmasock
        return rdmasock
    return socket


def data(n, seed=7):
    return random.Random(seed).randbytes(n)


def say(*a):
    print(*a, flush=True)


def main():
    mode, impl = sys.argv[1], sys.argv[2]
    m = mod(impl)
    if mode.endswith("-server"):
        ls = m.create_server(("127.0.0.1", 0))
        say("port", ls.getsockname()[1])
        while True:
            s, _ = ls.accept()
            if mode == "echo-server":
                while True:
                    d = s.recv(1 << 16)
                    if not d:
                        break
                    s.sendall(d)
                s.close()
                continue
            if mode == "sink-server":
                h, n = hashlib.sha256(), 0
                while True:
                    d = s.recv(1 << 20)
                    if not d:
                        break
                    h.update(d)
                    n += len(d)
                say("got", n, h.hexdigest(), getattr(s, "transport", "tcp"))
                s.close()
                return
            if mode == "source-server":
                n = int(sys.argv[3])
                say("transport", getattr(s, "transport", "tcp"))
                s.sendall(data(n))
                time.sleep(0.2)
                s.close()
                return
    port = int(sys.argv[3])
    s = m.create_connection(("127.0.0.1", port))
    if mode == "stream-client":
        n = int(sys.argv[4])
        blob = data(1 << 20)
        sent = 0
        while sent < n:
            k = min(1 << 16, n - sent)
            off = sent % len(blob)
            s.sendall(blob[off:off + k])
            sent += k
            if sent % (1 << 20) == 0:
                say("sent", sent, getattr(s, "transport", "tcp"))
        s.shutdown(socket.SHUT_WR)
        time.sleep(60)
    elif mode == "hold-client":
        s.sendall(b"hi")
        s.recv(2)                           # echoed: the handshake is over
        say("ready", getattr(s, "transport", "tcp"))
        time.sleep(120)


if __name__ == "__main__":
    main()
