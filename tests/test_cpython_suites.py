"""CPython's own networking test suites (Debian's libpython3.11-testsuite) pass the same
with rdmasock as without it, test by test:

  preload  the whole interpreter under `rdmasock run --` (both ends of every connection);
  api      test_socket with socket.socket replaced by rdmasock.socket
           (tests/cpython_api_regrtest.py).

Each suite runs plain first; a test that passes plain and fails, errors or never runs
under rdmasock is a regression.  The preloaded runs must also really upgrade connections:
the log's client lines with transport=shm are counted (test_selectors uses socketpair()
only, so none).  ThreadedVSOCKSocketStreamTest is left out of every run: it hangs on these
machines even without rdmasock (no vsock transport), and VSOCK is never upgraded."""
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SYS_PY = "/usr/bin/python3"
RUN = [sys.executable, "-m", "rdmasock", "run", "--"]
SUITE_TIMEOUT = 300           # a whole suite: the longest takes about 30 s

# suite -> (extra regrtest arguments, client connections upgraded at least).  Most of
# test_socket's client threads close their socket as soon as their half of a test returns,
# often before the server half first touches the accepted socket; the server's answer then
# finds the client gone (fd_pass_failed) and that connection ends on TCP.  How many do
# depends on how the two threads are scheduled: 27 on an idle 2-CPU host, 39-45 under load.
SUITES = {
    "test_socket": ([], 20),
    "test_selectors": ([], 0),
    "test_epoll": ([], 1),                               # edge-triggered EPOLLOUT, descriptor 10000 closed
    "test_socketserver": (["-u", "network"], 5),       # needs the resource for loopback servers
    "test_httplib": ([], 20),
    "test_asyncio.test_sock_lowlevel": ([], 10),
    "test_asyncio.test_streams": ([], 4),
    "test_asyncio.test_server": ([], 1),
    "test_asyncio.test_events": ([], 10),
    "test_asyncio.test_sendfile": ([], 20),             # small SO_SNDBUF, a peer closing mid-stream
    "test_asyncio.test_base_events": ([], 0),           # mock looks up a capsule before the first listen
    "test_urllib2_localnet": ([], 15),
    "test_xmlrpc": ([], 20),
    "test_wsgiref": ([], 1),
    "test_poplib": ([], 30),
    "test_ftplib": ([], 80),
}

# test_socket with rdmasock.socket as socket.socket: regressions not fixed yet, test id ->
# why.  Each must still fail (a fixed one is reported, so that it leaves this list).
API_KNOWN = {}

RAN = re.compile(r"^(\w+) \(([\w.]+)\) \.\.\. ", re.M)
FAILED = re.compile(r"^(?:FAIL|ERROR): (\w+) \(([\w.]+)\)", re.M)
SKIPPED = re.compile(r"^(\w+) \(([\w.]+)\) \.\.\. skipped", re.M)

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/lib/python3.11/test/test_socket.py"),
                                reason="libpython3.11-testsuite is not installed (scripts/setup.sh installs it)")


class Outcomes:
    def __init__(self, suite, mode, log):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RDMASOCK_")}
        env["RDMASOCK_LOG_FILE"] = log
        args = ["-m", "test", suite, "-v", "-i", "*VSOCK*"] + SUITES[suite][0]
        cmd = {"plain": [SYS_PY] + args,
               "preload": RUN + [SYS_PY] + args,
               "api": [sys.executable, os.path.join(HERE, "cpython_api_regrtest.py")] + args[2:]}[mode]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=SUITE_TIMEOUT, env=env, cwd="/tmp")
            self.out, self.rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            self.out, self.rc = (e.stdout or b"").decode(errors="replace"), "timeout"
        def key(m):                  # 3.11 prints "name (module.Class.name)"
            return m.group(2) if m.group(2).endswith("." + m.group(1)) else "%s.%s" % (m.group(2), m.group(1))
        self.ran = {key(m) for m in RAN.finditer(self.out)}
        self.failed = {key(m) for m in FAILED.finditer(self.out)}
        self.skipped = {key(m) for m in SKIPPED.finditer(self.out)}
        self.passed = self.ran - self.failed - self.skipped
        self.log = open(log).read() if os.path.exists(log) else ""

    def upgraded(self):
        return sum("role=client" in l and "transport=shm" in l for l in self.log.splitlines())


_plain = {}


def _plain_run(suite, tmp_path):
    if suite not in _plain:
        _plain[suite] = Outcomes(suite, "plain", str(tmp_path / "plain.log"))
        assert _plain[suite].passed, "no test passed plain:\n" + _plain[suite].out[-3000:]
    return _plain[suite]


def _regressions(plain, other):
    return sorted(plain.passed - other.passed)


@pytest.mark.parametrize("suite", list(SUITES))
def test_same_outcomes_preloaded(suite, tmp_path):
    plain = _plain_run(suite, tmp_path)
    pre = Outcomes(suite, "preload", str(tmp_path / "preload.log"))
    print("%s: %d passed plain, %d preloaded; %d client connections upgraded"
          % (suite, len(plain.passed), len(pre.passed), pre.upgraded()))
    assert pre.rc != "timeout", "the preloaded run hung:\n" + pre.out[-4000:]
    regressions = _regressions(plain, pre)
    assert not regressions, "pass plain, not under rdmasock run: %s\n%s" % (", ".join(regressions), pre.out[-6000:])
    assert pre.upgraded() >= SUITES[suite][1], "too few upgraded connections:\n" + pre.log[-3000:]


def test_socket_with_rdmasock_socket(tmp_path):
    plain = _plain_run("test_socket", tmp_path)
    api = Outcomes("test_socket", "api", str(tmp_path / "api.log"))
    print("test_socket with rdmasock.socket: %d passed plain, %d with rdmasock.socket"
          % (len(plain.passed), len(api.passed)))
    assert api.rc != "timeout", "the run hung:\n" + api.out[-4000:]
    regressions = _regressions(plain, api)
    new = [t for t in regressions if t not in API_KNOWN]
    fixed = [t for t in API_KNOWN if t in api.passed]
    assert not new, "pass plain, not with rdmasock.socket: %s\n%s" % (", ".join(new), api.out[-6000:])
    assert not fixed, "known regressions that pass now (remove them from API_KNOWN): %s" % ", ".join(fixed)
