"""redis: redis-benchmark PING_INLINE, GET, SET with -c 1 and -c 50, plain vs preloaded."""
import csv
import io

from . import servers as S
from .common import (REDIS_BENCHMARK, Row, RowGroup, SERVER_CPU, TARGETS, log, ratio_target, run_variants,
                     server_pair, set_ratios, verdict)



def redis_requests(conns, quick):
    """redis-benchmark -n for the redis sub-benchmark."""
    n = 20000 if conns == 1 else 100000
    return n // 4 if quick else n


def redis_run(srv, tests, conns, n, impl, cpu, log_file, wait=None):
    """One `redis-benchmark -t TESTS -c conns -n n --csv` against srv, plain or preloaded, pinned
    to cpu.  Returns ({TEST: requests/s}, transport verdict, requests made).  wait: see S.run(while_running)."""
    mark = S.log_size(log_file)
    argv = S.pin(cpu) + S.preload_cmd([REDIS_BENCHMARK, "-h", "127.0.0.1", "-p", str(srv.port), "-t",
                                       ",".join(tests), "-c", str(conns), "-n", str(n), "--csv"], impl == "rdmasock")
    res = S.run(argv, timeout=300, env=S.client_env(log_file), while_running=wait)
    out = res.stdout.decode(errors="replace")
    rates = {}
    for row in csv.reader(io.StringIO(out)):
        if len(row) >= 2 and row[0] != "test":
            try:
                rates[row[0].split()[0].upper()] = float(row[1])
            except ValueError:
                pass
    want = {t.upper() for t in tests}
    if not want <= set(rates):
        raise RuntimeError("redis-benchmark output lacks %s:\n%s\n%s"
                           % (sorted(want - set(rates)), out[-1500:], res.stderr.decode(errors="replace")[-1000:]))
    return ({t: rates[t] for t in want}, ("tcp" if impl == "tcp" else verdict(log_file, mark, srv.port, conns)),
            n * len(want))


def bench_redis(args, ctx):
    tests = [t.strip().lower() for t in args.redis_tests.split(",") if t.strip()]
    conns_list = [int(c) for c in args.redis_conns.split(",")]
    impls = ["tcp"] if args.tcp_only else ["tcp", "rdmasock"]
    places, log_file = ctx["places"], ctx["log_file"]
    variants = []
    with server_pair(S.RedisServer, impls, log_file) as servers:
        for conns in conns_list:
            for pl, cpus in places.items():
                for impl in impls:
                    group = RowGroup("redis -c %d %s" % (conns, impl), pl, {t.upper(): Row(
                        "redis", t.upper(), pl, cpus, "req/s", baseline=(impl == "tcp"), rdmasock=(impl == "rdmasock"),
                        conns=conns, impl=impl, kind=impl) for t in tests})

                    def fn(conns=conns, cpus=cpus, impl=impl):
                        return redis_run(servers[impl], tests, conns, redis_requests(conns, args.quick), impl,
                                         cpus[1], log_file)
                    variants.append((group, fn))
        for impl in impls:                       # warm-up (not recorded): connections, caches, CPU clocks
            for conns in conns_list:
                redis_run(servers[impl], tests, conns, 2000 if conns == 1 else 10000, impl,
                          list(places.values())[-1][1], log_file)
        log("redis warm-up done")
        rows = run_variants("redis", variants, args.reps,
                            lambda v: "  ".join("%s %.0f" % kv for kv in sorted(v.items())) + " req/s")
    set_ratios(rows, "tcp", keys=("name", "conns"))
    targets = ratio_target(rows, "redis-benchmark GET -c 1 >= 2x TCP best", TARGETS["redis_get_c1_vs_tcp"],
                           name="GET", conns=1)
    return {"rows": rows, "summary": ["server on CPU %d; redis-benchmark -n %s, no pipelining; cpu_us: CPU time (user + "
                                      "system) of redis-benchmark and both servers per request, all tests of a run "
                                      "together" % (
                SERVER_CPU, ",".join(str(redis_requests(c, args.quick)) for c in conns_list))],
            "targets": targets,
            "columns": ["name", "conns", "placement", "impl", "median", "min", "max", "cpu_us", "vs_tcp_best", "status"],
            "title": "redis-benchmark, requests/s"}
