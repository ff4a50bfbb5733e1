"""Helpers for tests/programs test modules (import as `progutil`; conftest.py puts this
directory's neighbours on sys.path).  Process control is by PID only, every wait bounded."""
import hashlib
import os
import re
import signal
import subprocess
import threading
import time

import psutil
import pytest

from rdmasock.bench import servers as S
from rdmasock.bench.servers import parse_log, preload_cmd, addr_port, ServerError  # noqa: F401
from rdmasock.reasons import MID_STREAM

HERE = os.path.dirname(os.path.abspath(__file__))
ECHO_PROG = os.path.join(HERE, "echo_prog.py")
NODE = "/usr/bin/node"
NODE_PROG = os.path.join(HERE, "node_echo.js")
RUBY = "/usr/bin/ruby"
PHP = "/usr/bin/php"
ECHO_PROGS = {"ruby": [RUBY, os.path.join(HERE, "ruby_echo.rb")], "php": [PHP, os.path.join(HERE, "php_echo.php")]}
LOG_WAIT = 8.0            # seconds to wait for the log to show every connection's outcome

PAIRINGS = {            # id -> (client preloaded, server preloaded)
    "both": (True, True),
    "client": (True, False),
    "server": (False, True),
    "plain": (False, False),
}


class ToolServer(S._Server):
    """A server program that takes its port on the command line (argv_for(port, workdir));
    ready once a process of its tree listens there (a probing connection would show in the
    log)."""

    name = "tool"

    def __init__(self, argv_for, **kw):
        super().__init__(**kw)
        self.argv_for = argv_for

    def start(self, timeout=30):
        return self._start_on_free_port(lambda port: preload_cmd(self.argv_for(port, self.workdir), self.preload),
                                        self._listening, timeout)

    def _listening(self):
        for pid in self.pids():
            try:
                conns = psutil.Process(pid).net_connections(kind="tcp")
            except psutil.Error:
                continue
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in conns):
                return True
        return False


def make_server(kind, preload, log_file, http_dir_fn=None):
    if kind == "pg":
        return S.PgServer(preload=preload, log_file=log_file)
    if kind == "redis":
        return S.RedisServer(preload=preload, log_file=log_file)
    if kind == "mariadb":
        return S.MariaDbServer(preload=preload, log_file=log_file)
    if kind == "http":
        return S.HttpServer(http_dir_fn()["dir"], preload=preload, log_file=log_file)
    if kind == "echo":
        return S.ProgramServer([S.SYS_PY, "-u", ECHO_PROG, "server"], preload=preload, log_file=log_file)
    if kind in ("node", "node-cluster", "node-cluster-shared"):
        argv = {"node": ["server"], "node-cluster": ["cluster", "rr"], "node-cluster-shared": ["cluster", "shared"]}
        return S.ProgramServer([NODE, NODE_PROG] + argv[kind], preload=preload, log_file=log_file)
    if kind in ECHO_PROGS:
        return S.ProgramServer(ECHO_PROGS[kind] + ["server"], preload=preload, log_file=log_file)
    if callable(kind):
        return ToolServer(kind, preload=preload, log_file=log_file)
    raise ValueError(kind)


class Ctx:
    """What a test needs for one pairing: servers (shared or fresh), client argv/env, the
    log window of this test and the transport assertions."""

    def __init__(self, pairing, pool, log_file):
        self.pairing = pairing
        self.client_pre, self.server_pre = PAIRINGS[pairing]
        self.pool = pool
        self.log_file = log_file
        self.mark = S.log_size(log_file)
        self.fresh = []
        self.clients = []

    # -- preconditions -----------------------------------------------------------------------
    def _need(self, preload):
        if preload:
            ok, msg = S.preload_status()
            if not ok:
                pytest.fail("pairing %r needs the LD_PRELOAD library, which is not usable: %s"
                            % (self.pairing, msg), pytrace=False)

    # -- servers -----------------------------------------------------------------------------
    def server(self, kind):
        """The shared server of this kind for this pairing's server side."""
        self._need(self.server_pre)
        try:
            return self.pool.get(kind, self.server_pre)
        except ServerError as exc:
            pytest.fail("could not start %s (preload=%s): %s" % (kind, self.server_pre, exc), pytrace=False)

    def fresh_server(self, kind):
        """A server of its own for this test (stopped at the end of the test)."""
        self._need(self.server_pre)
        srv = make_server(kind, self.server_pre, self.log_file, lambda: self.pool.http_dir_fn())
        self.fresh.append(srv)
        try:
            return srv.start()
        except ServerError as exc:
            pytest.fail("could not start %s (preload=%s): %s" % (kind, self.server_pre, exc), pytrace=False)

    # -- clients -----------------------------------------------------------------------------
    def cmd(self, argv):
        self._need(self.client_pre)
        return preload_cmd(argv, self.client_pre)

    def env(self, extra=None):
        return S.client_env(self.log_file, extra)

    def run(self, argv, timeout, check=True, **kw):
        """Runs a client program (preloaded per pairing) to completion, bounded."""
        try:
            return S.run(self.cmd(argv), timeout=timeout, check=check, env=self.env(kw.pop("env", None)), **kw)
        except ServerError as exc:
            pytest.fail("client failed (pairing %s): %s" % (self.pairing, exc), pytrace=False)

    def popen(self, argv, **kw):
        """Starts a client program in the background (killed by PID at the end of the test)."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.PIPE)
        p = subprocess.Popen(self.cmd(argv), env=self.env(kw.pop("env", None)), start_new_session=True, **kw)
        self.clients.append(p)
        return p

    def close(self):
        for p in self.clients:
            if p.poll() is None:
                S.kill_tree(p)
            for f in (p.stdout, p.stderr, p.stdin):
                if f:
                    f.close()
        for srv in self.fresh:
            srv.stop()

    # -- log assertions ----------------------------------------------------------------------
    def records(self, port=None):
        recs = parse_log(self.log_file, self.mark)
        if port is not None:
            recs = [r for r in recs if addr_port(r["local"]) == port or addr_port(r["peer"]) == port]
        return recs

    def _problems(self, recs, min_conns):
        # An upgraded connection whose ring later stalled (a reader that stopped reading)
        # moves to TCP and logs a second line, reason ring_stalled (or its peer's, peer_moved): that is TCP's own
        # behaviour carried over (docs/PROTOCOL.md 6.8), as long as it was upgraded first.
        shm_keys = {(r["role"], r["local"], r["peer"]) for r in recs if r["transport"] == "shm"}
        moved = [r for r in recs if re.search(r"reason=(%s)\b" % "|".join(MID_STREAM), r["line"])]
        recs = [r for r in recs if r not in moved]
        probs = ["a mid-stream move for a connection never upgraded: " + r["line"]
                 for r in moved if (r["role"], r["local"], r["peer"]) not in shm_keys and self.pairing == "both"][:1]
        clients = [r for r in recs if r["role"] == "client"]
        servers_ = [r for r in recs if r["role"] == "server"]
        other = [r for r in recs if r["role"] not in ("client", "server")]
        if other:
            probs.append("lines with an unknown role")
        noaddr = [r for r in recs if addr_port(r["local"]) is None or addr_port(r["peer"]) is None]
        if noaddr:
            probs.append("%d lines lack a local or peer address (e.g. %s)" % (len(noaddr), noaddr[0]["line"]))
        # (no check for repeated address pairs: loopback reuses TIME_WAIT ports, tcp_tw_reuse=2)
        if self.pairing == "plain":
            if recs:
                probs.append("nothing is preloaded, yet the log has lines for this server")
            return probs
        if self.pairing == "both":
            if len(clients) < min_conns:
                probs.append("expected >= %d client lines, got %d" % (min_conns, len(clients)))
            if len(servers_) < min_conns:
                probs.append("expected >= %d server lines, got %d" % (min_conns, len(servers_)))
            notshm = [r for r in recs if r["transport"] != "shm"]
            if notshm:
                probs.append("%d lines not transport=shm (e.g. %s)" % (len(notshm), notshm[0]["line"]))
            srv_keys = {(r["local"], r["peer"]) for r in servers_}
            unmatched = [c for c in clients if (c["peer"], c["local"]) not in srv_keys]
            if unmatched:
                probs.append("%d client connections have no matching server line (e.g. %s)"
                             % (len(unmatched), unmatched[0]["line"]))
            return probs
        pre_role, plain_role = ("client", "server") if self.pairing == "client" else ("server", "client")
        pre = clients if pre_role == "client" else servers_
        if len(pre) < min_conns:
            probs.append("expected >= %d %s lines (the preloaded side), got %d" % (min_conns, pre_role, len(pre)))
        if any(r["role"] == plain_role for r in recs):
            probs.append("lines from the %s role, which is not preloaded" % plain_role)
        bad = [r for r in recs if r["transport"] != "tcp" or not r["reason"]]
        if bad:
            probs.append("%d lines are not transport=tcp with a reason (e.g. %s)" % (len(bad), bad[0]["line"]))
        return probs

    def check_transport(self, port, min_conns=1, wait=LOG_WAIT):
        """Asserts the log of this test (lines about port) fits the pairing; waits up to `wait`
        seconds for lines still being written."""
        end = time.monotonic() + wait
        while True:
            recs = self.records(port)
            probs = self._problems(recs, min_conns)
            if not probs or time.monotonic() >= end:
                break
            time.sleep(0.1)
        if probs:
            shown = "\n".join(r["line"] for r in recs[:40])
            pytest.fail("pairing %s, port %d: %s\nlog %s lines (%d):\n%s"
                        % (self.pairing, port, "; ".join(probs), self.log_file, len(recs), shown), pytrace=False)
        return recs


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)


def read_some(stream, n, timeout):
    """Reads up to n bytes from a pipe within timeout seconds (in a helper thread)."""
    got = bytearray()

    def reader():
        while len(got) < n:
            b = stream.read1(min(65536, n - len(got))) if hasattr(stream, "read1") else stream.read(65536)
            if not b:
                return
            got.extend(b)
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    return bytes(got)


def read_line(stream, timeout):
    out = []
    t = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return out[0].decode(errors="replace").strip() if out else None


def wait_exit(proc, timeout):
    """Seconds until proc exited, or None if it did not within timeout (then it stays running)."""
    t0 = time.monotonic()
    try:
        proc.wait(timeout)
        return time.monotonic() - t0
    except subprocess.TimeoutExpired:
        return None


def client_ports(proc, server_port):
    """Local ports of the TCP connections the client tree of proc holds to server_port."""
    return {c.laddr.port for _, c in S.conns_of(S.process_tree(proc.pid), server_port) if c.raddr
            and c.raddr.port == server_port}


def wait_server_closed(srv, ports, timeout):
    """Waits until the server's processes hold no connection from any of the client ports.
    Returns the seconds it took, or None (and the remaining connections) on timeout."""
    t0 = time.monotonic()
    left = []

    def gone():
        left[:] = [(pid, c) for pid, c in S.conns_of(srv.pids(), srv.port) if c.raddr and c.raddr.port in ports]
        return not left
    if S.wait_until(gone, timeout, 0.05):
        return time.monotonic() - t0, []
    return None, left


def kill_client(proc):
    S.kill_pids(S.process_tree(proc.pid), signal.SIGKILL)


__all__ = ["preload_cmd", "parse_log", "sha256_file", "read_some", "read_line", "wait_exit", "client_ports",
           "wait_server_closed", "kill_client", "ECHO_PROG", "S", "Ctx", "PAIRINGS", "make_server"]
