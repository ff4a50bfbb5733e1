"""The benchmark harness as a program: stopped with SIGTERM in the middle of a run, it stops
the servers it started instead of leaving them running."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest


def _redis_servers():
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "redis-server"}


@pytest.mark.parametrize("after", [0, 3], ids=["while-starting", "while-measuring"])
def test_sigterm_stops_the_servers(tmp_path, after):
    before = _redis_servers()
    bench = subprocess.Popen([sys.executable, "-m", "rdmasock.bench", "redis", "--quick", "--reps", "1",
                              "--no-plots", "--out-dir", str(tmp_path)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _redis_servers() - before and bench.poll() is None:
            time.sleep(0.1)
        started = _redis_servers() - before
        assert started, "the bench started no redis-server"
        time.sleep(after)
        started = _redis_servers() - before
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _redis_servers() & started:
            time.sleep(0.1)
        assert not _redis_servers() & started, "redis-servers left running: %s" % (_redis_servers() & started)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
        for pid in _redis_servers() - before:          # only what this test's bench started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
