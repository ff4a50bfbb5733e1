"""scale: N concurrent connections (pgbench -S, redis-benchmark GET): throughput and PSS."""
import contextlib
import statistics
import subprocess
import sys
import time

from . import servers as S
from .common import Row, log, placements, run_variants, server_pair, set_ratios
from .pgbench import pg_init, pgbench_run
from .redis_get import redis_run



class MemorySampler:
    """while_running callback: once the client holds `conns` established TCP connections to
    port (psutil), waits `settle` seconds, then sums PSS/RSS over the server's and the
    client's process trees (S.memory_kib) into .sample.  If the client ends first, .sample
    stays None."""

    def __init__(self, server, conns, settle):
        self.server, self.conns, self.settle, self.sample = server, conns, settle, None

    def __call__(self, popen):
        def connected():
            if popen.poll() is not None:
                return True
            return len(S.conns_of(S.process_tree(popen.pid), self.server.port, established_only=True)) >= self.conns
        S.wait_until(connected, 120, interval=0.05)
        time.sleep(self.settle)
        if popen.poll() is not None:
            return
        m = S.memory_kib(self.server.pids() + S.process_tree(popen.pid))
        if popen.poll() is None:                  # the client was still running: a sample of the run
            self.sample = m


@contextlib.contextmanager
def busy_loops(cpus):
    """One busy loop pinned to each of cpus, in the benchmark's session, as are the servers
    and clients started meanwhile (S.NEW_SESSION): a CPU each of them shares with another
    program that never sleeps.  The loops are ended by PID."""
    loops, S.NEW_SESSION = [], False
    try:
        for cpu in sorted(set(cpus)):
            loops.append(subprocess.Popen(S.pin(cpu) + [sys.executable, "-c", "while True: pass"],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        yield
    finally:
        S.NEW_SESSION = True
        for p in loops:
            S.kill_tree(p)


def oversub_parts(spec):
    """--scale-oversub "pgbench:8,redis:50" -> {tool: [N, ...]}."""
    parts = {}
    for item in (x.strip() for x in spec.split(",")):
        if item:
            tool, _, n = item.partition(":")
            parts.setdefault(tool, []).append(int(n))
    return parts


def bench_scale(args, ctx):
    """pgbench and redis-benchmark GET with N concurrent connections: throughput and memory,
    in --scale-placement, then (--scale-oversub) the unpinned part: more runnable processes
    than CPUs."""
    conns_list = sorted(int(c) for c in args.scale_conns.split(","))
    pg_conns = sorted(int(c) for c in (args.scale_pg_conns or args.scale_conns).split(","))
    tools = [t for t in args.scale_tools.split(",") if t]
    rows, summary = scale_part(args, ctx, args.scale_placement, tools, conns_list, pg_conns)
    extra = oversub_parts(args.scale_oversub or "") if args.scale_placement != "unpinned" else {}
    if extra:
        more, more_summary = scale_part(args, ctx, "unpinned", sorted(extra), sorted(extra.get("redis", [])),
                                        sorted(extra.get("pgbench", [])))
        rows += more
        summary += more_summary
    for r in rows:
        r["pss_mib"] = statistics.median(r["pss_kib"]) / 1024 if r["pss_kib"] else None
        r["rss_mib"] = statistics.median(r["rss_kib"]) / 1024 if r["rss_kib"] else None
        one = [b for b in rows if b["tool"] == r["tool"] and b["kind"] == r["kind"] and b["conns"] == 1
               and b["placement"] == r["placement"]]
        if r["conns"] > 1 and one and one[0]["pss_mib"] is not None and r["pss_mib"] is not None:
            r["kib_per_conn"] = round((r["pss_mib"] - one[0]["pss_mib"]) * 1024 / (r["conns"] - 1), 1)
    set_ratios(rows, "tcp", "vs_tcp", keys=("tool", "conns", "placement"))
    return {"rows": rows, "summary": summary + [
                "memory: PSS summed over the server's and the client's processes from /proc/PID/smaps_rollup, "
                "sampled once during each run after all N connections were established (median over the "
                "repetitions; kernel socket buffers are not included); KiB/conn = (PSS(N) - PSS(1)) / (N - 1)"],
            "targets": [],
            "columns": ["tool", "conns", "placement", "name", "median", "min", "max", "cpu_us", "vs_tcp", "pss_mib",
                        "kib_per_conn", "status"],
            "title": "scale: N concurrent connections, throughput and memory, TCP vs rdmasock"}


def scale_part(args, ctx, pl, tools, conns_list, pg_conns):
    """The rows of one placement pl (same, cross, crowded, unpinned), and its summary line."""
    duration = max(3, round(args.duration or (3 if args.quick else 6)))   # pgbench -T includes connecting
    impls = ["tcp"] if args.tcp_only else ["tcp", "rdmasock"]
    places, log_file = ctx["places"], ctx["log_file"]
    cpus = placements([pl]).get(pl) or places[list(places)[-1]]
    pg_opts = ["-S"] if args.scale_pg_script == "select" else []
    tools = [t for t in tools if (t != "pgbench" or pg_conns) and (t != "redis" or conns_list)]
    variants, est = [], {}

    def add(tool, impl, n, fn):
        row = Row("scale", "%s %s" % (tool, "TCP" if impl == "tcp" else "rdmasock shm"), pl, cpus,
                  "tps" if tool == "pgbench" else "req/s", baseline=(impl == "tcp"), rdmasock=(impl == "rdmasock"),
                  tool=tool, conns=n, kind=impl, pss_kib=[], rss_kib=[])

        def measured():
            sampler = MemorySampler(servers[tool][impl], n, min(1.0, duration / 4))
            v, tr, ops = fn(sampler)
            if sampler.sample:
                row.d["pss_kib"].append(sampler.sample["pss"])
                row.d["rss_kib"].append(sampler.sample["rss"])
            else:
                row.d.setdefault("notes", []).append("memory not sampled: run ended first")
            return v, tr, ops
        variants.append((row, measured))

    servers = {}
    with contextlib.ExitStack() as stack:
        if pl == "crowded":
            stack.enter_context(busy_loops(cpus))
        if "pgbench" in tools:
            servers["pgbench"] = stack.enter_context(server_pair(
                S.PgServer, impls, log_file, cpu=cpus[0], settings={"max_connections": str(max(pg_conns) + 20)}))
            for impl, srv in servers["pgbench"].items():
                pg_init(srv, "scale", 1, impl == "rdmasock", log_file)
            for n in pg_conns:
                for impl in impls:
                    def fn(sampler, n=n, impl=impl):
                        return pgbench_run(servers["pgbench"][impl], "scale", pg_opts + [
                            "-c", str(n), "-j", str(min(n, 2)), "-T", str(duration)], impl, cpus[1], log_file,
                            wait=sampler)
                    add("pgbench", impl, n, fn)
        if "redis" in tools:
            servers["redis"] = stack.enter_context(server_pair(S.RedisServer, impls, log_file, cpu=cpus[0]))
            for n in conns_list:
                for impl in impls:
                    def fn(sampler, n=n, impl=impl):
                        reqs = max(2000, 50 * n, int(est.get((impl, n), 20000) * duration))
                        rates, tr, ops = redis_run(servers["redis"][impl], ["get"], n, reqs, impl, cpus[1],
                                                   log_file, wait=sampler)
                        est[(impl, n)] = rates["GET"]       # the next repetition runs ~duration seconds
                        return rates["GET"], tr, ops
                    add("redis", impl, n, fn)
        for impl in impls:                       # warm-up (not recorded), and redis' request-count estimate
            if "pgbench" in tools:
                pgbench_run(servers["pgbench"][impl], "scale", pg_opts + ["-c", str(max(pg_conns)), "-j", "2",
                                                                          "-T", str(duration)], impl, cpus[1], log_file)
            if "redis" in tools:
                for n in conns_list:
                    est[(impl, n)] = redis_run(servers["redis"][impl], ["get"], n, max(5000, 20 * n), impl, cpus[1],
                                               log_file)[0]["GET"]
        log("scale warm-up done")
        rows = run_variants("scale", variants, args.reps, lambda v: "%.0f/s" % v)
    return rows, [
        "%s: %s (%s); pgbench %s scale 1, -j min(N,2), -T %d, max_connections %d; redis-benchmark -t get, "
        "requests sized for ~%d s" % (
            pl, "servers and clients not pinned" if cpus[0] is None else
            "server on CPU %d, client on CPU %d" % cpus + (
                ", each CPU shared with a busy loop, all in one session" if pl == "crowded" else ""),
            "N = " + ", ".join("%s %s" % (t, ",".join(map(str, pg_conns if t == "pgbench" else conns_list)))
                               for t in tools),
            "-S (select-only)" if pg_opts else "TPC-B", duration, max(pg_conns or [0]) + 20, duration)]
