import os
import socket
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "peer.py")


def free_port():
    """A loopback TCP port nobody listens on now (for servers that take a port number)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def stop_process(proc, grace=10):
    """Ends a process this test started, by its PID: SIGTERM, then SIGKILL after grace s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_for(pred, timeout=10.0, interval=0.01):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


class Peer:
    """A peer program in its own process (tests/peer.py), killed by PID at the end."""

    def __init__(self, *args, env=None):
        e = dict(os.environ)
        e.update(env or {})
        self.proc = subprocess.Popen([sys.executable, PEER] + [str(a) for a in args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e)
        line = self.proc.stdout.readline().decode().strip()       # first line: "port N" or "ready"
        if not line:
            self.stop()
            raise RuntimeError("peer failed: %s" % self.proc.stderr.read().decode()[-2000:])
        self.first = line
        self.port = int(line.split()[1]) if line.startswith("port") else None

    def readline(self, timeout=20):
        out = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        return out[0].decode().strip() if out else None

    def wait(self, timeout=30):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stderr(self):
        return self.proc.stderr.read().decode()


@pytest.fixture
def peers():
    started = []

    def start(*args, env=None):
        p = Peer(*args, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def pair():
    """A connected (client, server) pair of rdmasock sockets in this process."""
    import rdmasock
    made = []

    def make(**kw):
        srv = rdmasock.create_server(("127.0.0.1", 0))
        c = rdmasock.create_connection(srv.getsockname(), **kw)
        s, _ = srv.accept()
        srv.close()
        made.extend([c, s])
        return c, s

    yield make
    for s in made:
        s.close()


@pytest.fixture(autouse=True)
def _fresh_config(monkeypatch):
    from rdmasock import config
    monkeypatch.delenv("RDMASOCK_LOG_FILE", raising=False)
    monkeypatch.delenv("RDMASOCK_DISABLE", raising=False)
    if not os.environ.get("RDMASOCK_TEST_TRANSPORT"):     # set by the RDMA VM tests on purpose
        monkeypatch.delenv("RDMASOCK_TRANSPORTS", raising=False)
    config.reload()
    yield
    config.reload()


def recv_exact(sock, n, timeout=30):
    buf = bytearray()
    end = time.monotonic() + timeout
    while len(buf) < n:
        if time.monotonic() > end:
            raise TimeoutError("got %d of %d bytes" % (len(buf), n))
        d = sock.recv(n - len(buf))
        if not d:
            raise EOFError("EOF after %d of %d bytes" % (len(buf), n))
        buf += d
    return bytes(buf)


def recv_all(sock, timeout=30):
    buf = bytearray()
    end = time.monotonic() + timeout
    while True:
        if time.monotonic() > end:
            raise TimeoutError("no EOF after %d bytes" % len(buf))
        d = sock.recv(1 << 20)
        if not d:
            return bytes(buf)
        buf += d


__all__ = ["socket", "wait_for", "recv_exact", "recv_all"]
