"""PostgreSQL 15 with psql and pgbench, in every pairing (see conftest.py)."""
import hashlib
import os
import re

from progutil import S, sha256_file

PSQL = "/usr/bin/psql"
PGBENCH = "/usr/bin/pgbench"


def psql(ctx, srv, *args, timeout=120, dbname="postgres"):
    return ctx.run(S.psql_argv(srv.port, dbname) + ["-A", "-t"] + list(args), timeout=timeout)


def test_psql_queries(ctx):
    srv = ctx.server("pg")
    n = 200_000
    out = psql(ctx, srv,
               "-c", "SELECT sum(g), count(*) FROM generate_series(1, 1000000) g",
               "-c", "SELECT sum(g::numeric * g) FROM generate_series(1, 100000) g",
               "-c", "SELECT g, md5(g::text) FROM generate_series(1, %d) g ORDER BY g" % n,
               "-c", "BEGIN; CREATE TEMP TABLE t (a int, b text); "
                     "INSERT INTO t SELECT g, repeat('x', g % 97) FROM generate_series(1, 5000) g; "
                     "UPDATE t SET a = -a WHERE a % 2 = 0; SELECT sum(a), sum(length(b)) FROM t; COMMIT").stdout
    lines = out.decode().splitlines()
    assert lines[0] == "500000500000|1000000"
    assert lines[1] == str(100000 * 100001 * 200001 // 6)
    rows = lines[2:2 + n]
    expected = ["%d|%s" % (g, hashlib.md5(str(g).encode()).hexdigest()) for g in range(1, n + 1)]
    assert rows == expected, "md5 rows differ (first difference at %d)" % next(
        i for i, (a, b) in enumerate(zip(rows + [""] * n, expected)) if a != b)
    odd = sum(g for g in range(1, 5001) if g % 2)
    even = sum(g for g in range(1, 5001) if not g % 2)
    assert lines[2 + n] == "%d|%d" % (odd - even, sum(g % 97 for g in range(1, 5001)))
    ctx.check_transport(srv.port, min_conns=1)


def test_psql_copy_50mb(ctx, copy_file, tmp_path):
    srv = ctx.server("pg")
    table = "copy_%s" % ctx.pairing
    out_path = str(tmp_path / "copy_out.txt")
    psql(ctx, srv, "-c", "DROP TABLE IF EXISTS %s" % table,
         "-c", "CREATE TABLE %s (id bigint, h text, w text)" % table,
         "-c", "\\copy %s FROM '%s'" % (table, copy_file["path"]), timeout=180)
    res = psql(ctx, srv, "-c", "SELECT count(*), sum(id) FROM %s" % table,
               "-c", "\\copy (SELECT * FROM %s ORDER BY id) TO '%s'" % (table, out_path), timeout=180)
    rows = copy_file["rows"]
    assert res.stdout.decode().split()[0] == "%d|%d" % (rows, rows * (rows - 1) // 2)
    assert os.path.getsize(out_path) == copy_file["size"]
    assert sha256_file(out_path) == copy_file["sha256"]
    psql(ctx, srv, "-c", "DROP TABLE %s" % table)
    ctx.check_transport(srv.port, min_conns=3)


def test_pgbench(ctx):
    srv = ctx.server("pg")
    db = "pgb_%s" % ctx.pairing
    psql(ctx, srv, "-c", "DROP DATABASE IF EXISTS %s" % db, "-c", "CREATE DATABASE %s" % db)
    conn = ["-h", "127.0.0.1", "-p", str(srv.port), "-U", "postgres"]
    init = ctx.run([PGBENCH, "-i", "-s", "1", "-q"] + conn + [db], timeout=120)
    init_out = (init.stdout + init.stderr).decode()
    assert "done in" in init_out, init_out
    assert not re.search(r"error|fatal|abort", init_out, re.I), init_out
    res = ctx.run([PGBENCH, "-T", "5", "-c", "4", "-j", "2"] + conn + [db], timeout=90)
    out = (res.stdout + res.stderr).decode()
    assert not re.search(r"error|fatal|abort", out, re.I), out
    m = re.search(r"^tps = ([\d.]+) \(without initial connection time\)", out, re.M)
    assert m and float(m.group(1)) > 0, out
    assert re.search(r"number of failed transactions: 0 ", out), out
    assert re.search(r"number of clients: 4$", out, re.M), out
    psql(ctx, srv, "-c", "DROP DATABASE %s" % db)
    ctx.check_transport(srv.port, min_conns=4 + 2)
