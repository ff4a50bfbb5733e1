"""Resources stay bounded: idle upgraded connections commit little memory, and the
process's ring memory has a cap (RDMASOCK_RING_MEMORY_MAX) above which new connections
stay TCP with reason ring_memory_limit, and below which closed connections give it back.
A forked child that never upgrades a socket does not copy the engine's interpreter."""
import collections
import json
import os
import resource
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = [sys.executable, "-m", "rdmasock", "run", "--"]
SEGMENT = 4096 + 2 * 256 * 1024          # a default segment: header page + two 256 KiB rings
KIB = 1024


@pytest.fixture(scope="module")
def idle_conns(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("idle") / "idle_conns")
    subprocess.run(["gcc", "-O2", "-Wall", "-o", path, os.path.join(HERE, "c", "idle_conns.c")], check=True,
                   timeout=120)
    return path


def _many_fds():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _readline(p, timeout):
    import select
    if not select.select([p.stdout], [], [], timeout)[0]:
        raise AssertionError("no answer from %s within %d s" % (p.args, timeout))
    return p.stdout.readline().decode().split()


def _stat(pids):
    out = json.loads(subprocess.check_output([sys.executable, "-m", "rdmasock", "stat", "--json"], timeout=120))
    return {p["pid"]: p for p in out if p["pid"] in pids}


def _run_pair(prog, tmp_path, n, rounds=1, env=None):
    """Server and client of `n` connections (`rounds` times over); returns their stat
    entries, the memory lines and whether every connection still carries data."""
    env = dict(os.environ, RDMASOCK_LOG_FILE=str(tmp_path / "log"), **(env or {}))
    procs = []
    try:
        srv = subprocess.Popen(RUN + [prog, "server", "0", str(n), str(rounds)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, env=env, preexec_fn=_many_fds, bufsize=0)
        procs.append(srv)
        ready = _readline(srv, 30)
        assert ready[0] == "ready", ready
        cli = subprocess.Popen(RUN + [prog, "client", ready[1], str(n), str(rounds)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, env=env, preexec_fn=_many_fds, bufsize=0)
        procs.append(cli)
        mem = {}
        for name, p in (("client", cli), ("server", srv)):
            first, last = _readline(p, 300), _readline(p, 300)
            assert first[0] == last[0] == "mem", (first, last)
            mem[name] = [int(x) for x in first[1:]], [int(x) for x in last[1:]]
        stat = _stat({srv.pid, cli.pid})
        for p in (cli, srv):
            p.stdin.write(b"verify\n")
            p.stdin.flush()
        verified = [_readline(p, 120) for p in (cli, srv)]
        for p in (cli, srv):
            p.stdin.close()
            assert p.wait(60) == 0
        return stat[cli.pid], stat[srv.pid], mem, verified == [["ok"], ["ok"]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _kinds(entry):
    return collections.Counter((c["transport"], c["fallback_reason"]) for c in entry["connections"])


def test_ten_thousand_idle_connections_commit_little(idle_conns, tmp_path):
    """10,000 idle upgraded connections in each of two processes: all upgraded, each
    commits <= 64 KiB (anonymous + shared pages, measured after the engine started), the
    ring memory stays within its cap, and every connection still works."""
    n = 10000
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < n + 100:
        pytest.fail("RLIMIT_NOFILE hard limit below %d" % (n + 100))
    cli, srv, mem, verified = _run_pair(idle_conns, tmp_path, n)
    assert verified
    for entry in (cli, srv):
        assert _kinds(entry) == {("shm", None): n}
        assert 0 < entry["ring_memory"] <= entry["ring_memory_max"]
    for name, (first, last) in mem.items():
        per_conn = (sum(last) - sum(first)) * KIB / (n - 1)
        assert per_conn <= 64 * KIB, "%s: %.1f KiB per idle connection" % (name, per_conn / KIB)


def test_ring_memory_cap_keeps_new_connections_tcp_with_reason(idle_conns, tmp_path):
    """Above RDMASOCK_RING_MEMORY_MAX new connections are plain TCP, with the reason on
    the side that ran out; the data of every connection arrives either way."""
    cap = 10 * SEGMENT + SEGMENT // 2
    cli, srv, _, verified = _run_pair(idle_conns, tmp_path, 40, env={"RDMASOCK_RING_MEMORY_MAX": str(cap)})
    assert verified
    assert _kinds(cli) == {("shm", None): 10, ("tcp", "ring_memory_limit"): 30}
    assert sum(1 for c in srv["connections"] if c["transport"] == "shm") == 10
    assert cli["ring_memory"] <= cap and srv["ring_memory"] <= cap and cli["ring_memory_max"] == cap


def test_closed_connections_give_ring_memory_back(idle_conns, tmp_path):
    """Three rounds of 40 connections made and closed under a cap of 10: every round gets
    its 10 shared-memory connections again (closing returns what mapping took, in a
    preloaded process where the engine maps and the program's close unmaps)."""
    cap = 10 * SEGMENT + SEGMENT // 2
    cli, srv, _, verified = _run_pair(idle_conns, tmp_path, 40, rounds=3,
                                      env={"RDMASOCK_RING_MEMORY_MAX": str(cap)})
    assert verified
    assert _kinds(cli) == {("shm", None): 10, ("tcp", "ring_memory_limit"): 30}
    assert cli["ring_memory"] == srv["ring_memory"] == 10 * SEGMENT


@pytest.fixture(scope="module")
def fork_children(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fork") / "fork_children")
    subprocess.run(["gcc", "-O2", "-Wall", "-pthread", "-o", path, os.path.join(HERE, "c", "fork_children.c")],
                   check=True, timeout=120)
    return path


def test_forked_children_share_the_interpreter_until_they_use_it(fork_children, tmp_path):
    """A preloaded process with the engine running forks: a child that never touches a
    socket stays small (Python's after-fork work, which writes ~0.6 MiB of the
    interpreter's pages, waits for the child's first socket), and children whose first
    socket comes from a thread they started, from a grandchild, or from the forking thread
    itself are all upgraded.  A child that serves a connection its parent accepted (a
    PostgreSQL backend) answers the HELLO in C: it stays small too (answered in Python, it
    had ~1.4 MiB of private dirty memory), and the parent's close of its copy leaves the
    connection to the child."""
    log = tmp_path / "log"
    r = subprocess.run(RUN + [fork_children], env=dict(os.environ, RDMASOCK_LOG_FILE=str(log)),
                       capture_output=True, timeout=120)
    out = r.stdout.decode().split("\n")
    assert r.returncode == 0 and r.stderr == b"", (out, r.stderr)
    assert out[1:4] == ["child threaded ok", "child nested ok", "child direct ok"], out
    assert out[5:7] == ["child backend ok", "done"], out
    dirty = int(out[0].split()[1])
    assert 0 < dirty <= 300, "the idle child has %d KiB of private dirty memory" % dirty
    backend = int(out[4].split()[1])
    assert 0 < backend <= 400, "the serving child has %d KiB of private dirty memory" % backend
    lines = open(log).read().splitlines()
    assert len(lines) == 8 and all(l.endswith("transport=shm") for l in lines), lines
    assert sum(" role=server " in l for l in lines) == 4, lines
