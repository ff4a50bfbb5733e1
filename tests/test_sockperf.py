"""sockperf (the latency tool of the libvma world, Debian's 3.7), both ends under the
preload library, TCP: ping-pong, throughput and under-load complete and report their
figure, and every connection is upgraded.  Ping-pong runs with `--mps 10000000`:
sockperf sizes its sequence table for its default rate (<= 600 k messages/s) and aborts
with `_seqN > m_maxSequenceNo` when the link is faster, which an upgraded one is."""
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import free_port

SOCKPERF = shutil.which("sockperf") or "/usr/bin/sockperf"
RUN = [sys.executable, "-m", "rdmasock", "run", "--"]

pytestmark = pytest.mark.skipif(not os.path.exists(SOCKPERF),
                                reason="sockperf is not installed (scripts/setup.sh installs it)")


@pytest.mark.parametrize("mode,args,figure", [
    ("ping-pong", ["-m", "64", "--mps", "10000000"], r"Summary: Latency is ([0-9.]+) usec"),
    ("ping-pong", ["-m", "1000", "--mps", "10000000"], r"Summary: Latency is ([0-9.]+) usec"),
    ("throughput", ["-m", "1000"], r"Summary: Message Rate is ([0-9]+) \[msg/sec\]"),
    ("under-load", ["-m", "64", "--mps", "100000"], r"Summary: Latency is ([0-9.]+) usec"),
], ids=["ping-pong-64", "ping-pong-1000", "throughput-1000", "under-load-64"])
def test_sockperf_tcp(tmp_path, mode, args, figure):
    port = free_port()
    log = str(tmp_path / "rs.log")
    env = dict(os.environ, RDMASOCK_LOG_FILE=log)
    srv = subprocess.Popen(RUN + [SOCKPERF, "server", "--tcp", "-i", "127.0.0.1", "-p", str(port)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while "role=server" not in (open(log).read() if os.path.exists(log) else ""):
            # the server logs nothing until a connection: probe until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert srv.poll() is None and time.monotonic() < deadline, "sockperf server did not start"
                time.sleep(0.05)
        r = subprocess.run(RUN + [SOCKPERF, mode, "--tcp", "-i", "127.0.0.1", "-p", str(port), "-t", "2"] + args,
                           env=env, capture_output=True, text=True, timeout=60)
    finally:
        srv.kill()
        srv.wait(10)
    assert r.returncode == 0 and "ERROR" not in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(figure, r.stdout + r.stderr), r.stdout[-2000:]
    text = open(log).read()
    clients = [l for l in text.splitlines() if "role=client" in l]
    assert clients and all("transport=shm" in l for l in clients), text
