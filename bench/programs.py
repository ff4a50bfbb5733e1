"""redis-benchmark over plain TCP vs under rdmasock (LD_PRELOAD), same run, pinned.

    .venv/bin/python bench/programs.py [--reps 3] [--conns 1,50] [--tests get,set,ping_inline]
                                       [--placements same,cross] [--tcp-only] [--quick]

Two redis-servers (bench/servers.py) on 127.0.0.1, pinned to CPU 0: one plain, one under
`rdmasock run`.  redis-benchmark (`-t get,set,ping_inline -c <conns> --csv`) runs plain
against the plain server and preloaded against the preloaded one, interleaved repetition by
repetition (same-run baseline), on CPU 0 ("same") or CPU 1 ("cross").  Reported: median
requests/s per (test, conns, placement, impl) and rdmasock/tcp.  rdmasock runs are checked in
RDMASOCK_LOG_FILE: unless every benchmark connection was transport=shm the cell is marked
fallback.  JSON: bench/results/programs-<time>.json and programs-latest.json (or --out)."""
import argparse
import csv
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import servers as S  # noqa: E402

RESULTS = os.path.join(HERE, "results")
BENCH = "/usr/bin/redis-benchmark"
SERVER_CPU = 0


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def requests_for(conns, quick):
    n = 20000 if conns == 1 else 100000
    return n // 4 if quick else n


def run_bench(srv, tests, conns, n, preload, cpu, log_file):
    argv = S.pin(cpu) + S.preload_cmd([BENCH, "-h", "127.0.0.1", "-p", str(srv.port), "-t", ",".join(tests),
                                       "-c", str(conns), "-n", str(n), "--csv"], preload)
    res = S.run(argv, timeout=300, env=S.client_env(log_file))
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
        raise S.ServerError("redis-benchmark output lacks %s:\n%s\n%s"
                            % (sorted(want - set(rates)), out[-1500:], res.stderr.decode()[-1000:]))
    return {t: rates[t] for t in want}


def transport_of(log_file, mark, port, conns):
    recs = [r for r in S.parse_log(log_file, mark) if r["role"] == "client" and S.addr_port(r["peer"]) == port]
    if len(recs) < conns:
        return "unverified: %d client lines for %d connections" % (len(recs), conns)
    bad = [r for r in recs if r["transport"] != "shm"]
    if bad:
        return "fallback: " + ",".join(sorted({"%s/%s" % (r["transport"], r["reason"]) for r in bad}))
    return "shm"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--conns", default="1,50")
    ap.add_argument("--tests", default="get,set,ping_inline")
    ap.add_argument("--placements", default="same,cross")
    ap.add_argument("--tcp-only", action="store_true", help="only the plain TCP side (checks the harness)")
    ap.add_argument("--quick", action="store_true", help="1 repetition, fewer requests (smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = 1
    tests = [t.strip() for t in args.tests.split(",") if t.strip()]
    conns_list = [int(c) for c in args.conns.split(",")]
    impls = ["tcp"] if args.tcp_only else ["tcp", "rdmasock"]
    if "rdmasock" in impls:
        ok, msg = S.preload_status()
        if not ok:
            sys.exit("programs: the preload library is not usable (use --tcp-only to run the TCP side): " + msg)
    places = {"same": SERVER_CPU}
    if (os.cpu_count() or 1) > 1:
        places["cross"] = 1
    places = {k: v for k, v in places.items() if k in args.placements.split(",")}

    work = tempfile.mkdtemp(prefix="rs-progbench-")
    log_file = S.make_log_file(os.path.join(work, "log"), "rdmasock.log")
    servers = {}
    runs = {}           # (test, conns, placement, impl) -> [rps]
    trans = {}          # (conns, placement, impl) -> [transport verdicts]
    try:
        for impl in impls:
            servers[impl] = S.RedisServer(preload=(impl == "rdmasock"), cpu=SERVER_CPU, log_file=log_file).start()
            log("redis-server (%s) on port %d, CPU %d" % (impl, servers[impl].port, SERVER_CPU))
        for rep in range(args.reps):
            for conns in conns_list:
                for pl, cpu in places.items():
                    for impl in impls:
                        srv = servers[impl]
                        mark = S.log_size(log_file)
                        rates = run_bench(srv, tests, conns, requests_for(conns, args.quick), impl == "rdmasock",
                                          cpu, log_file)
                        tr = "tcp" if impl == "tcp" else transport_of(log_file, mark, srv.port, conns)
                        trans.setdefault((conns, pl, impl), []).append(tr)
                        for t, v in rates.items():
                            runs.setdefault((t, conns, pl, impl), []).append(v)
                        log("rep %d -c %-3d %-5s %-8s %s  (%s)" % (rep + 1, conns, pl, impl, "  ".join(
                            "%s=%.0f" % kv for kv in sorted(rates.items())), tr))
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)

    result = {"benchmark": "redis-benchmark", "tests": tests, "reps": args.reps, "server_cpu": SERVER_CPU,
              "host": platform.node(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cells": []}
    print("\nredis-benchmark, requests/s, median of %d (server on CPU %d)" % (args.reps, SERVER_CPU))
    print("%-12s %5s %-6s %12s %12s %8s  %s" % ("test", "conns", "place", "tcp", "rdmasock", "ratio", "transport"))
    for t in sorted({k[0] for k in runs}):
        for conns in conns_list:
            for pl in places:
                tcp = statistics.median(runs[(t, conns, pl, "tcp")])
                cell = {"test": t, "conns": conns, "placement": pl, "cpus": [SERVER_CPU, places[pl]],
                        "tcp_runs": runs[(t, conns, pl, "tcp")], "tcp_median": tcp}
                line = "%-12s %5d %-6s %12.0f" % (t, conns, pl, tcp)
                if "rdmasock" in impls:
                    rs = statistics.median(runs[(t, conns, pl, "rdmasock")])
                    trs = trans[(conns, pl, "rdmasock")]
                    verified = all(x == "shm" for x in trs)
                    cell.update({"rdmasock_runs": runs[(t, conns, pl, "rdmasock")], "rdmasock_median": rs,
                                 "ratio": round(rs / tcp, 3), "transport": trs, "verified_shm": verified})
                    line += " %12.0f %7.2fx  %s" % (rs, rs / tcp, ",".join(sorted(set(trs))))
                result["cells"].append(cell)
                print(line)
    os.makedirs(RESULTS, exist_ok=True)
    out = args.out or os.path.join(RESULTS, "programs-%s.json" % time.strftime("%Y%m%d-%H%M%S"))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    if args.out is None:
        with open(os.path.join(RESULTS, "programs-latest.json"), "w") as f:
            json.dump(result, f, indent=1)
    print("JSON: %s" % out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
