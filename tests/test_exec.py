"""exec with an accepted or upgraded socket open across it (shim/preload/rs_hooks_exec.c):
the new program sees the byte stream TCP would have carried.  Accepted and not yet
answered: the new program answers the HELLO and the connection is upgraded there.
Upgraded: the connection moves to TCP first (reason exec), the peer follows."""
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from rdmasock import rendezvous

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = [sys.executable, "-m", "rdmasock", "run", "--"]
SYS_PY = "/usr/bin/python3"


def _env(log):
    return dict(os.environ, RDMASOCK_LOG_FILE=str(log))


def _server(mode, log):
    p = subprocess.Popen(RUN + [SYS_PY, os.path.join(HERE, "exec_server.py"), mode], env=_env(log),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    port = int(p.stdout.readline())
    return p, port


def _client(port, payload, log, half_close=True):
    """Sends payload (then half-closes, if asked), reads to the end of the stream."""
    code = ("import socket, sys\n"
            "s = socket.create_connection(('127.0.0.1', %d))\n"
            "data = sys.stdin.buffer.read()\n"
            "s.sendall(data)\n"
            "if %r: s.shutdown(socket.SHUT_WR)\n"
            "out = b''\n"
            "while True:\n"
            "    b = s.recv(65536)\n"
            "    if not b: break\n"
            "    out += b\n"
            "sys.stdout.buffer.write(out)\n" % (port, half_close))
    return subprocess.run(RUN + [SYS_PY, "-c", code], input=payload, env=_env(log), capture_output=True, timeout=60)


def _lines(log):
    return open(log).read().splitlines() if os.path.exists(log) else []


def test_inetd_style_exec_upgrades_in_the_new_program(tmp_path):
    """accept, then exec at once with the socket as stdin/stdout: the new program answers
    the client's HELLO itself, the connection is shm there, and 4 MiB echo back intact."""
    log = tmp_path / "log"
    srv, port = _server("inetd", log)
    payload = os.urandom(4 << 20)
    r = _client(port, payload, log)
    assert srv.wait(timeout=30) == 0 and srv.stderr.read() == b""
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert hashlib.sha256(r.stdout).digest() == hashlib.sha256(payload).digest(), len(r.stdout)
    lines = _lines(log)
    server = [l for l in lines if "role=server" in l]
    assert len(server) == 1 and "transport=shm" in server[0] and "pid=%d " % srv.pid in server[0], lines
    assert any("role=client" in l and "transport=shm" in l for l in lines), lines
    assert not any("transport=tcp" in l for l in lines), lines


@pytest.mark.parametrize("half_close", [False, True], ids=["reads", "half-closes"])
def test_exec_after_the_upgrade_moves_the_connection_to_tcp(tmp_path, half_close):
    """read a request over the ring, then exec a program that answers on the socket: the
    connection goes on over TCP first (reason exec; the client's side follows, or had
    already ended its direction with a half-close) and the client reads exactly the new
    program's answer, then the end of the stream."""
    log = tmp_path / "log"
    srv, port = _server("after-request", log)
    r = _client(port, b"hello\n", log, half_close=half_close)
    assert srv.wait(timeout=30) == 0 and srv.stderr.read() == b""
    assert r.returncode == 0 and r.stderr == b"" and r.stdout == b"world", (r.stdout, r.stderr)
    lines = _lines(log)
    assert any("role=server" in l and "transport=shm" in l for l in lines), lines
    exec_lines = [l for l in lines if "reason=exec" in l]
    assert len(exec_lines) == 1 and "role=server" in exec_lines[0] and "reason=exec (" not in exec_lines[0], lines


EXEC_CLIENT = r"""
import os, socket, sys
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
os.dup2(c.fileno(), 6)                  # ucspi-tcp's tcpclient: the program reads 6, writes 7
os.dup2(c.fileno(), 7)
c.close()
os.execv(sys.executable, [sys.executable, "-c", sys.argv[2]])
"""

EXEC_CLIENT_PROGRAM = r"""
import hashlib, os, socket, sys
data = sys.stdin.buffer.read()
w = socket.socket(fileno=7)
w.sendall(data)
w.shutdown(socket.SHUT_WR)
got = bytearray()
while True:
    b = os.read(6, 65536)
    if not b:
        break
    got += b
print(hashlib.sha256(got).hexdigest())
"""


def test_client_exec_right_after_connect(tmp_path):
    """A client that connects and execs a program on the socket at once (ucspi-tcp's
    tcpclient), before any call of its own on it: the handshake is finished before the
    exec (its answer used to reach the new program as data, and the server reported a
    garbled preamble), the connection then moves to TCP (reason exec), and 2 MiB echo back
    intact."""
    log = tmp_path / "log"
    srv, port = _server("inetd", log)
    payload = os.urandom(2 << 20)
    r = subprocess.run(RUN + [SYS_PY, "-c", EXEC_CLIENT, str(port), EXEC_CLIENT_PROGRAM], input=payload,
                       env=_env(log), capture_output=True, timeout=60)
    assert srv.wait(timeout=30) == 0 and srv.stderr.read() == b""
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert r.stdout.decode().strip() == hashlib.sha256(payload).hexdigest()
    lines = _lines(log)
    exec_lines = [l for l in lines if "reason=exec" in l]
    assert len(exec_lines) == 1 and "role=client" in exec_lines[0] and "reason=exec (" not in exec_lines[0], lines


def test_python_subprocess_given_the_socket(tmp_path):
    """Python's subprocess (a vfork child: it dup2s the socket onto stdout and closes the
    rest, in memory it shares with its parent) runs a program that answers on the
    socket; the parent then writes on it too.  The parent's own descriptors are left
    alone (its stdin is still its stdin), the client reads both, in order."""
    log = tmp_path / "log"
    p = subprocess.Popen(RUN + [SYS_PY, os.path.join(HERE, "exec_server.py"), "subprocess"], env=_env(log),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    port = int(p.stdout.readline())
    r = _client(port, b"hello\n", log, half_close=False)
    out, err = p.communicate(b"the parent's stdin\n", timeout=30)
    assert p.returncode == 0 and err == b"" and out == b"the parent's stdin\n", (out, err)
    assert r.returncode == 0 and r.stderr == b"" and r.stdout == b"world!", (r.stdout, r.stderr)
    lines = _lines(log)
    exec_lines = [l for l in lines if "reason=exec" in l and " fd=" in l]
    assert len(exec_lines) == 1 and "fd=1 " in exec_lines[0] and "reason=exec (" not in exec_lines[0], lines


def test_git_daemon_clone(tmp_path):
    """git daemon runs `git daemon --serve` on each accepted socket, which reads the
    request and runs upload-pack on it: the clone is complete and byte-identical."""
    git = shutil.which("git")
    assert git, "git is not installed (scripts/setup.sh installs it)"
    log = tmp_path / "log"
    repo = tmp_path / "repo"
    repo.mkdir()
    blob = os.urandom(8 << 20)
    (repo / "blob.bin").write_bytes(blob)
    g = ["-c", "user.email=t@example.com", "-c", "user.name=t"]
    for cmd in (["init", "-q"], ["add", "blob.bin"], g + ["commit", "-q", "-m", "x"]):
        subprocess.run([git, "-C", str(repo)] + cmd, check=True, timeout=60, capture_output=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = subprocess.Popen(RUN + [git, "daemon", "--reuseaddr", "--base-path=%s" % tmp_path, "--export-all",
                                     "--listen=127.0.0.1", "--port=%d" % port, str(repo)],
                              env=_env(log), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30       # until the daemon's listener is registered
        while rendezvous.listener_status("127.0.0.1", port)[0] != "ok":
            assert time.monotonic() < deadline and daemon.poll() is None, daemon.stderr.read()
            time.sleep(0.05)
        clone = tmp_path / "clone"
        r = subprocess.run(RUN + [git, "clone", "-q", "git://127.0.0.1:%d/repo" % port, str(clone)],
                           env=_env(log), capture_output=True, timeout=120)
        assert r.returncode == 0 and r.stderr == b"", r.stderr
        assert (clone / "blob.bin").read_bytes() == blob
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    lines = _lines(log)
    assert any("role=server" in l and "transport=shm" in l for l in lines), lines
    assert any("role=server" in l and "reason=exec" in l for l in lines), lines
    assert not any("reason=exec (" in l for l in lines), lines
