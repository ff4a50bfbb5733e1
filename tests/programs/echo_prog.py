"""A threaded TCP echo server and client, stdlib only: the "many concurrent connections"
program of tests/programs.  Run it with Debian's /usr/bin/python3 (3.11.2), the interpreter
the preload library is built against; a Python of another version is not expected to be
accelerated (the library must keep it on plain TCP).

  echo_prog.py server                      prints "port N", echoes every connection until EOF
  echo_prog.py client PORT N SIZE          opens N connections, keeps all N open at once, then
                                           each (own thread) sends SIZE bytes derived from its
                                           index in chunks and checks the echo byte for byte,
                                           half-closes and expects EOF.  Prints one JSON line;
                                           exit 0 iff all N verified.
  echo_prog.py stream PORT N               N connections echoing forever; prints "streaming"
                                           once all carry data; when the server dies each must
                                           see EOF or an error.  Prints JSON; exit 0 iff all N
                                           ended that way within the socket timeout.
"""
import hashlib
import json
import socket
import sys
import threading
import time

CHUNK = 16 * 1024


def payload(i, size):
    out = bytearray()
    ctr = 0
    while len(out) < size:
        out += hashlib.sha256(b"%d:%d" % (i, ctr)).digest()
        ctr += 1
    return bytes(out[:size])


def serve():
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", 0))
    ls.listen(1024)
    print("port %d" % ls.getsockname()[1], flush=True)

    def handle(c):
        try:
            while True:
                d = c.recv(65536)
                if not d:
                    break
                c.sendall(d)
        except OSError:
            pass
        finally:
            c.close()

    while True:
        c, _ = ls.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()


def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        d = s.recv(n - len(buf))
        if not d:
            raise EOFError("EOF after %d of %d bytes" % (len(buf), n))
        buf += d
    return bytes(buf)


def client(port, n, size, timeout=60.0):
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        socks.append(s)
    barrier = threading.Barrier(n, timeout=timeout)
    results = [None] * n
    concurrent = [0]
    peak = [0]
    lock = threading.Lock()

    def work(i):
        s = socks[i]
        try:
            data = payload(i, size)
            barrier.wait()
            with lock:
                concurrent[0] += 1
                peak[0] = max(peak[0], concurrent[0])
            got = bytearray()
            for off in range(0, size, CHUNK):
                part = data[off:off + CHUNK]
                s.sendall(part)
                got += recv_exact(s, len(part))
            s.shutdown(socket.SHUT_WR)
            tail = s.recv(1)
            if tail:
                raise ValueError("extra byte after the echo: %r" % tail)
            results[i] = "ok" if bytes(got) == data else "mismatch"
        except Exception as exc:            # reported, not raised: every connection is accounted for
            results[i] = "error: %r" % (exc,)
        finally:
            with lock:
                concurrent[0] -= 1
            s.close()

    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout * 2)
    ok = sum(1 for r in results if r == "ok")
    bad = {i: r for i, r in enumerate(results) if r != "ok"}
    print(json.dumps({"n": n, "ok": ok, "peak_concurrent": peak[0], "failed": dict(list(bad.items())[:10])}),
          flush=True)
    return 0 if ok == n else 1


def stream(port, n, timeout=30.0):
    socks = [socket.create_connection(("127.0.0.1", port), timeout=timeout) for _ in range(n)]
    started = threading.Barrier(n + 1, timeout=timeout)
    ends = [None] * n

    def work(i):
        s = socks[i]
        data = payload(i, CHUNK)
        first = True
        try:
            while True:
                s.sendall(data)
                got = recv_exact(s, len(data))
                if got != data:
                    ends[i] = "mismatch"
                    return
                if first:
                    first = False
                    started.wait()
        except (EOFError, ConnectionError, BrokenPipeError) as exc:
            ends[i] = "eof" if isinstance(exc, EOFError) else "error"
        except socket.timeout:
            ends[i] = "timeout"
        except threading.BrokenBarrierError:
            ends[i] = "barrier"
        except OSError:
            ends[i] = "error"
        finally:
            s.close()

    ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    for t in ts:
        t.start()
    try:
        started.wait()
        print("streaming", flush=True)
    except threading.BrokenBarrierError:
        print("not all connections started streaming", flush=True)
    t0 = time.monotonic()
    for t in ts:
        t.join(timeout + 5)
    kinds = {}
    for e in ends:
        kinds[str(e)] = kinds.get(str(e), 0) + 1
    print(json.dumps({"n": n, "ends": kinds, "seconds": round(time.monotonic() - t0, 3)}), flush=True)
    return 0 if kinds.get("eof", 0) + kinds.get("error", 0) == n else 1


def main(argv):
    if argv[1] == "server":
        serve()
    elif argv[1] == "client":
        return client(int(argv[2]), int(argv[3]), int(argv[4]))
    elif argv[1] == "stream":
        return stream(int(argv[2]), int(argv[3]))
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
