"""Nothing a peer writes into shared memory can make this side crash, corrupt memory, or
block past the caller's timeout (issue 15, point 1).

tests/c/hostile_victim.c (built with AddressSanitizer and UBSan, under an ASan build of
the preload library) sends, receives and polls with 1 s timeouts on connections to
tests/hostile_peer.py, an rdmasock peer that rewrites every field of the live segment
(header, indices, counters, lengths, footers, records that look valid) while both sides
talk.  Pass: no sanitizer report, no crash, no call longer than its timeout plus slack,
and every connection that failed did so with a clean error."""
import os
import subprocess
import sys

import pytest

import sanitizers

HERE = os.path.dirname(os.path.abspath(__file__))
VICTIM_SRC = os.path.join(HERE, "c", "hostile_victim.c")
PEER = os.path.join(HERE, "hostile_peer.py")
SECONDS = 12
CLEAN_ERRORS = {"EPROTO", "ECONNRESET", "EPIPE", "ETIMEDOUT", "ECONNABORTED", "EBADMSG"}


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hostile"))
    return sanitizers.program("asan", VICTIM_SRC, os.path.join(base, "victim")), sanitizers.library("asan", base)


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDMASOCK_")}
    env.update(extra or {})
    return env


@pytest.mark.parametrize("victim_role", ["server", "client"])
@pytest.mark.parametrize("mode", ["all", "records"])
def test_hostile_peer(victim, victim_role, mode, tmp_path):
    prog, preload = victim
    log = str(tmp_path / "rs.log")
    venv = _env(dict(sanitizers.ENV, LD_PRELOAD=preload, RDMASOCK_LOG_FILE=log))
    penv = _env()
    if victim_role == "server":
        v = subprocess.Popen([prog, "server", "0", str(SECONDS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=venv)
        port = int(v.stdout.readline().split()[1])
        p = subprocess.Popen([sys.executable, PEER, "client", str(port), str(SECONDS - 1), mode, "7"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=penv)
    else:
        p = subprocess.Popen([sys.executable, PEER, "server", "0", str(SECONDS), mode, "7"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=penv)
        port = int(p.stdout.readline().split()[1])
        v = subprocess.Popen([prog, "client", str(port), str(SECONDS - 1)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=venv)
    try:
        vout, verr = v.communicate(timeout=SECONDS + 60)
    finally:
        if v.poll() is None:
            v.kill()
        try:
            pout, perr = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            pout, perr = p.communicate(timeout=10)
    report = "victim exit %s\nstdout: %s\nstderr: %s\npeer: %s\n%s" % (v.returncode, vout, verr[-5000:], pout[-3000:],
                                                                      perr[-2000:])
    assert not sanitizers.report_problems(verr), report
    assert v.returncode == 0, report
    done = [line for line in vout.splitlines() if line.startswith("done ")]
    assert done, report
    stats = dict(kv.split("=", 1) for kv in done[0].split()[1:])
    assert int(stats["slow"]) == 0, report
    assert int(stats["sessions"]) >= 3 and int(stats["calls"]) > 100, report
    errors = {e.split(":")[0] for e in stats["errors"].split(",") if e}
    assert errors <= CLEAN_ERRORS, report
    if "EPROTO" in errors:                  # and the log says why, with the connection's addresses
        with open(log) as f:
            said = [line for line in f if "error=EPROTO rdmasock: " in line and " peer=127.0.0.1:" in line]
        assert said, "no log line for the EPROTO the program saw\n" + report
    upgraded = sum(1 for line in pout.splitlines() if "writes" in line)
    assert upgraded >= 3, "the peer attacked only %d upgraded connections\n%s" % (upgraded, report)
