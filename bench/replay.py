"""replay: pgbench's SQL captured from the server log and replayed with `psql -f`, one new
connection per run."""
import os
import re
import time

from . import servers as S
from .common import (PGBENCH, Row, SERVER_CPU, TARGETS, log, ratio_target, run_variants, server_pair,
                     set_ratios, verdict)
from .pgbench import pg_init


_STMT_RE = re.compile(r"\[(\d+)\] LOG:  statement: (.*)$")


def capture_pgbench_sql(srv, dbname, n_tx, path):
    """Runs `pgbench -c 1 -t n_tx` (TPC-B) against srv with log_statement=all for that session
    only (PGOPTIONS), takes the statements of the pgbench client's backend from the server log
    (first BEGIN to last END) and writes them to path as a SQL script; returns the number of
    transactions (BEGIN ... END blocks) in it."""
    mark = S.log_size(srv.out_path)
    env = S.client_env(None, {"PGOPTIONS": "-c log_statement=all"})
    S.run([PGBENCH, "-h", "127.0.0.1", "-p", str(srv.port), "-U", "postgres", "-n", "-c", "1", "-t", str(n_tx),
           dbname], timeout=600, env=env)
    by_pid = {}
    last = None
    with open(srv.out_path, "rb") as f:
        f.seek(mark)
        for line in f.read().decode("utf-8", "replace").splitlines():
            m = _STMT_RE.search(line)
            if m:
                last = by_pid.setdefault(m.group(1), [])
                last.append(m.group(2))
            elif line.startswith("\t") and last:        # continuation of a multi-line statement
                last[-1] += "\n" + line[1:]
            else:
                last = None
    stmts = max(by_pid.values(), key=lambda v: sum(1 for x in v if x.strip().upper() == "BEGIN;"), default=[])
    begins = [i for i, x in enumerate(stmts) if x.strip().upper() == "BEGIN;"]
    ends = [i for i, x in enumerate(stmts) if x.strip().upper() in ("END;", "COMMIT;")]
    if not begins or not ends:
        raise RuntimeError("no pgbench transactions in the server log (log_statement=all); tail:\n"
                           + S.read_tail(srv.out_path, 1500))
    script = stmts[begins[0]:ends[-1] + 1]
    n = sum(1 for x in script if x.strip().upper() == "BEGIN;")
    if n != n_tx:
        raise RuntimeError("captured %d transactions, pgbench ran %d" % (n, n_tx))
    with open(path, "w") as f:
        for x in script:
            f.write(x if x.rstrip().endswith(";") else x + ";")
            f.write("\n")
    return n


def bench_replay(args, ctx):
    """psql -f replay of pgbench's captured TPC-B SQL, one new connection per run."""
    n_tx = 200 if args.quick else args.replay_tx
    impls = ["tcp"] if args.tcp_only else ["tcp", "rdmasock"]
    places, log_file, work = ctx["places"], ctx["log_file"], ctx["work"]
    script = os.path.join(work, "pgbench-tpcb.sql")
    lib = None if args.tcp_only else S.require_preload()
    variants = []
    with server_pair(S.PgServer, impls, log_file) as servers:
        for impl, srv in servers.items():
            pg_init(srv, "replay", 1, impl == "rdmasock", log_file)
        n_tx = capture_pgbench_sql(servers["tcp"], "replay", n_tx, script)
        with open(script) as f:
            n_stmts = sum(1 for _ in f)
        log("captured %d transactions (%d statements) of pgbench TPC-B, scale 1, 1 client -> %s"
            % (n_tx, n_stmts, script))

        def replay(impl, cpu):
            srv = servers[impl]
            env = S.client_env(log_file, {"LD_PRELOAD": lib} if impl == "rdmasock" else None)
            mark = S.log_size(log_file)
            t0 = time.perf_counter()
            S.run(S.pin(cpu) + S.psql_argv(srv.port, "replay") + ["-o", "/dev/null", "-f", script],
                  timeout=600, env=env)
            dt = time.perf_counter() - t0
            return n_tx / dt, ("tcp" if impl == "tcp" else verdict(log_file, mark, srv.port))

        for pl, cpus in places.items():
            for impl in impls:
                variants.append((Row("replay", "psql -f, %s" % ("TCP" if impl == "tcp" else "rdmasock shm"), pl,
                                     cpus, "tx/s", baseline=(impl == "tcp"), rdmasock=(impl == "rdmasock"),
                                     kind=impl), lambda impl=impl, cpus=cpus: replay(impl, cpus[1])))
        for impl in impls:                       # warm-up (not recorded)
            replay(impl, list(places.values())[-1][1])
        log("replay warm-up done")
        rows = run_variants("replay", variants, args.reps, lambda v: "%.1f tx/s" % v)
    set_ratios(rows, "tcp")
    targets = ratio_target(rows, "psql replay of pgbench SQL >= 1.55x TCP best", TARGETS["replay_vs_tcp"])
    return {"rows": rows, "targets": targets,
            "summary": ["pgbench TPC-B scale 1, 1 client, captured with log_statement=all: %d transactions, "
                        "%d statements; each repetition is one `psql -f` (process start and connection set-up "
                        "included); tx/s = transactions / wall seconds; client preloaded with LD_PRELOAD; "
                        "server on CPU %d" % (n_tx, n_stmts, SERVER_CPU)],
            "columns": ["name", "placement", "median", "min", "max", "vs_tcp_best", "status"],
            "title": "replay: pgbench's SQL through psql -f, transactions/s"}
