"""redis-server with redis-cli and redis-benchmark, in every pairing (see conftest.py)."""
import hashlib
import os
import re
import time

import psutil
import pytest

from progutil import S

CLI = "/usr/bin/redis-cli"
BENCH = "/usr/bin/redis-benchmark"


def cli(ctx, srv, *args, timeout=60, **kw):
    return ctx.run([CLI, "-h", "127.0.0.1", "-p", str(srv.port)] + [str(a) for a in args], timeout=timeout, **kw)


def test_redis_cli_commands(ctx):
    srv = ctx.server("redis")
    k = "t:%s:" % ctx.pairing
    script = "\n".join([
        "DEL %sstr %slist %sctr" % (k, k, k),
        "SET %sstr hello-world" % k,
        "GET %sstr" % k,
        "LPUSH %slist a b c" % k,
        "LRANGE %slist 0 -1" % k,
        "INCRBY %sctr 41" % k,
        "INCR %sctr" % k,
        "APPEND %sstr !" % k,
        "GET %sstr" % k,
        "DEL %sstr %slist %sctr" % (k, k, k),
    ]) + "\n"
    out = cli(ctx, srv, input=script.encode()).stdout.decode().split("\n")
    assert out[:12] == ["0", "OK", "hello-world", "3", "c", "b", "a", "41", "42", "12", "hello-world!", "3"], out
    # one command per invocation too (several connections)
    assert cli(ctx, srv, "SET", k + "one", "1").stdout == b"OK\n"
    assert cli(ctx, srv, "GET", k + "one").stdout == b"1\n"
    assert cli(ctx, srv, "DEL", k + "one").stdout == b"1\n"
    ctx.check_transport(srv.port, min_conns=4)


def test_redis_16mb_value(ctx, tmp_path):
    srv = ctx.server("redis")
    value = os.urandom(16 << 20)
    key = "big:%s" % ctx.pairing
    assert cli(ctx, srv, "-x", "SET", key, input=value).stdout == b"OK\n"
    assert cli(ctx, srv, "STRLEN", key).stdout == b"%d\n" % len(value)
    got = cli(ctx, srv, "GET", key).stdout
    assert len(got) == len(value) + 1 and got.endswith(b"\n"), len(got)
    assert hashlib.sha256(got[:-1]).hexdigest() == hashlib.sha256(value).hexdigest()
    cli(ctx, srv, "DEL", key)
    ctx.check_transport(srv.port, min_conns=4)
    # Every client has exited, most without a FIN record (redis-cli just exits).  The idle
    # server must see those ends and not spin on them: once, doorbell bytes a client left
    # unread hid its hang-up, and redis-server's epoll loop ran at 100% of a CPU for good.
    proc = psutil.Process(srv.proc.pid)
    time.sleep(0.5)
    before = sum(proc.cpu_times()[:2])
    time.sleep(1.0)
    assert sum(proc.cpu_times()[:2]) - before < 0.5, "idle redis-server keeps burning CPU"


@pytest.mark.parametrize("pipeline", [1, 16], ids=["P1", "P16"])
def test_redis_benchmark(ctx, pipeline):
    srv = ctx.server("redis")
    argv = [BENCH, "-h", "127.0.0.1", "-p", str(srv.port), "-q", "-n", "20000", "-t", "set,get,lpush", "-c", "50"]
    if pipeline > 1:
        argv += ["-P", str(pipeline)]
    res = ctx.run(argv, timeout=120)
    out = (res.stdout + res.stderr).decode(errors="replace")
    assert not re.search(r"error|refused|reset|closed", out, re.I), out[-2000:]
    rates = dict(re.findall(r"(?:^|[\r\n])\s*(SET|GET|LPUSH): ([\d.]+) requests per second", out))
    assert set(rates) == {"SET", "GET", "LPUSH"}, out[-2000:]
    assert all(float(v) > 0 for v in rates.values()), rates
    cli(ctx, srv, "DEL", "mylist", "key:__rand_int__")
    ctx.check_transport(srv.port, min_conns=50)
