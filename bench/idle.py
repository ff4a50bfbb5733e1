"""idle: the CPU that N upgraded connections burn while nothing moves on them.

A preloaded client opens N connections to redis-server, makes one request on each (so each
has carried data both ways and is past any handshake), then sleeps in a read of its stdin.
The CPU time (user + system) of the client and of the server's processes over the next
--idle-seconds is the row's figure, as a percentage of one CPU; TCP's is the baseline."""
import subprocess
import time

import psutil

from . import servers as S
from .common import RUN_TIMEOUT, Row, read_line, run_variants, server_pair, servers_cpu_s, stop, target, verdict


IDLE_TARGET_PCT = 1.0          # issue 18 point 2: 100 idle connections for 10 s use < 1% of one CPU

CLIENT = r"""
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"PING\r\n")
    got = b""
    while not got.endswith(b"\r\n"):
        chunk = s.recv(64)
        if not chunk:
            sys.exit("redis closed a connection during its first request")
        got += chunk
    if got != b"+PONG\r\n":
        sys.exit("unexpected answer %r" % got)
    held.append(s)
sys.stdout.write("ready\n")
sys.stdout.flush()
sys.stdin.read()
"""


def tree_cpu_s(pid):
    """User + system CPU seconds of pid and its descendants (those still running)."""
    total = 0.0
    for p in S.process_tree(pid):
        try:
            t = psutil.Process(p).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def idle_run(srv, impl, conns, seconds, cpu, log_file):
    """One idle window: returns (percent of one CPU, transport verdict)."""
    mark = S.log_size(log_file)
    argv = S.pin(cpu) + S.preload_cmd([S.VENV_PY, "-c", CLIENT, str(srv.port), str(conns)], impl == "rdmasock")
    client = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=S.client_env(log_file), start_new_session=True)
    try:
        if read_line(client, RUN_TIMEOUT) != "ready":
            S.kill_tree(client)                 # its stderr ends with it: the read below is bounded
            raise RuntimeError("idle client did not get ready: %s" % S._tail(client.stderr.read()))
        cpu0, t0 = tree_cpu_s(client.pid) + servers_cpu_s(), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = tree_cpu_s(client.pid) + servers_cpu_s(), time.monotonic()
        client.stdin.close()
        if client.wait(RUN_TIMEOUT) != 0:
            raise RuntimeError("idle client failed: %s" % S._tail(client.stderr.read()))
    finally:
        stop(client)
    pct = (cpu1 - cpu0) / (t1 - t0) * 100
    return pct, ("tcp" if impl == "tcp" else verdict(log_file, mark, srv.port, conns))


def bench_idle(args, ctx):
    conns, seconds = args.idle_conns, args.idle_seconds or (2.0 if args.quick else 10.0)
    impls = ["tcp"] if args.tcp_only else ["tcp", "rdmasock"]
    places, log_file = ctx["places"], ctx["log_file"]
    pl = "cross" if "cross" in places else list(places)[-1]
    cpus = places[pl]
    variants = []
    with server_pair(S.RedisServer, impls, log_file, cpu=cpus[0]) as servers:
        for impl in impls:
            def fn(impl=impl):
                return idle_run(servers[impl], impl, conns, seconds, cpus[1], log_file)
            variants.append((Row("idle", "redis-server, %d idle connections, %s" % (
                conns, "TCP" if impl == "tcp" else "rdmasock shm"), pl, cpus, "% of one CPU",
                baseline=(impl == "tcp"), rdmasock=(impl == "rdmasock"), kind=impl, conns=conns), fn))
        rows = run_variants("idle", variants, args.reps, lambda v: "%.2f%% of one CPU" % v)
    targets = [target("%d idle upgraded connections use < %.0f%% of one CPU" % (conns, IDLE_TARGET_PCT),
                      r["median"], IDLE_TARGET_PCT, "%.2f%%", at_most=True)
               for r in rows if r["kind"] == "rdmasock" and r["median"] is not None and r["status"] == "ok"]
    return {"rows": rows, "targets": targets,
            "summary": ["server on CPU %s, client on CPU %s; each of the %d connections made one PING first; "
                        "CPU (user + system) of the client and the server's processes over %.0f s of no traffic"
                        % (cpus[0], cpus[1], conns, seconds)],
            "columns": ["name", "conns", "placement", "median", "min", "max", "status"],
            "title": "idle: CPU burned by idle connections, % of one CPU (lower is better)"}
