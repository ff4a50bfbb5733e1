"""pgbench demo: PostgreSQL 15 over plain TCP vs under rdmasock (LD_PRELOAD), same run, pinned.

    .venv/bin/python bench/pgbench_demo.py [--reps 3] [--duration 10] [--placements same,cross]
                                           [--tcp-only] [--quick]

Two fresh clusters (bench/servers.py; fsync=off, synchronous_commit=off) on 127.0.0.1:
one plain, one started under `rdmasock run`.  Both are initialised with `pgbench -i -s 1`;
then TPC-B `pgbench -c 1 -T <duration>` runs against each, plain pgbench against the plain
server and preloaded pgbench against the preloaded one, interleaved repetition by
repetition so both see the same machine state.  The server (postmaster and its backends)
is pinned to CPU 0 with taskset; pgbench runs on CPU 0 ("same") or CPU 1 ("cross").
Reported: the median tps of the repetitions for each (impl, placement), and the speed-up.
For every rdmasock run the RDMASOCK_LOG_FILE lines are checked: a run whose connections
were not all transport=shm is marked as fallback, and no speed-up is claimed from it.
JSON goes to bench/results/pgbench-<time>.json and bench/results/pgbench-latest.json (or --out)."""
import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import servers as S  # noqa: E402

RESULTS = os.path.join(HERE, "results")
PGBENCH = "/usr/bin/pgbench"
SERVER_CPU = 0


def placements(wanted):
    p = {"same": (SERVER_CPU, SERVER_CPU)}
    if (os.cpu_count() or 1) > 1:
        p["cross"] = (SERVER_CPU, 1)
    return {k: v for k, v in p.items() if k in wanted}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def pgbench(srv, args, preload, cpu, log_file, timeout):
    argv = S.pin(cpu) + S.preload_cmd([PGBENCH, "-h", "127.0.0.1", "-p", str(srv.port), "-U", "postgres"]
                                      + args + ["bench"], preload)
    return S.run(argv, timeout=timeout, env=S.client_env(log_file))


def transport_of(log_file, mark, port):
    """'shm' if every client line about port since mark is shm, else 'fallback: <reasons>'."""
    recs = [r for r in S.parse_log(log_file, mark)
            if r["role"] == "client" and S.addr_port(r["peer"]) == port]
    if not recs:
        return "unverified: no client lines in RDMASOCK_LOG_FILE"
    bad = [r for r in recs if r["transport"] != "shm"]
    if bad:
        return "fallback: " + ",".join(sorted({"%s/%s" % (r["transport"], r["reason"]) for r in bad}))
    return "shm"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per cell (median reported; 3-5)")
    ap.add_argument("--duration", type=int, default=10, help="pgbench -T seconds")
    ap.add_argument("--clients", type=int, default=1, help="pgbench -c")
    ap.add_argument("--placements", default="same,cross")
    ap.add_argument("--tcp-only", action="store_true", help="only the plain TCP side (checks the harness)")
    ap.add_argument("--quick", action="store_true", help="1 repetition of 3 s (smoke run)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/pgbench-<time>.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.duration = 1, 3
    impls = ["tcp"] if args.tcp_only else ["tcp", "rdmasock"]
    if "rdmasock" in impls:
        ok, msg = S.preload_status()
        if not ok:
            sys.exit("pgbench_demo: the preload library is not usable (use --tcp-only to run the TCP side): "
                     + msg)
    places = placements(args.placements.split(","))
    work = tempfile.mkdtemp(prefix="rs-pgbench-")
    log_file = S.make_log_file(os.path.join(work, "log"), "rdmasock.log")
    servers = {}
    cells = {(impl, pl): [] for impl in impls for pl in places}
    transports = {(impl, pl): [] for impl in impls for pl in places}
    try:
        for impl in impls:
            log("starting PostgreSQL (%s) on CPU %d" % (impl, SERVER_CPU))
            srv = S.PgServer(preload=(impl == "rdmasock"), cpu=SERVER_CPU, log_file=log_file)
            servers[impl] = srv.start()
            S.run(S.psql_argv(srv.port) + ["-c", "CREATE DATABASE bench"], timeout=60, env=S.client_env())
            pgbench(srv, ["-i", "-s", "1", "-q"], impl == "rdmasock", SERVER_CPU, log_file, 300)
        for rep in range(args.reps):
            for pl, (_, client_cpu) in places.items():
                for impl in impls:
                    srv = servers[impl]
                    mark = S.log_size(log_file)
                    res = pgbench(srv, ["-c", str(args.clients), "-j", "1", "-T", str(args.duration)],
                                  impl == "rdmasock", client_cpu, log_file, args.duration + 120)
                    out = res.stdout.decode(errors="replace")
                    m = re.search(r"^tps = ([\d.]+) \(without initial connection time\)", out, re.M)
                    if not m or not re.search(r"number of failed transactions: 0 ", out):
                        raise S.ServerError("pgbench output unexpected:\n" + out[-2000:] + res.stderr.decode()[-1000:])
                    tps = float(m.group(1))
                    tr = "tcp" if impl == "tcp" else transport_of(log_file, mark, srv.port)
                    cells[(impl, pl)].append(tps)
                    transports[(impl, pl)].append(tr)
                    log("rep %d %-5s %-8s %9.1f tps  (%s)" % (rep + 1, pl, impl, tps, tr))
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)

    result = {"benchmark": "pgbench TPC-B scale 1", "clients": args.clients, "duration_s": args.duration,
              "reps": args.reps, "server_cpu": SERVER_CPU, "synchronous_commit": "off", "fsync": "off",
              "host": platform.node(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cells": [], "speedup": {}}
    print("\npgbench TPC-B scale 1, -c %d -T %d, synchronous_commit=off, median of %d (server on CPU %d)"
          % (args.clients, args.duration, args.reps, SERVER_CPU))
    print("%-6s %-9s %10s   %s" % ("place", "impl", "tps", "runs / transport"))
    med = {}
    for (impl, pl), runs in cells.items():
        med[(impl, pl)] = statistics.median(runs)
        trs = transports[(impl, pl)]
        result["cells"].append({"impl": impl, "placement": pl, "cpus": list(places[pl]), "tps_runs": runs,
                                "tps_median": med[(impl, pl)], "transport": trs})
        print("%-6s %-9s %10.1f   %s  %s" % (pl, impl, med[(impl, pl)], " ".join("%.0f" % r for r in runs),
                                              ",".join(sorted(set(trs)))))
    if "rdmasock" in impls:
        for pl in places:
            verified = all(t == "shm" for t in transports[("rdmasock", pl)])
            sp = med[("rdmasock", pl)] / med[("tcp", pl)]
            result["speedup"][pl] = {"ratio": round(sp, 3), "verified_shm": verified}
            print("speed-up %-5s rdmasock/tcp = %.2fx%s" % (pl, sp, "" if verified else
                                                            "  (NOT upgraded: see transport column)"))
        best_r = max(med[("rdmasock", pl)] for pl in places)
        best_t = max(med[("tcp", pl)] for pl in places)
        result["speedup"]["best_vs_best"] = round(best_r / best_t, 3)
        print("speed-up best placement vs best placement = %.2fx" % (best_r / best_t))
    os.makedirs(RESULTS, exist_ok=True)
    out = args.out or os.path.join(RESULTS, "pgbench-%s.json" % time.strftime("%Y%m%d-%H%M%S"))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    if args.out is None:
        with open(os.path.join(RESULTS, "pgbench-latest.json"), "w") as f:
            json.dump(result, f, indent=1)
    print("JSON: %s" % out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
