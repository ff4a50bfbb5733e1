"""`rdmasock bench`: the command line of the suite (bench/__init__.py describes it)."""
import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time

from . import servers as S
from .common import BENCHES, RESULTS, SERVER_CPU, TARGETS, compile_c, log, placements
from .idle import bench_idle
from .pgbench import bench_pgbench
from .pingpong import bench_pingpong
from .redis_get import bench_redis
from .replay import bench_replay
from .report import git_state, markdown, plots, print_table
from .scale import bench_scale
from .sockperf import bench_sockperf
from .stream import bench_stream



def parser():
    from . import __doc__ as suite_doc
    ap = argparse.ArgumentParser(prog="rdmasock bench", description=suite_doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("benchmarks", nargs="*", default=["pingpong"],
                    help="any of %s, or all (default: pingpong)" % ", ".join(BENCHES))
    ap.add_argument("--reps", type=int, default=None, help="repetitions per variant (default 5; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 short repetition (unless --reps is given)")
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds per timed run (default: pingpong 1 (its Soft-RoCE VM rows 3), stream 0.5, "
                         "pgbench 10, scale 6; quick: shorter)")
    ap.add_argument("--placements", default="same,cross", help="same (both on CPU 0) and/or cross (CPU 0 and 1)")
    ap.add_argument("--sizes", default=None, help="stream write sizes in bytes (default 64,256,...,1048576)")
    ap.add_argument("--redis-conns", default="1,50")
    ap.add_argument("--redis-tests", default="ping_inline,get,set")
    ap.add_argument("--pg-scales", default="1,10")
    ap.add_argument("--pg-clients", default="1,4")
    ap.add_argument("--replay-tx", type=int, default=2000,
                    help="replay: pgbench transactions to capture and replay per psql run (default 2000; quick 200)")
    ap.add_argument("--scale-conns", default="1,4,16,64,256", help="scale: concurrent connections N")
    ap.add_argument("--scale-pg-conns", default=None,
                    help="scale: N for pgbench only (default: --scale-conns); each is a PostgreSQL backend")
    ap.add_argument("--scale-tools", default="pgbench,redis", help="scale: pgbench and/or redis")
    ap.add_argument("--scale-pg-script", choices=("select", "tpcb"), default="select",
                    help="scale: pgbench -S (default) or TPC-B; at scale 1 TPC-B's N clients all update the one "
                         "pgbench_branches row, so it measures row-lock waits more than connections")
    ap.add_argument("--scale-placement", default="cross", help="scale: same, cross, crowded (as cross, each CPU shared with a busy loop of the same session) "
                         "or unpinned (the scheduler places servers and clients; default cross)")
    ap.add_argument("--scale-oversub", default="pgbench:8",
                    help="scale: also TOOL:N with nothing pinned, more runnable processes than CPUs "
                         "(default pgbench:8, i.e. pgbench -S -c 8; empty: skip)")
    ap.add_argument("--idle-conns", type=int, default=100, help="idle: connections held idle (default 100)")
    ap.add_argument("--idle-seconds", type=float, default=None, help="idle: seconds of no traffic (default 10; quick 2)")
    ap.add_argument("--tcp-only", action="store_true", help="baselines only (checks the harness)")
    ap.add_argument("--no-rdma", action="store_true",
                    help="pingpong: skip the Soft-RoCE VM run (the rdma rows, bench/rdma_vm.py)")
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--from-json", metavar="JSON", help="run nothing: rewrite the .md and plots of an earlier run")
    return ap


def parse_args(argv, prog="rdmasock bench"):
    """Parsed and checked suite arguments (also for bench/pgbench_demo.py):
    exits with a message if a benchmark name is unknown, taskset is missing or, unless
    --tcp-only, the preload library is unusable."""
    ap = parser()
    args = ap.parse_args(argv)
    args.names = []
    for b in args.benchmarks:
        args.names += list(BENCHES) if b == "all" else [b]
    bad = [b for b in args.names if b not in BENCHES]
    if bad:
        ap.error("unknown benchmark(s) %s; choose from %s or all" % (", ".join(bad), ", ".join(BENCHES)))
    if args.reps is None:
        args.reps = 1 if args.quick else 5
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.from_json:
        return args
    if not shutil.which("taskset"):
        sys.exit("%s: taskset (util-linux) is required to pin processes" % prog)
    if not args.tcp_only:
        ok, msg = S.preload_status()
        if not ok:
            sys.exit("%s: the preload library is not usable (--tcp-only runs the TCP side only): %s" % (prog, msg))
    return args


@contextlib.contextmanager
def bench_context(args):
    """The shared state of one run: a work dir (removed afterwards), the RDMASOCK_LOG_FILE, the
    placements and, when pingpong or stream runs, the compiled C programs."""
    work = tempfile.mkdtemp(prefix="rs-suite-")
    try:
        os.chmod(work, 0o755)
        ctx = {"work": work, "seq": 0, "places": placements(args.placements.split(",")),
               "log_file": S.make_log_file(os.path.join(work, "log"), "rdmasock.log")}
        if {"pingpong", "stream"} & set(args.names):
            ctx["bins"] = compile_c(work)
        yield ctx
    finally:
        shutil.rmtree(work, ignore_errors=True)


def rewrite(args):
    """--from-json: print the tables and rewrite the .md and plots of an earlier run."""
    with open(args.from_json) as f:
        result = json.load(f)
    stem = args.from_json[:-5] if args.from_json.endswith(".json") else args.from_json
    for name, b in result["results"].items():
        print_table(name, b)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    made = [] if args.no_plots else plots(result, stem)
    print("\nrewritten: %s.md%s" % (stem, "".join(", " + p for p in made)))
    return 0


def _stop_on_sigterm(signum, frame):
    """SIGTERM unwinds the run as Ctrl-C does: the with blocks on the way out stop its servers
    and remove its work directory.  A second one does not cut that clean-up short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    args = parse_args(argv)
    if args.from_json:
        return rewrite(args)
    names = args.names
    result = {"benchmarks": names, "reps": args.reps, "quick": args.quick, "host": platform.node(),
              "cpus": os.cpu_count(), "kernel": platform.release(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "command": " ".join(["rdmasock bench"] + argv), "server_cpu": SERVER_CPU,
              "placements": placements(args.placements.split(",")), "targets": TARGETS, "git": git_state(),
              "preload_library": S.preload_status()[1] if not args.tcp_only else None, "results": {}}
    fns = {"pingpong": bench_pingpong, "stream": bench_stream, "sockperf": bench_sockperf, "redis": bench_redis,
           "pgbench": bench_pgbench,
           "replay": bench_replay, "scale": bench_scale, "idle": bench_idle}
    with bench_context(args) as ctx:
        for name in names:
            log("== %s" % name)
            try:
                result["results"][name] = fns[name](args, ctx)
            except Exception as e:               # noqa: BLE001 - one broken sub-benchmark must not lose the others
                result["results"][name] = {"error": "%s: %s" % (type(e).__name__, e)}
            print_table(name, result["results"][name])

    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "%s-%s" % ("all" if set(names) >= set(BENCHES) else "-".join(names),
                                                 time.strftime("%Y%m%d-%H%M%S")))
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    made = [] if args.no_plots else plots(result, stem)
    print("\nresults: %s.json, %s.md%s" % (stem, stem, "".join(", " + p for p in made)))
    return 1 if any("error" in b for b in result["results"].values()) else 0
