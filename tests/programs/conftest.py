"""Real, unmodified programs over rdmasock's LD_PRELOAD library (issue 3, "Real programs as
automated tests").

Every test runs in four pairings (the `ctx` fixture's parameter):
  both    preloaded client + preloaded server: results correct AND every connection logged
          transport=shm by the client and by the server;
  client  preloaded client + plain server: correct, every line transport=tcp with a reason;
  server  plain client + preloaded server: correct, every line transport=tcp with a reason;
  plain   nothing preloaded: the harness baseline (correct, no log lines at all).
A pairing that needs the preload fails (never skips) when `rdmasock run` is unavailable.

Servers (rdmasock.bench.servers) listen on 127.0.0.1, each on a free port, and are stopped by PID.
Shared servers live for the session, one per (program, preloaded?); fault tests start fresh
ones.  Every subprocess has a timeout.  Clients that embed Python are run with Debian's
/usr/bin/python3 (3.11.2, the preload library's build base), not the `python3` on PATH.

Helpers: preload_cmd(cmd, enabled) and parse_log(path) are defined in rdmasock.bench.servers (the
benchmarks use them too) and re-exported here; test modules import them, and the process
helpers, from progutil.py (two conftest.py modules cannot both be imported by name)."""
import hashlib
import os
import shutil
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from rdmasock.bench import servers as S  # noqa: E402
from rdmasock.bench.servers import parse_log, preload_cmd, addr_port, ServerError  # noqa: E402,F401

from progutil import PAIRINGS, Ctx, make_server  # noqa: E402

COPY_MB = 50
HTTP_FILE_MB = 100


def pytest_configure(config):
    config.addinivalue_line("markers", "programs: real programs (PostgreSQL, redis, curl, ...) under the "
                                       "LD_PRELOAD library; tests/programs")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.programs)


# ---------------------------------------------------------------------------------------------
# session resources

@pytest.fixture(scope="session")
def work_dir():
    d = tempfile.mkdtemp(prefix="rs-programs-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def session_log(work_dir):
    """One RDMASOCK_LOG_FILE for every process of the session (tests read from their mark)."""
    return S.make_log_file(os.path.join(work_dir, "log"), "rdmasock.log")


@pytest.fixture(scope="session")
def copy_file(work_dir):
    """~50 MB of COPY text rows (id, 64 hex chars, a word), and its sha256."""
    path = os.path.join(work_dir, "copy_in.txt")
    h = hashlib.sha256()
    target = COPY_MB << 20
    size = 0
    rows = 0
    with open(path, "wb") as f:
        rnd = os.urandom(1 << 20)
        pos = 0
        buf = []
        while size < target:
            if pos + 32 > len(rnd):
                rnd, pos = os.urandom(1 << 20), 0
            line = b"%d\t%s\tw%d\n" % (rows, rnd[pos:pos + 32].hex().encode(), rows % 9973)
            pos += 32
            buf.append(line)
            size += len(line)
            rows += 1
            if len(buf) >= 10000:
                chunk = b"".join(buf)
                f.write(chunk)
                h.update(chunk)
                buf = []
        chunk = b"".join(buf)
        f.write(chunk)
        h.update(chunk)
    return {"path": path, "sha256": h.hexdigest(), "rows": rows, "size": size}


@pytest.fixture(scope="session")
def http_dir(work_dir):
    """A directory with a 100 MB random file (big.bin) and a small one, served by http.server."""
    d = os.path.join(work_dir, "www")
    os.mkdir(d)
    os.chmod(d, 0o755)
    h = hashlib.sha256()
    with open(os.path.join(d, "big.bin"), "wb") as f:
        for _ in range(HTTP_FILE_MB):
            b = os.urandom(1 << 20)
            f.write(b)
            h.update(b)
    with open(os.path.join(d, "small.txt"), "wb") as f:
        f.write(b"hello from http.server\n")
    return {"dir": d, "big": "big.bin", "sha256": h.hexdigest(), "size": HTTP_FILE_MB << 20}


class ServerPool:
    """Shared servers, one per (kind, preloaded), started on first use, stopped at session end."""

    def __init__(self, log_file, http_dir_fn):
        self.log_file = log_file
        self.http_dir_fn = http_dir_fn
        self.servers = {}
        self.broken = {}

    def get(self, kind, preload):
        key = (kind, preload)
        if key in self.broken:
            raise ServerError("%s (preload=%s) failed to start earlier in this session: %s"
                              % (kind, preload, self.broken[key]))
        if key not in self.servers:
            try:
                self.servers[key] = make_server(kind, preload, self.log_file, self.http_dir_fn).start()
            except ServerError as exc:
                self.broken[key] = str(exc)[:2000]
                raise
        srv = self.servers[key]
        if srv.proc.poll() is not None:
            raise ServerError("shared %s server (preload=%s) died (exit %s):\n%s"
                              % (kind, preload, srv.proc.returncode, S.read_tail(srv.out_path)))
        return srv

    def stop_all(self):
        for srv in self.servers.values():
            srv.stop()
        self.servers.clear()


@pytest.fixture(scope="session")
def server_pool(session_log, request):
    pool = ServerPool(session_log, lambda: request.getfixturevalue("http_dir"))
    yield pool
    pool.stop_all()


@pytest.fixture(params=list(PAIRINGS), ids=list(PAIRINGS))
def ctx(request, server_pool, session_log):
    c = Ctx(request.param, server_pool, session_log)
    yield c
    c.close()
