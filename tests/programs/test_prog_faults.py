"""Faults: one side of a real program pairing is SIGKILLed mid-stream; the other side must
get EOF or an error within FAULT_S seconds (bounded waits, no hang), in every pairing.
Each test starts its own server (killing a shared one would spoil other tests).

Client killed -> the server must drop the connection (its processes hold no socket from
the dead client's port any more; for PostgreSQL the backend exits), and keep serving.
Server killed -> the client program must exit with an error (the echo client: every
connection sees EOF or an error)."""
import json
import subprocess
import os
import time

from progutil import (ECHO_PROG, S, client_ports, kill_client, read_line, read_some, wait_exit,
                      wait_server_closed)

FAULT_S = 10.0        # "within seconds"
START_S = 20.0        # bound for the streaming to get going


def _wait_streaming(srv, proc, min_conns=1):
    """Waits until the client tree of proc has min_conns connections to the server."""
    ok = S.wait_until(lambda: len(client_ports(proc, srv.port)) >= min_conns or proc.poll() is not None,
                      START_S, 0.05)
    assert ok and proc.poll() is None, "client did not start streaming (exit %s): %s" % (
        proc.poll(), proc.stderr.read().decode(errors="replace")[-1500:] if proc.poll() is not None else "")
    return client_ports(proc, srv.port)


def _assert_client_failed(proc, what):
    took = wait_exit(proc, FAULT_S)
    assert took is not None, "%s: the client did not notice the dead server within %s s (still running)" % (
        what, FAULT_S)
    assert proc.returncode != 0, "%s: client exited 0 although the server died mid-stream" % what
    return took


def _assert_server_dropped(srv, ports, what):
    took, left = wait_server_closed(srv, ports, FAULT_S)
    assert took is not None, "%s: the server still holds the dead client's connection(s) after %s s: %s" % (
        what, FAULT_S, left)
    return took


# --- PostgreSQL ------------------------------------------------------------------------------

BIG_COPY = "\\copy (SELECT g, repeat('x', 200) FROM generate_series(1, 20000000) g) TO STDOUT"


def test_pg_psql_killed_during_copy_out(ctx):
    srv = ctx.fresh_server("pg")
    proc = ctx.popen(S.psql_argv(srv.port) + ["-c", BIG_COPY], stdout=subprocess.PIPE)
    assert len(read_some(proc.stdout, 256 * 1024, START_S)) == 256 * 1024, "COPY did not start"
    time.sleep(0.5)                    # psql stops reading: the backend blocks on a full connection
    ports = _wait_streaming(srv, proc)
    backends = srv.backend_pids()
    assert backends, "no backend found for the COPY"
    ctx.check_transport(srv.port, min_conns=1)
    kill_client(proc)
    _assert_server_dropped(srv, ports, "psql SIGKILLed during COPY out")
    assert S.wait_until(lambda: not any(S.pid_alive(p) for p in backends), FAULT_S), \
        "backend(s) %s still alive %s s after their client died" % (backends, FAULT_S)
    assert ctx.run(S.psql_argv(srv.port) + ["-A", "-t", "-c", "SELECT 6*7"], timeout=30).stdout == b"42\n"


def test_pg_backend_killed_during_copy_out(ctx):
    srv = ctx.fresh_server("pg")
    proc = ctx.popen(S.psql_argv(srv.port) + ["-c", BIG_COPY])          # stdout to /dev/null: full speed
    _wait_streaming(srv, proc)
    assert S.wait_until(srv.backend_pids, START_S), "no backend found for the COPY"
    backends = srv.backend_pids()
    time.sleep(0.5)
    ctx.check_transport(srv.port, min_conns=1)
    assert proc.poll() is None, "COPY finished before the fault"
    S.kill_pids(backends)
    _assert_client_failed(proc, "backend SIGKILLed during COPY out")
    err = proc.stderr.read().decode(errors="replace")
    assert "connection" in err or "terminat" in err, err


# --- redis -----------------------------------------------------------------------------------

def _redis_with_big_value(ctx):
    srv = ctx.fresh_server("redis")
    value = os.urandom(16 << 20)
    assert ctx.run(["/usr/bin/redis-cli", "-h", "127.0.0.1", "-p", str(srv.port), "-x", "SET", "big"],
                   timeout=60, input=value).stdout == b"OK\n"
    return srv


def _redis_get_loop(ctx, srv):
    return ctx.popen(["/usr/bin/redis-cli", "-h", "127.0.0.1", "-p", str(srv.port), "-r", "100000", "GET", "big"])


def test_redis_server_killed_during_big_get(ctx):
    srv = _redis_with_big_value(ctx)
    proc = _redis_get_loop(ctx, srv)
    _wait_streaming(srv, proc)
    time.sleep(0.5)
    ctx.check_transport(srv.port, min_conns=2)
    srv.kill()
    _assert_client_failed(proc, "redis-server SIGKILLed during GET of 16 MB")


def test_redis_cli_killed_during_big_get(ctx):
    srv = _redis_with_big_value(ctx)
    proc = _redis_get_loop(ctx, srv)
    ports = _wait_streaming(srv, proc)
    time.sleep(0.5)
    ctx.check_transport(srv.port, min_conns=2)
    kill_client(proc)
    _assert_server_dropped(srv, ports, "redis-cli SIGKILLed during GET of 16 MB")
    assert ctx.run(["/usr/bin/redis-cli", "-h", "127.0.0.1", "-p", str(srv.port), "PING"],
                   timeout=30).stdout == b"PONG\n"


# --- curl / http.server ----------------------------------------------------------------------

def _curl(ctx, srv, http_dir, rate):
    return ctx.popen(["/usr/bin/curl", "-sS", "--fail", "--max-time", "120", "--limit-rate", rate, "-o",
                      "/dev/null", "http://127.0.0.1:%d/%s" % (srv.port, http_dir["big"])])


def test_http_server_killed_during_curl(ctx, http_dir):
    srv = ctx.fresh_server("http")
    proc = _curl(ctx, srv, http_dir, "20M")
    _wait_streaming(srv, proc)
    time.sleep(1.0)
    ctx.check_transport(srv.port, min_conns=1)
    srv.kill()
    _assert_client_failed(proc, "http.server SIGKILLed during a 100 MB download")


def test_curl_killed_during_download(ctx, http_dir):
    srv = ctx.fresh_server("http")
    proc = _curl(ctx, srv, http_dir, "5M")
    ports = _wait_streaming(srv, proc)
    time.sleep(1.0)
    ctx.check_transport(srv.port, min_conns=1)
    kill_client(proc)
    _assert_server_dropped(srv, ports, "curl SIGKILLed during a 100 MB download")
    res = ctx.run(["/usr/bin/curl", "-sS", "--fail", "--max-time", "30", "http://127.0.0.1:%d/small.txt" % srv.port],
                  timeout=40)
    assert res.stdout == b"hello from http.server\n"


# --- threaded echo program -------------------------------------------------------------------

STREAMS = 20


def _echo_stream(ctx, srv):
    proc = ctx.popen([S.SYS_PY, ECHO_PROG, "stream", str(srv.port), str(STREAMS)], stdout=subprocess.PIPE)
    line = read_line(proc.stdout, START_S)
    assert line == "streaming", "echo stream client did not start: %r %s" % (
        line, proc.stderr.read().decode(errors="replace")[-1500:] if proc.poll() is not None else "")
    return proc


def test_echo_server_killed_while_streaming(ctx):
    srv = ctx.fresh_server("echo")
    proc = _echo_stream(ctx, srv)
    ctx.check_transport(srv.port, min_conns=STREAMS)
    srv.kill()
    took = wait_exit(proc, FAULT_S)
    assert took is not None, "echo client still running %s s after the server died" % FAULT_S
    summary = read_line(proc.stdout, 5)
    assert proc.returncode == 0, "not every connection saw EOF/error: %s" % summary
    assert json.loads(summary)["n"] == STREAMS


def test_echo_client_killed_while_streaming(ctx):
    srv = ctx.fresh_server("echo")
    proc = _echo_stream(ctx, srv)
    ports = client_ports(proc, srv.port)
    assert len(ports) == STREAMS, ports
    ctx.check_transport(srv.port, min_conns=STREAMS)
    kill_client(proc)
    _assert_server_dropped(srv, ports, "echo client SIGKILLed while streaming")
    res = ctx.run([S.SYS_PY, ECHO_PROG, "client", str(srv.port), "5", "100000"], timeout=60)
    assert json.loads(res.stdout.decode().strip().splitlines()[-1])["ok"] == 5
