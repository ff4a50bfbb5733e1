"""Write-before-read traffic: the programs of tests/test_bulk_flow.py.

Each role runs with plain sockets ("plain", or under the preload library when started by
`rdmasock run --`) or with rdmasock.socket ("api").

  bulk_echo.py server MODE                 prints "port N"; echoes every connection: reads
                                           a chunk, sends it back whole, until EOF
  bulk_echo.py proxy MODE UPSTREAM         prints "port N"; relays each connection to
                                           UPSTREAM, both directions at once (a thread each,
                                           blocking sendall: the proxy stops reading one
                                           side while the other does not take its bytes)
  bulk_echo.py away MODE SECONDS           prints "port N"; an echo server that greets
                                           each client with "!", then stays away from its
                                           sockets SECONDS (as a program that computes or
                                           sleeps): the client's bytes must be taken in
                                           meanwhile, as TCP's kernel does
  bulk_echo.py late MODE SIZE SECONDS     prints "port N"; each connection: waits SECONDS
                                           without reading, writes SIZE bytes, then reads to
                                           the end and answers with the SHA-256 of what it
                                           read (a server that talks before it listens,
                                           while its client still writes)
  bulk_echo.py client MODE PORT SIZE [duplex|away|late SIZE2|qp_error]
                                           writes SIZE bytes before reading anything, then
                                           reads the echo and checks it byte for byte (duplex:
                                           a second thread reads while the first writes;
                                           away: reads the greeting first, so an upgraded
                                           connection is on its ring before it writes;
                                           late: expects the late server's SIZE2 bytes and
                                           the digest of its own instead of an echo;
                                           qp_error, api over rdma only: half-way through
                                           the write, the client's queue pair is forced
                                           into the error state, so the connection moves
                                           to TCP while both ends write).
                                           Prints one JSON line ("written": seconds until
                                           all was sent); exit 0 iff it matched.

Every socket has a 120 s timeout, so a deadlock ends as a failure, not a hang.
BULK_ECHO_CHUNK in the environment sets the most bytes read (and echoed) at once;
BULK_ECHO_HOST the address servers listen on and clients connect to (127.0.0.1).
"""
import hashlib
import json
import os
import socket
import sys
import threading
import time

TIMEOUT = 120
CHUNK = int(os.environ.get("BULK_ECHO_CHUNK", 256 * 1024))
HOST = os.environ.get("BULK_ECHO_HOST", "127.0.0.1")


def state(c):
    """For a failure's report: an rdmasock socket's connection state (stats()["state"])."""
    try:
        return "\n  state: " + c.stats()["state"]
    except (AttributeError, KeyError, OSError):
        return ""


def make_socket(mode):
    if mode == "api":
        import rdmasock
        return rdmasock.socket(socket.AF_INET, socket.SOCK_STREAM)
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM)


def pattern(size):
    out = bytearray()
    block = hashlib.sha256(b"bulk").digest() * 2048          # 64 KiB
    while len(out) < size:
        out += block[: size - len(out)]
        block = hashlib.sha256(block[:32]).digest() * 2048
    return bytes(out)


def listen(mode):
    ls = make_socket(mode)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((HOST, 0))
    ls.listen(64)
    print("port %d" % ls.getsockname()[1], flush=True)
    return ls


def serve_forever(ls, handle):
    while True:
        c, _ = ls.accept()
        c.settimeout(TIMEOUT)
        threading.Thread(target=handle, args=(c,), daemon=True).start()


def echo(c):
    try:
        while True:
            d = c.recv(CHUNK)
            if not d:
                break
            c.sendall(d)
        c.shutdown(socket.SHUT_WR)
    except OSError as e:
        print("echo %d: %s: %s%s" % (c.fileno(), type(e).__name__, e, state(c)), file=sys.stderr, flush=True)
    finally:
        c.close()


def relay(src, dst):
    try:
        while True:
            d = src.recv(CHUNK)
            if not d:
                dst.shutdown(socket.SHUT_WR)
                break
            dst.sendall(d)
    except OSError as e:
        print("relay %d->%d: %s: %s%s%s" % (src.fileno(), dst.fileno(), type(e).__name__, e, state(src), state(dst)),
              file=sys.stderr, flush=True)


def proxy(mode, upstream):
    def handle(c):
        u = make_socket(mode)
        u.settimeout(TIMEOUT)
        try:
            u.connect((HOST, upstream))
        except OSError:
            c.close()
            return
        t = threading.Thread(target=relay, args=(u, c), daemon=True)
        t.start()
        relay(c, u)
        t.join(TIMEOUT)
        c.close()
        u.close()
    serve_forever(listen(mode), handle)


def late(size, seconds, c):
    try:
        time.sleep(seconds)
        c.sendall(pattern(size))
        h = hashlib.sha256()
        while True:
            d = c.recv(CHUNK)
            if not d:
                break
            h.update(d)
        c.sendall(h.digest())
        c.shutdown(socket.SHUT_WR)
    except OSError as e:
        print("late %d: %s: %s" % (c.fileno(), type(e).__name__, e), file=sys.stderr, flush=True)
    finally:
        c.close()


def read_all(s, got):
    while True:
        d = s.recv(CHUNK)
        if not d:
            break
        got += d


def client(mode, port, size, duplex, greeted, talked_to=0, qp_error=False):
    data = pattern(size)
    expected = pattern(talked_to) + hashlib.sha256(data).digest() if talked_to else data
    s = make_socket(mode)
    s.settimeout(TIMEOUT)
    t0 = time.monotonic()
    s.connect((HOST, port))
    out = {"size": size, "mode": mode, "duplex": duplex}
    got = bytearray()
    reader = threading.Thread(target=read_all, args=(s, got), daemon=True)
    try:
        if duplex:
            reader.start()
        if greeted and s.recv(1) != b"!":
            raise OSError("no greeting")
        t_write = time.monotonic()
        if qp_error:
            s.sendall(data[: size // 2])
            from rdmasock import transport_rdma
            for side in list(transport_rdma._sides.values()):
                side.ep.force_error()
            s.sendall(data[size // 2:])
        else:
            s.sendall(data)                    # without duplex nothing is read until all is out
        out["written"] = round(time.monotonic() - t_write, 3)
        s.shutdown(socket.SHUT_WR)
        if duplex:
            reader.join(TIMEOUT)
        else:
            read_all(s, got)
        out["received"] = len(got)
        out["ok"] = bytes(got) == expected
        if not out["ok"] and len(got) == len(expected):
            out["first_diff"] = next(i for i in range(len(got)) if got[i] != expected[i])
    except OSError as e:
        out["ok"] = False
        out["error"] = "%s: %s%s" % (type(e).__name__, e, state(s))
    out["seconds"] = round(time.monotonic() - t0, 3)
    out["transport"] = getattr(s, "transport", None)
    out["fallback_reason"] = getattr(s, "fallback_reason", None)
    s.close()
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


def main(argv):
    role, mode = argv[1], argv[2]
    if role == "server":
        serve_forever(listen(mode), echo)
    elif role == "proxy":
        proxy(mode, int(argv[3]))
    elif role == "away":
        away = float(argv[3])
        serve_forever(listen(mode), lambda c: (c.sendall(b"!"), time.sleep(away), echo(c)))
    elif role == "late":
        size, seconds = int(argv[3]), float(argv[4])
        serve_forever(listen(mode), lambda c: late(size, seconds, c))
    elif role == "client":
        return client(mode, int(argv[3]), int(argv[4]), argv[5:] == ["duplex"], argv[5:] == ["away"],
                      int(argv[6]) if argv[5:6] == ["late"] else 0, argv[5:] == ["qp_error"])
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
