"""memcached (threaded, libevent), haproxy (a TCP proxy, with and without splice) and
iperf3 (bulk streams both ways), every process under the preload library: the bytes are
exact, every connection that should be upgraded is, and splice moves to TCP with its
reason.  A threaded Python client drives memcached, directly and through haproxy."""
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import free_port, stop_process

RUN = [sys.executable, "-m", "rdmasock", "run", "--"]
HERE = os.path.dirname(os.path.abspath(__file__))
MEMCACHED, HAPROXY, IPERF3 = (shutil.which(p) or p for p in ("memcached", "haproxy", "iperf3"))

CLIENT = r"""
import socket, sys, threading
port, n, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
errors = []
def worker(i):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        f = s.makefile("rb")
        for j in range(rounds):
            v = b"%d-%d." % (i, j) * (1 + j % 700)
            s.sendall(b"set k%d 0 0 %d\r\n%s\r\n" % (i, len(v), v))
            assert f.readline() == b"STORED\r\n"
            s.sendall(b"get k%d\r\n" % i)
            assert f.readline() == b"VALUE k%d 0 %d\r\n" % (i, len(v))
            assert f.read(len(v) + 2) == v + b"\r\n" and f.readline() == b"END\r\n"
        s.close()
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
[t.start() for t in threads]
[t.join(120) for t in threads]
print("errors", len(errors), errors[:2])
"""


def _need(path):
    if not os.path.exists(path):
        pytest.skip("%s is not installed (scripts/setup.sh installs it)" % os.path.basename(path))


def _wait_port(port, proc, what):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail("%s exited: %s" % (what, proc.stderr.read() if proc.stderr else ""))
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    pytest.fail("%s did not listen on %d" % (what, port))


def _wait_listening(port, proc):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for row in f.read().splitlines()[1:]:
                    local, state = row.split()[1], row.split()[3]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        return
        time.sleep(0.05)
    pytest.fail("iperf3 -s did not listen on %d" % port)


def _lines(log, role, port):
    return [l for l in open(log).read().splitlines() if "role=%s " % role in l and ":%d " % port in l + " "]


@pytest.mark.parametrize("proxy", ["direct", "haproxy", "haproxy-splice"])
def test_memcached_threaded_clients(tmp_path, proxy):
    _need(MEMCACHED)
    if proxy != "direct":
        _need(HAPROXY)
    log = str(tmp_path / "rs.log")
    env = dict(os.environ, RDMASOCK_LOG_FILE=log)
    mport = free_port()
    procs = [subprocess.Popen(RUN + [MEMCACHED, "-u", "root", "-l", "127.0.0.1", "-p", str(mport), "-U", "0",
                                     "-t", "4", "-c", "256"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)]
    try:
        _wait_port(mport, procs[0], "memcached")
        port = mport
        if proxy != "direct":
            port = free_port()
            splice = "    option splice-request\n    option splice-response\n" if proxy == "haproxy-splice" else ""
            cfg = tmp_path / "haproxy.cfg"
            cfg.write_text("global\n    maxconn 256\ndefaults\n    mode tcp\n%s    timeout connect 5s\n"
                           "    timeout client 60s\n    timeout server 60s\nfrontend fe\n    bind 127.0.0.1:%d\n"
                           "    default_backend be\nbackend be\n    server s1 127.0.0.1:%d\n" % (splice, port, mport))
            procs.append(subprocess.Popen(RUN + [HAPROXY, "-f", str(cfg), "-db"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            _wait_port(port, procs[1], "haproxy")
        r = subprocess.run(RUN + ["/usr/bin/python3", "-c", CLIENT, str(port), "20", "150"], env=env,
                           capture_output=True, timeout=180)
        assert r.stdout.startswith(b"errors 0 ") and not r.stderr, (r.stdout, r.stderr)
    finally:
        for p in reversed(procs):
            stop_process(p)
    last = {}                                    # a connection's last line says where it ended
    for line in _lines(log, "client", port):
        last[line.split(" local=")[1].split()[0]] = line
    assert len(last) == 20, last
    if proxy == "haproxy-splice":
        # haproxy splices both ways: each connection moved on to TCP, with the reason
        assert all("transport=tcp" in l and ("reason=splice" in l or "reason=peer_moved" in l)
                   for l in last.values()), last
    else:
        assert all("transport=shm" in l for l in last.values()), last


@pytest.mark.parametrize("mode", ["send", "reverse", "bidir", "parallel"])
def test_iperf3_streams(tmp_path, mode):
    _need(IPERF3)
    log = str(tmp_path / "rs.log")
    env = dict(os.environ, RDMASOCK_LOG_FILE=log)
    port = free_port()
    srv = subprocess.Popen(RUN + [IPERF3, "-s", "-1", "-p", str(port)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        _wait_listening(port, srv)               # not by connecting: `-s -1` serves one client only
        extra = {"send": [], "reverse": ["-R"], "bidir": ["--bidir"], "parallel": ["-P", "4"]}[mode]
        r = subprocess.run(RUN + [IPERF3, "-c", "127.0.0.1", "-p", str(port), "-t", "1", "-J"] + extra, env=env,
                           capture_output=True, timeout=60)
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr)
        import json
        res = json.loads(r.stdout)
        sent = res["end"]["sum_sent"]["bytes"]
        got = res["end"]["sum_received"]["bytes"]
        assert 0 < got <= sent, (sent, got)      # iperf3 counts what arrived before the end (TCP too)
        srv.wait(20)
    finally:
        stop_process(srv)
    lines = [l for l in open(log).read().splitlines() if "role=client" in l and ":%d " % port in l + " "]
    streams = {"parallel": 4, "bidir": 2}.get(mode, 1)
    assert len(lines) == 1 + streams and all("transport=shm" in l for l in lines), lines   # control + data
