"""pgbench demo: PostgreSQL 15 over plain TCP vs under rdmasock (LD_PRELOAD), same run, pinned.

    rdmasock demo [--reps 3] [--duration 10] [--clients 1] [--placements same,cross] [--tcp-only] [--quick]
    python -m rdmasock.bench.pgbench_demo [same arguments]

The `pgbench` sub-benchmark of the suite (`rdmasock bench pgbench`), scale 1 and one
client count, with the demo's own report: two fresh clusters (fsync=off,
synchronous_commit=off) on 127.0.0.1, one plain, one started under `rdmasock run`; TPC-B
`pgbench -c <clients> -T <duration>` runs plain against the plain server and preloaded against
the preloaded one, after an unrecorded warm-up, interleaved repetition by repetition so both
see the same machine state.  The server is pinned to CPU 0 with taskset; pgbench runs on
CPU 0 ("same") or CPU 1 ("cross").  Reported: the median tps of the repetitions for each
(impl, placement), and the speed-up, on the last line.  Every rdmasock run is checked in
RDMASOCK_LOG_FILE: a run whose connections were not all transport=shm is marked as fallback,
and no speed-up is claimed from it.
JSON goes to <results>/pgbench-<time>.json and <results>/pgbench-latest.json (or --out), where
<results> is bench/results in a checkout."""
import argparse
import json
import os
import platform
import sys
import time

from .cli import bench_context, parse_args
from .common import RESULTS, SERVER_CPU, placements
from .pgbench import bench_pgbench


def main(argv=None):
    ap = argparse.ArgumentParser(prog="rdmasock demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per cell (median reported; 3-5)")
    ap.add_argument("--duration", type=int, default=10, help="pgbench -T seconds")
    ap.add_argument("--clients", type=int, default=1, help="pgbench -c")
    ap.add_argument("--placements", default="same,cross")
    ap.add_argument("--tcp-only", action="store_true", help="only the plain TCP side (checks the harness)")
    ap.add_argument("--quick", action="store_true", help="1 repetition of 3 s (smoke run)")
    ap.add_argument("--out", default=None, help="JSON path (default <results>/pgbench-<time>.json)")
    a = ap.parse_args(argv)
    if a.quick:
        a.reps, a.duration = 1, 3
    args = parse_args(["pgbench", "--pg-scales", "1", "--pg-clients", str(a.clients), "--reps", str(a.reps),
                       "--duration", str(a.duration), "--placements", a.placements]
                      + (["--tcp-only"] if a.tcp_only else []) + (["--quick"] if a.quick else []),
                      prog="rdmasock demo")
    with bench_context(args) as ctx:
        res = bench_pgbench(args, ctx)
    rows = res["rows"]
    failed = [r for r in rows if r["errors"]]
    for r in failed:
        print("%s [%s] failed: %s" % (r["name"], r["placement"], r["errors"][-1]), file=sys.stderr)

    result = {"benchmark": "pgbench TPC-B scale 1", "clients": a.clients, "duration_s": a.duration,
              "reps": a.reps, "server_cpu": SERVER_CPU, "synchronous_commit": "off", "fsync": "off",
              "host": platform.node(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "cells": [], "speedup": {}}
    med = {}
    order = ["tcp", "rdmasock"], list(placements(a.placements.split(",")))
    for r in sorted(rows, key=lambda r: (order[0].index(r["kind"]), order[1].index(r["placement"]))):
        med[(r["kind"], r["placement"])] = r["median"]
        result["cells"].append({"impl": r["kind"], "placement": r["placement"], "cpus": r["cpus"],
                                "tps_runs": r["runs"], "tps_median": r["median"], "transport": r["transport"]})
    places = order[1]
    lines = []
    if not a.tcp_only and not failed:
        for pl in places:
            verified = all(t == "shm" for t in next(c["transport"] for c in result["cells"]
                                                    if c["impl"] == "rdmasock" and c["placement"] == pl))
            sp = med[("rdmasock", pl)] / med[("tcp", pl)]
            result["speedup"][pl] = {"ratio": round(sp, 3), "verified_shm": verified}
            lines.append("speed-up %-5s rdmasock/tcp = %.2fx%s" % (pl, sp, "" if verified else
                                                                  "  (NOT upgraded: see transport column)"))
        best_r = max(med[("rdmasock", pl)] for pl in places)
        best_t = max(med[("tcp", pl)] for pl in places)
        result["speedup"]["best_vs_best"] = round(best_r / best_t, 3)
        lines.append("speed-up best placement vs best placement = %.2fx" % (best_r / best_t))

    out = a.out or os.path.join(RESULTS, "pgbench-%s.json" % time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for path in [out] + ([] if a.out else [os.path.join(RESULTS, "pgbench-latest.json")]):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    print("\npgbench TPC-B scale 1, -c %d -T %d, synchronous_commit=off, median of %d (server on CPU %d)"
          % (a.clients, a.duration, a.reps, SERVER_CPU))
    print("%-6s %-9s %10s   %s" % ("place", "impl", "tps", "runs / transport"))
    for c in result["cells"]:
        print("%-6s %-9s %10s   %s  %s" % (c["placement"], c["impl"], "%.1f" % c["tps_median"] if c["tps_median"]
                                           else "failed", " ".join("%.0f" % v for v in c["tps_runs"]),
                                           ",".join(sorted(set(c["transport"])))))
    print("JSON: %s" % out)
    for line in lines:                   # the speed-up comes last
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
