"""pgbench: TPC-B against PostgreSQL, plain vs server and client preloaded."""
import re

from . import servers as S
from .common import (PGBENCH, Row, SERVER_CPU, TARGETS, log, ratio_target, run_variants, server_pair,
                     set_ratios, verdict)



def pg_init(srv, dbname, scale, preload, log_file):
    """CREATE DATABASE dbname and `pgbench -i -s scale` it (client on SERVER_CPU)."""
    log("pgbench -i -s %d %s (%s server)" % (scale, dbname, "rdmasock" if preload else "plain"))
    S.run(S.psql_argv(srv.port) + ["-c", "CREATE DATABASE %s" % dbname], timeout=60, env=S.client_env())
    S.run(S.pin(SERVER_CPU) + S.preload_cmd([PGBENCH, "-h", "127.0.0.1", "-p", str(srv.port), "-U", "postgres",
                                             "-i", "-s", str(scale), "-q", dbname], preload),
          timeout=900, env=S.client_env(log_file))


def pgbench_run(srv, dbname, opts, impl, cpu, log_file, wait=None):
    """One pgbench run (opts: -c/-j/-T/...) against srv, plain (impl "tcp") or preloaded, pinned
    to cpu.  Returns (tps without initial connection time, transport verdict, transactions).
    wait: see S.run(while_running)."""
    mark = S.log_size(log_file)
    argv = S.pin(cpu) + S.preload_cmd([PGBENCH, "-h", "127.0.0.1", "-p", str(srv.port), "-U", "postgres"] + opts
                                      + [dbname], impl == "rdmasock")
    timeout = float(opts[opts.index("-T") + 1]) + 180 if "-T" in opts else 600
    res = S.run(argv, timeout=timeout, env=S.client_env(log_file), while_running=wait)
    out = res.stdout.decode(errors="replace")
    m = re.search(r"^tps = ([\d.]+) \(without initial connection time\)", out, re.M)
    if not m or not re.search(r"number of failed transactions: 0 ", out):
        raise RuntimeError("pgbench output unexpected: " + out[-800:] + res.stderr.decode(errors="replace")[-500:])
    conns = int(opts[opts.index("-c") + 1]) if "-c" in opts else 1
    done = re.search(r"^number of transactions actually processed: (\d+)", out, re.M)
    return (float(m.group(1)), ("tcp" if impl == "tcp" else verdict(log_file, mark, srv.port, conns)),
            int(done.group(1)) if done else None)


def bench_pgbench(args, ctx):
    duration = max(1, round(args.duration or (3 if args.quick else 10)))      # pgbench -T takes whole seconds
    scales = [int(s) for s in args.pg_scales.split(",")]
    clients = [int(c) for c in args.pg_clients.split(",")]
    impls = ["tcp"] if args.tcp_only else ["tcp", "rdmasock"]
    places, log_file = ctx["places"], ctx["log_file"]
    variants = []
    with server_pair(S.PgServer, impls, log_file) as servers:
        for impl, srv in servers.items():
            for sc in scales:
                pg_init(srv, "bench%d" % sc, sc, impl == "rdmasock", log_file)
        for sc in scales:
            for c in clients:
                for pl, cpus in places.items():
                    for impl in impls:
                        def fn(sc=sc, c=c, cpus=cpus, impl=impl):
                            return pgbench_run(servers[impl], "bench%d" % sc, ["-c", str(c), "-j", "1", "-T",
                                                                              str(duration)], impl, cpus[1], log_file)
                        variants.append((Row("pgbench", "TPC-B %s" % ("TCP" if impl == "tcp" else "rdmasock shm"),
                                             pl, cpus, "tps", baseline=(impl == "tcp"), rdmasock=(impl == "rdmasock"),
                                             scale=sc, clients=c, kind=impl), fn))
        for impl in impls:                       # warm-up (not recorded): shared buffers, backends, caches
            pgbench_run(servers[impl], "bench%d" % scales[0], ["-c", str(max(clients)), "-j", "1", "-T",
                                                               "1" if args.quick else "3"],
                        impl, list(places.values())[-1][1], log_file)
        log("pgbench warm-up done")
        rows = run_variants("pgbench", variants, args.reps, lambda v: "%.1f tps" % v)
    set_ratios(rows, "tcp", keys=("scale", "clients"))
    targets = []
    for sc in scales:
        targets += ratio_target(rows, "pgbench scale %d, 1 client >= 1.7x TCP best" % sc, TARGETS["pgbench_c1_vs_tcp"],
                                scale=sc, clients=1)
    return {"rows": rows, "targets": targets,
            "summary": ["synchronous_commit=off, fsync=off; server on CPU %d; pgbench -j 1 -T %d; cpu_us: CPU time "
                        "(user + system) of pgbench and both servers' processes per transaction" % (SERVER_CPU, duration)],
            "columns": ["scale", "clients", "name", "placement", "median", "min", "max", "cpu_us", "vs_tcp_best", "status"],
            "title": "pgbench TPC-B, tps"}
