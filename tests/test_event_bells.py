"""Event bells (EVENT_BELL, docs/PROTOCOL.md 6.12): a preloaded receiver waiting in epoll
adds an eventfd to the program's epoll instance and is woken through it instead of by a
doorbell byte on the TCP socket.  The C tests (tests/c/test_ring.c event_bells*) cover the
ring level: the request bits, the fallback to a byte, a refused descriptor, lost
wake-ups.  These cover real programs: the bell's events never reach the program, the
client sends no doorbell bytes while the server waits in epoll, and peers that do not
speak it (turned off on either side, the Python API) interoperate."""
import os
import re
import resource
import subprocess
import sys

import pytest

from conftest import free_port, recv_exact, stop_process

ROUNDS = 3000

# An echo server waiting in epoll or in poll that looks up every event's descriptor: an
# event it did not register (an event bell leaking out of the hook) fails it.  The
# listener stays registered, so its waits sleep in the kernel, where the bells ring.
# epoll-dup: the first connection is registered a second time, under a dup of its
# descriptor (over TCP both numbers are reported).
SERVER = r"""
import os, select, socket, sys
port, nclients, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
lst = socket.create_server(("127.0.0.1", port))
lst.setblocking(False)
ep = select.poll() if mode == "poll" else select.epoll()
flags = select.EPOLLIN | (select.EPOLLET if mode == "epoll-et" else 0)
twin, closed = {}, set()
ep.register(lst.fileno(), select.EPOLLIN)
def bells_in_epoll():
    if mode == "poll":
        return -1
    n = 0
    for line in open("/proc/self/fdinfo/%d" % ep.fileno()):
        m = line.split()
        if m and m[0] == "tfd:":
            try:
                n += os.readlink("/proc/self/fd/%s" % m[1]) == "anon_inode:[eventfd]"
            except OSError:
                pass
    return n
conns, done, reads, most = {}, 0, 0, -1
print("ready", flush=True)
while done < nclients:
    closed.clear()
    for fd, ev in ep.poll(30000 if mode == "poll" else 30):
        if fd == lst.fileno():
            c, _ = lst.accept()
            c.setblocking(False)
            conns[c.fileno()] = c
            ep.register(c.fileno(), flags)
            if mode == "epoll-dup" and not twin:
                d = socket.socket(fileno=os.dup(c.fileno()))
                conns[d.fileno()] = d
                twin[c.fileno()], twin[d.fileno()] = d.fileno(), c.fileno()
                ep.register(d.fileno(), flags)
            continue
        if fd in closed:
            continue                                    # with its twin, earlier in this round
        c = conns[fd]                                   # KeyError: an event we never asked for
        while True:                                     # edge-triggered: until EAGAIN
            try:
                data = c.recv(65536)
            except BlockingIOError:
                break
            except ConnectionResetError:
                data = b""
            reads += 1
            if reads % 500 == 0:
                most = max(most, bells_in_epoll())
            if not data:
                for f in [fd] + ([twin.pop(fd)] if fd in twin else []):
                    ep.unregister(f)
                    conns.pop(f).close()
                    closed.add(f)
                done += 1
                break
            c.sendall(data)
            if mode != "epoll-et":
                break
print("bells_in_epoll", most, bells_in_epoll(), flush=True)
"""

# A ping-pong client: waits in epoll (preloaded) or in recv (the Python API).  Every tenth
# request waits a millisecond first, so the server is surely asleep in epoll for it.  At
# the end it prints its TCP socket's own count of bytes sent (ss), which doorbell bytes
# would raise.
CLIENT = r"""
import select, socket, subprocess, sys, time
port, rounds, api = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "api"
die = len(sys.argv) > 4                 # killed after the rounds, the connection still open
if api:
    import rdmasock
    c = rdmasock.socket()
    c.connect(("127.0.0.1", port))
else:
    c = socket.create_connection(("127.0.0.1", port))
ep = select.epoll()
ep.register(c.fileno(), select.EPOLLIN)
for i in range(rounds):
    msg = bytes([i % 251]) * 48 + i.to_bytes(16, "little")
    if i % 10 == 0:
        time.sleep(0.001)
    c.sendall(msg)
    got = b""
    while len(got) < len(msg):
        if not api:
            assert ep.poll(10), "no reply in 10 s at round %d" % i
        got += c.recv(len(msg) - len(got))
    assert got == msg, i
if die:
    import os, signal
    print("dying", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
local = c.getsockname()[1]
ss = subprocess.run(["ss", "-Htin", "sport = :%d" % local], capture_output=True, text=True).stdout
print("ss", " ".join(ss.split()), flush=True)
c.close()
print("ok", flush=True)
"""


def _run_pair(tmp_path, server_env, client_env, client_mode="preload", server_mode="epoll", server_prefix=()):
    (tmp_path / "srv.py").write_text(SERVER)
    (tmp_path / "cli.py").write_text(CLIENT)
    log = str(tmp_path / "log")
    port = free_port()
    base = dict(os.environ, RDMASOCK_LOG_FILE=log)
    run = [sys.executable, "-m", "rdmasock", "run", "--", "/usr/bin/python3"]
    srv = subprocess.Popen(["taskset", "-c", "0"] + list(server_prefix) + run + [str(tmp_path / "srv.py"), str(port), "1", server_mode],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(base, **server_env))
    try:
        assert srv.stdout.readline().strip() == "ready", srv.stderr.read()
        if client_mode == "api":
            cmd = [sys.executable, str(tmp_path / "cli.py")]
        else:
            cmd = run + [str(tmp_path / "cli.py")]
        cli = subprocess.run(["taskset", "-c", "0"] + cmd + [str(port), str(ROUNDS), client_mode],
                             capture_output=True, text=True, timeout=120, env=dict(base, **client_env))
        assert cli.returncode == 0 and cli.stdout.strip().endswith("ok") and not cli.stderr, cli.stdout + cli.stderr
        out, err = srv.communicate(timeout=30)
        assert srv.returncode == 0 and not err, out + err
    finally:
        stop_process(srv)
    logged = open(log).read()
    assert logged.count("transport=shm") == 2, logged
    sent = re.search(r"bytes_sent:(\d+)", cli.stdout)
    assert sent, cli.stdout
    most, after = map(int, re.search(r"bells_in_epoll (-?\d+) (-?\d+)", out).groups())
    assert after <= 0, "an event bell stayed in the epoll instance after its connection closed"
    return most, int(sent.group(1))


@pytest.mark.parametrize("client_mode", ["preload", "api"])
def test_server_in_epoll_is_woken_by_its_event_bell(tmp_path, client_mode):
    """Both ends speak EVENT_BELL: the server's bell is in its epoll instance, and the
    client, preloaded or the Python API, rang it instead of sending doorbell bytes: its TCP
    socket sent only the handshake (145 bytes), where the 300 requests the server surely
    slept for would each add a byte.
    Once the connection is closed, the bell has left the instance."""
    bells, sent = _run_pair(tmp_path, {}, {}, client_mode)
    assert bells == 1
    assert sent < 145 + 100, "the client sent %d bytes on its TCP socket: doorbell bytes, not the event bell" % sent


def test_server_in_poll_is_woken_by_doorbell_bytes(tmp_path):
    """A server waiting in poll on its listener and the connection: poll would see an
    event bell's counter as always readable, so it asks for doorbell bytes (at least one
    for each of the 300 requests after a pause), and nothing of the bells reaches it."""
    bells, sent = _run_pair(tmp_path, {}, {}, server_mode="poll")
    assert bells == -1
    assert sent >= 145 + ROUNDS // 10, "only %d bytes sent: how was the server woken?" % sent


@pytest.mark.parametrize("off", ["server", "client"])
def test_event_bells_off_on_either_side(tmp_path, off):
    """RDMASOCK_EVENT_BELL=0 on either side: the feature is not agreed, the connection is
    still shm and byte-exact, and the server is woken by doorbell bytes (one per request
    it slept for: at least the 300 that follow a pause)."""
    env = {"RDMASOCK_EVENT_BELL": "0"}
    bells, sent = _run_pair(tmp_path, env if off == "server" else {}, env if off == "client" else {})
    assert bells == 0
    assert sent >= 145 + ROUNDS // 10, "only %d bytes sent: how was the server woken?" % sent


def test_event_bells_within_the_descriptor_share(tmp_path):
    """A server whose RLIMIT_NOFILE soft limit is 15 may hold one descriptor (an eighth) in
    event bells, less than a connection's two: it makes none, says so in the debug log,
    and the connection is shm and byte-exact, woken by doorbell bytes."""
    bells, sent = _run_pair(tmp_path, {"RDMASOCK_LOG_LEVEL": "debug"}, {},
                            server_prefix=("prlimit", "--nofile=15:%d" % resource.getrlimit(resource.RLIMIT_NOFILE)[1], "--"))
    assert bells == 0
    assert sent >= 145 + ROUNDS // 10, "only %d bytes sent: how was the server woken?" % sent
    assert "event bells not made (doorbell bytes instead): Too many open files" in (tmp_path / "log").read_text()


@pytest.mark.parametrize("server_mode", ["epoll", "epoll-et"])
def test_peer_killed_while_the_server_waits_on_its_bell(tmp_path, server_mode):
    """The client is killed (SIGKILL) with the connection open while the server sleeps in
    epoll, level- or edge-triggered, armed for its event bell: nobody raises the bell; the
    kernel reports the socket, the hook looks at it, and the server's read ends (EOF or
    reset) at once, as over TCP."""
    (tmp_path / "srv.py").write_text(SERVER)
    (tmp_path / "cli.py").write_text(CLIENT)
    port = free_port()
    env = dict(os.environ, RDMASOCK_LOG_FILE=str(tmp_path / "log"))
    run = [sys.executable, "-m", "rdmasock", "run", "--", "/usr/bin/python3"]
    srv = subprocess.Popen(run + [str(tmp_path / "srv.py"), str(port), "1", server_mode],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert srv.stdout.readline().strip() == "ready", srv.stderr.read()
        cli = subprocess.run(run + [str(tmp_path / "cli.py"), str(port), "200", "preload", "die"],
                             capture_output=True, text=True, timeout=60, env=env)
        assert cli.returncode == -9 and "dying" in cli.stdout, cli.stdout + cli.stderr
        out, err = srv.communicate(timeout=20)          # a missed end would leave it waiting
        assert srv.returncode == 0 and not err, out + err
    finally:
        stop_process(srv)
    assert open(tmp_path / "log").read().count("transport=shm") == 2


def _eventfds():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink("/proc/self/fd/" + fd) == "anon_inode:[eventfd]"
        except OSError:
            pass
    return n


def test_api_keeps_only_the_peers_bell(pair):
    """A Python API connection never waits on its own event bell (its program waits for the
    socket in the kernel), so it keeps only the peer's, which it raises: one eventfd per
    end here (both ends in this process), none once both are closed."""
    before = _eventfds()
    c, s = pair()
    c.sendall(b"x")
    assert recv_exact(s, 1) == b"x"
    s.sendall(b"y")
    assert recv_exact(c, 1) == b"y"
    assert c.transport == s.transport == "shm"
    assert _eventfds() - before == 2
    c.close()
    s.close()
    assert _eventfds() == before


# Opens the connections, then sends 32-byte requests on connections picked at random,
# one at a time or in bursts over several, often after a pause long enough for the server
# to sleep with every idle connection armed; every reply must come within 10 s.
MANY_CLIENT = r"""
import random, socket, sys, time
port, nconns, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rnd = random.Random(7)
conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(nconns)]
for c in conns:
    c.settimeout(10)
sent = 0
for r in range(rounds):
    if r % 4 == 0:
        time.sleep(0.002 + rnd.random() * 0.003)
    picked = rnd.sample(range(nconns), 1 if r % 3 else rnd.randint(2, 8))
    for i in picked:
        conns[i].sendall(b"%08d%08d%016d" % (r, i, sent))
        sent += 1
    for i in picked:
        got = b""
        while len(got) < 32:
            got += conns[i].recv(32 - len(got))
        assert got[:16] == b"%08d%08d" % (r, i), (r, i, got)
for c in conns:
    c.close()
print("sent", sent, flush=True)
"""


@pytest.mark.parametrize("mode,nofile", [("epoll", 0), ("epoll-et", 0), ("epoll-dup", 0), ("epoll", 1024)])
def test_many_connections_woken_by_name(tmp_path, mode, nofile):
    """A server waiting in epoll on 300 connections (more than a server's wait looks at on
    every call: idle ones are armed, and only those its bells name are looked at) answers
    every request sent on a connection picked at random, level- or edge-triggered, and with
    one connection registered twice (a dup: its bell can name only one of them).  With a
    soft RLIMIT_NOFILE of 1,024 the server has event bells for 64 connections: the others
    are woken by doorbell bytes, whose kernel events name them by the program's data."""
    (tmp_path / "srv.py").write_text(SERVER)
    (tmp_path / "cli.py").write_text(MANY_CLIENT)
    log = str(tmp_path / "log")
    port, nconns = free_port(), 300
    env = dict(os.environ, RDMASOCK_LOG_FILE=log)
    run = [sys.executable, "-m", "rdmasock", "run", "--", "/usr/bin/python3"]
    limit = ("prlimit", "--nofile=%d:%d" % (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]), "--") if nofile else ()
    srv = subprocess.Popen(list(limit) + run + [str(tmp_path / "srv.py"), str(port), str(nconns), mode],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert srv.stdout.readline().strip() == "ready", srv.stderr.read()
        cli = subprocess.run(run + [str(tmp_path / "cli.py"), str(port), str(nconns), "1500"],
                             capture_output=True, text=True, timeout=180, env=env)
        assert cli.returncode == 0 and not cli.stderr, cli.stdout + cli.stderr
        out, err = srv.communicate(timeout=30)
        assert srv.returncode == 0 and not err, out + err
    finally:
        stop_process(srv)
    assert re.search(r"sent \d+", cli.stdout), cli.stdout
    most = int(re.search(r"bells_in_epoll (-?\d+)", out).group(1))
    if nofile:
        assert 0 < most <= 64, "%d event bells in the epoll instance" % most
    assert open(log).read().count("transport=shm") == 2 * nconns


# Requests back to back, each on the next of the connections in turn: a server whose waits
# spun would find each one within its spin.
RR_CLIENT = r"""
import socket, sys
port, nconns, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(nconns)]
for c in conns:
    c.settimeout(10)
for r in range(rounds):
    c = conns[r % nconns]
    msg = b"%032d" % r
    c.sendall(msg)
    got = b""
    while len(got) < len(msg):
        got += c.recv(len(msg) - len(got))
    assert got == msg, (r, got)
for c in conns:
    c.close()
print("ok", flush=True)
"""


def _switches(pid):
    """(voluntary, involuntary) context switches of pid's main thread."""
    fields = dict(line.split(":", 1) for line in open("/proc/%d/status" % pid))
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])


def test_crowded_server_sleeps_instead_of_spinning(tmp_path):
    """A server waiting in epoll on several connections shares its CPU with a busy loop (in
    its session, so the scheduler weighs them alike); its client runs on the other CPU.
    A spin there would be cut short by the scheduler with no bell asked for, and the next
    request would wait for the busy loop's slice: so its waits do not spin (they sleep in
    the kernel, woken by its bells, or find the next request already there), the server
    is seldom preempted, and every reply comes.  Waits that spun were preempted once per
    request (4,000 of 4,000, and never slept)."""
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    (tmp_path / "srv.py").write_text(SERVER)
    (tmp_path / "cli.py").write_text(RR_CLIENT)
    log = str(tmp_path / "log")
    port, nconns, rounds = free_port(), 4, 4000
    env = dict(os.environ, RDMASOCK_LOG_FILE=log)
    run = [sys.executable, "-m", "rdmasock", "run", "--", "/usr/bin/python3"]
    hog = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"])
    srv = subprocess.Popen(["taskset", "-c", "0"] + run + [str(tmp_path / "srv.py"), str(port), str(nconns), "epoll"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert srv.stdout.readline().strip() == "ready", srv.stderr.read()
        before = _switches(srv.pid)
        cli = subprocess.run(["taskset", "-c", "1"] + run + [str(tmp_path / "cli.py"), str(port), str(nconns), str(rounds)],
                             capture_output=True, text=True, timeout=180, env=env)
        after = _switches(srv.pid)
        assert cli.returncode == 0 and cli.stdout.strip() == "ok" and not cli.stderr, cli.stdout + cli.stderr
        out, err = srv.communicate(timeout=30)
        assert srv.returncode == 0 and not err, out + err
    finally:
        stop_process(srv)
        stop_process(hog)
    assert open(log).read().count("transport=shm") == 2 * nconns
    voluntary, involuntary = after[0] - before[0], after[1] - before[1]
    assert involuntary < rounds // 10, (
        "the crowded server was preempted %d times in %d requests (slept %d times): its waits spun" % (
            involuntary, rounds, voluntary))


BELL_NUMBERS = r"""
import os, resource, socket
soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
ls = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(ls.getsockname())
s, _ = ls.accept()
c.sendall(b"x"); s.recv(1); s.sendall(b"y"); c.recv(1)
bells = []
for fd in os.listdir("/proc/self/fd"):
    try:
        if os.readlink("/proc/self/fd/" + fd) == "anon_inode:[eventfd]":
            bells.append(int(fd))
    except OSError:                       # listdir's own descriptor, closed by now
        pass
print(soft, " ".join(map(str, sorted(bells))))
"""


def test_bells_leave_round_numbers_free(tmp_path):
    """Event bells sit in the top eighth of the descriptor table: CPython's test_epoll
    counts on descriptor 10000 (half these hosts' limit, where the first bell was) being
    closed, and a program may take any number below for its own."""
    log = tmp_path / "log"
    r = subprocess.run([sys.executable, "-m", "rdmasock", "run", "--", "/usr/bin/python3", "-c", BELL_NUMBERS],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, RDMASOCK_LOG_FILE=str(log)))
    assert r.returncode == 0 and not r.stderr, (r.stdout, r.stderr)
    soft, *bells = (int(x) for x in r.stdout.split())
    assert len(bells) == 4, r.stdout                   # both ends in this process: two bells each
    assert all(soft - soft // 8 <= b < soft for b in bells), r.stdout
    assert "transport=shm" in open(log).read()
