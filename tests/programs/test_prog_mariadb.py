"""MariaDB with its own clients (mariadb, mariadb-slap), in every pairing (see conftest.py).
The server speaks first (its greeting), the opposite of PostgreSQL and Redis."""
import hashlib
import os

MARIADB = "/usr/bin/mariadb"
SLAP = "/usr/bin/mariadb-slap"


def sql(ctx, srv, *stmts, timeout=120, **kw):
    argv = [MARIADB, "--no-defaults", "-h", "127.0.0.1", "-P", str(srv.port), "-u", "root",
            "--max-allowed-packet=64M", "--local-infile=1", "-N", "-B"]
    if stmts:
        argv += ["-e", "; ".join(stmts)]
    return ctx.run(argv, timeout=timeout, **kw).stdout.decode()


def test_mariadb_queries_blob_and_load_data(ctx, tmp_path):
    srv = ctx.server("mariadb")
    db = "m_%s" % ctx.pairing
    sql(ctx, srv, "DROP DATABASE IF EXISTS %s" % db, "CREATE DATABASE %s" % db)
    out = sql(ctx, srv, "USE %s" % db,
              "CREATE TABLE t (a INT PRIMARY KEY, b VARCHAR(100))",
              "INSERT INTO t SELECT seq, MD5(seq) FROM seq_1_to_20000",
              "UPDATE t SET a = -a WHERE a % 2 = 0",
              "SELECT COUNT(*), SUM(a), SUM(LENGTH(b)) FROM t")
    odd = sum(g for g in range(1, 20001) if g % 2)
    even = sum(g for g in range(1, 20001) if not g % 2)
    assert out.split() == ["20000", str(odd - even), str(20000 * 32)]
    # a 16 MiB value through one statement each way
    blob = hashlib.sha256(b"mariadb").hexdigest() * ((16 << 20) // 64)
    path = tmp_path / "blob.sql"
    path.write_text("USE %s; CREATE TABLE big (v LONGTEXT); INSERT INTO big VALUES ('%s');" % (db, blob))
    os.chmod(tmp_path, 0o755)
    with open(path, "rb") as f:
        sql(ctx, srv, stdin=f, timeout=180)
    got = sql(ctx, srv, "USE %s" % db, "SELECT v FROM big", timeout=180).strip()
    assert len(got) == len(blob) and hashlib.sha256(got.encode()).digest() == hashlib.sha256(blob.encode()).digest()
    # LOAD DATA LOCAL: the client streams a file to the server inside the protocol
    rows = tmp_path / "rows.tsv"
    rows.write_text("".join("%d\t%s\n" % (i, hashlib.md5(str(i).encode()).hexdigest()) for i in range(100000)))
    out = sql(ctx, srv, "USE %s" % db, "CREATE TABLE l (a INT, b CHAR(32))",
              "LOAD DATA LOCAL INFILE '%s' INTO TABLE l" % rows, "SELECT COUNT(*), SUM(a) FROM l", timeout=180)
    assert out.split() == ["100000", str(100000 * 99999 // 2)]
    sql(ctx, srv, "DROP DATABASE %s" % db)
    ctx.check_transport(srv.port, min_conns=6)


def test_mariadb_slap(ctx):
    srv = ctx.server("mariadb")
    r = ctx.run([SLAP, "--no-defaults", "-h", "127.0.0.1", "-P", str(srv.port), "-u", "root",
                 "--concurrency=40", "--iterations=2", "--number-of-queries=4000", "--auto-generate-sql",
                 "--auto-generate-sql-load-type=mixed", "--create-schema=slap_%s" % ctx.pairing], timeout=240)
    assert b"Average number of seconds to run all queries" in r.stdout, r.stdout
    ctx.check_transport(srv.port, min_conns=40)
