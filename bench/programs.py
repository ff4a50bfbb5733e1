"""redis-benchmark over plain TCP vs under rdmasock (LD_PRELOAD), same run, pinned.

    .venv/bin/python bench/programs.py [--reps 3] [--conns 1,50] [--tests get,set,ping_inline]
                                       [--placements same,cross] [--tcp-only] [--quick]

The `redis` sub-benchmark of bench/suite.py (`rdmasock bench redis`) with this script's own
report: two redis-servers on 127.0.0.1 pinned to CPU 0, one plain, one under `rdmasock run`;
redis-benchmark (`-t <tests> -c <conns> --csv`, no pipelining) runs plain against the plain
server and preloaded against the preloaded one, after an unrecorded warm-up, interleaved
repetition by repetition, on CPU 0 ("same") or CPU 1 ("cross").  Reported: median requests/s
per (test, conns, placement, impl) and rdmasock/tcp.  rdmasock runs are checked in
RDMASOCK_LOG_FILE: unless every benchmark connection was transport=shm the cell is marked
fallback.  JSON: bench/results/programs-<time>.json and programs-latest.json (or --out)."""
import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import suite  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--conns", default="1,50")
    ap.add_argument("--tests", default="get,set,ping_inline")
    ap.add_argument("--placements", default="same,cross")
    ap.add_argument("--tcp-only", action="store_true", help="only the plain TCP side (checks the harness)")
    ap.add_argument("--quick", action="store_true", help="1 repetition, fewer requests (smoke run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    args = suite.parse_args(["redis", "--redis-conns", a.conns, "--redis-tests", a.tests, "--reps",
                             "1" if a.quick else str(a.reps), "--placements", a.placements]
                            + (["--tcp-only"] if a.tcp_only else []) + (["--quick"] if a.quick else []),
                            prog="programs")
    with suite.bench_context(args) as ctx:
        rows = suite.bench_redis(args, ctx)["rows"]

    result = {"benchmark": "redis-benchmark", "tests": args.redis_tests.split(","), "reps": args.reps,
              "server_cpu": suite.SERVER_CPU, "host": platform.node(), "cpus": os.cpu_count(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cells": []}
    print("\nredis-benchmark, requests/s, median of %d (server on CPU %d)" % (args.reps, suite.SERVER_CPU))
    print("%-12s %5s %-6s %12s %12s %8s  %s" % ("test", "conns", "place", "tcp", "rdmasock", "ratio", "transport"))
    for tcp in sorted((r for r in rows if r["kind"] == "tcp"), key=lambda r: (r["name"], r["conns"])):
        key = {k: tcp[k] for k in ("name", "conns", "placement")}
        cell = {"test": tcp["name"], "conns": tcp["conns"], "placement": tcp["placement"], "cpus": tcp["cpus"],
                "tcp_runs": tcp["runs"], "tcp_median": tcp["median"]}
        line = "%-12s %5d %-6s %12s" % (tcp["name"], tcp["conns"], tcp["placement"], _num(tcp["median"]))
        rs = next((r for r in rows if r["kind"] == "rdmasock" and all(r[k] == v for k, v in key.items())), None)
        if rs is not None:
            ratio = rs["median"] / tcp["median"] if rs["median"] and tcp["median"] else None
            cell.update({"rdmasock_runs": rs["runs"], "rdmasock_median": rs["median"],
                         "ratio": round(ratio, 3) if ratio else None, "transport": rs["transport"],
                         "verified_shm": rs["verified_shm"]})
            line += " %12s %8s  %s" % (_num(rs["median"]), "%.2fx" % ratio if ratio else "n/a",
                                       ",".join(sorted(set(rs["transport"]))) or rs["status"])
        result["cells"].append(cell)
        print(line)
    out = a.out or os.path.join(suite.RESULTS, "programs-%s.json" % time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for path in [out] + ([] if a.out else [os.path.join(suite.RESULTS, "programs-latest.json")]):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print("JSON: %s" % out)
    return 1 if any(r["errors"] for r in rows) else 0


def _num(v):
    return "%.0f" % v if v else "failed"


if __name__ == "__main__":
    sys.exit(main())
