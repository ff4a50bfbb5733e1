"""rdmasock benchmark suite (issue 5): sub-benchmarks that measure their baseline in the same run.

    .venv/bin/python bench/suite.py [pingpong|stream|redis|pgbench|replay|scale|all ...] [--reps 5] [--quick]
                                    [--duration S] [--placements same,cross] [--no-rdma] [--no-plots]
    rdmasock bench [same arguments]            (`rdmasock bench core` runs the older bench/core.py)

Sub-benchmarks
  pingpong  64-byte round trips/s (rtt_us: 1e6 / median).  bench/c/sockbench.c over TCP and a Unix
            socket, the same program with both sides under `rdmasock run` (LD_PRELOAD, shm),
            the Python API (bench/worker.py: socket vs rdmasock.socket), and bench/c/shmspin.c,
            a raw shared-memory spin ping-pong (two processes, one page, cross-CPU) as the
            physical limit of the machine.  Ratios vs TCP at its best placement and vs the limit.
            Then, since the host kernel has no RDMA, one Soft-RoCE QEMU VM run (bench/rdma_vm.py,
            scripts/softroce/run.sh; 3 s per repetition, --quick 1 s; the VM part takes ~25 s
            with --quick, ~2 min for 5 repetitions, boot included) adds the rows "TCP (Soft-RoCE
            VM)", "rdmasock rdma, inline on / off (Soft-RoCE VM)" (sockbench under LD_PRELOAD
            with RDMASOCK_TRANSPORTS=rdma) and "ib_write_lat (Soft-RoCE VM, raw verbs)", all on
            the same rxe device; their ratios compare within the VM only (vs the VM's TCP and
            ib_write_lat; target: rdma round trip <= 2x ib_write_lat's).  If the VM cannot run
            (tests/test_rdma_vm.py's prerequisites check, plus perftest), or with --no-rdma, one
            placeholder row says why.
  stream    throughput of writes of 64 B .. 1 MiB: sockbench over TCP vs under rdmasock, and
            memcpy bandwidth into a 4 MiB ring (bench/c/memcpybw.c) as the limit.
  redis     redis-benchmark PING_INLINE, GET, SET with -c 1 and -c 50, no pipelining, plain vs
            server and client both preloaded (servers: bench/servers.py).
  pgbench   TPC-B, scales 1 and 10 (--pg-scales), 1 and 4 clients, synchronous_commit=off,
            fsync=off, plain vs server and client both preloaded (bench/pgbench_demo.py, which
            scripts/demo.sh runs, is this sub-benchmark with its own report).
  replay    the seed's method: pgbench's SQL (TPC-B, scale 1, 1 client, --replay-tx transactions)
            is captured with log_statement=all from the server log into a script, which
            `psql -f` replays, one new connection per run (process start and connection set-up
            included), plain vs psql and server both preloaded; transactions / wall seconds.
  scale     N = 1,4,16,64,256 concurrent connections: pgbench -S (-c N -j min(N,2)) and
            redis-benchmark GET (-c N), plain vs preloaded; throughput, and the PSS of server and
            client processes sampled during the run: total and per extra connection.

Method: every process is pinned with taskset; the server side on CPU 0, the client on CPU 0
("same") or CPU 1 ("cross").  Each program warms up before it measures.  Repetitions are
interleaved (rep 1 of every variant, then rep 2, ...) so that the baseline and rdmasock see
the same machine state; reported are median, min and max of --reps repetitions (default 5;
--quick: 1 short repetition, a smoke run, not a measurement).  Every rdmasock row is checked
in RDMASOCK_LOG_FILE: unless every connection of the run logged transport=shm (rdma for the
VM's rdma rows), the row is marked (fallback/unverified) and no ratio is claimed from it.
Progress goes to stderr.

Outputs: bench/results/<names>-<time>.json and .md (or --out-dir), and PNG plots next to
them when matplotlib can be imported (else skipped with a message: install python3-matplotlib)."""
import argparse
import contextlib
import csv
import io
import json
import os
import platform
import re
import resource
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import servers as S  # noqa: E402

RESULTS = os.path.join(HERE, "results")
CSRC = os.path.join(HERE, "c")
WORKER = os.path.join(HERE, "worker.py")
SERVER_CPU = 0
RUN_TIMEOUT = 120
BENCHES = ("pingpong", "stream", "sockperf", "redis", "pgbench", "replay", "scale")
PGBENCH = "/usr/bin/pgbench"
REDIS_BENCHMARK = "/usr/bin/redis-benchmark"
STREAM_SIZES = (64, 256, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
RDMA_PLACEHOLDER = "rdma: not measured here; the Soft-RoCE VM measures pingpong (bench/rdma_vm.py)"
PINGPONG_COLUMNS = ["name", "placement", "median", "min", "max", "rtt_us", "cpu_us", "vs_tcp_best", "vs_limit", "status"]
TARGETS = {                                   # issue 5, "Targets on this 2-core machine kind"
    "pingpong_c_preload_rt_s": 1_000_000,
    "pingpong_c_preload_vs_tcp": 20.0,
    "pingpong_c_preload_vs_limit": 0.5,
    "stream_64k_vs_tcp": 3.0,
    "redis_get_c1_vs_tcp": 2.0,
    "pgbench_c1_vs_tcp": 1.7,
    "replay_vs_tcp": 1.55,
    "pingpong_rdma_vm_rtt_vs_ib_write_lat_at_most": 2.0,      # issue 4 point 8
}


# ---------------------------------------------------------------------------------------------
# common machinery

class Progress:
    """One line per finished run on stderr: [bench i/N elapsed eta] what: value."""

    def __init__(self, bench, total):
        self.bench, self.total, self.done, self.t0 = bench, total, 0, time.monotonic()

    def step(self, msg):
        self.done += 1
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done)
        print("[%s %d/%d %4.0fs, ~%.0fs left] %s" % (self.bench, self.done, self.total, el, eta, msg),
              file=sys.stderr, flush=True)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def placements(wanted):
    p = {"same": (SERVER_CPU, SERVER_CPU)}
    if (os.cpu_count() or 1) > 1:
        p["cross"] = (SERVER_CPU, 1)
    return {k: v for k, v in p.items() if k in wanted}


def stats(values):
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class Row:
    """One measured variant: repetitions of one number, plus the transport verdict of each."""

    def __init__(self, bench, name, placement, cpus, unit, baseline=False, rdmasock=False, **extra):
        self.d = {"bench": bench, "name": name, "placement": placement, "cpus": list(cpus) if cpus else None,
                  "unit": unit, "baseline": baseline, "rdmasock": rdmasock, "runs": [], "transport": [],
                  "cpu_runs": [], "errors": []}
        self.d.update(extra)

    def add(self, value, transport, cpu_us=None):
        self.d["runs"].append(value)
        self.d["transport"].append(transport)
        if cpu_us is not None:
            self.d["cpu_runs"].append(cpu_us)

    def fail(self, err):
        self.d["errors"].append(str(err)[-800:])

    def finish(self):
        self.d.update(stats(self.d["runs"]))
        if self.d["cpu_runs"]:
            self.d["cpu_us"] = round(statistics.median(self.d["cpu_runs"]), 3)
        trs = set(self.d["transport"])
        if self.d["errors"]:
            self.d["status"] = "failed" if not self.d["runs"] else "partial"
        elif self.d["rdmasock"] and trs != {self.d.get("expect", "shm")}:
            self.d["status"] = "NOT %s: %s" % (self.d.get("expect", "shm"), ",".join(sorted(trs)))
        else:
            self.d["status"] = "ok"
        self.d["verified_shm"] = self.d["rdmasock"] and trs == {"shm"} and not self.d["errors"]
        return self.d


def verdict(log_file, mark, port, conns=1, expect="shm"):
    """expect ('shm') if >= conns client lines about port since mark and all are expect, else why not."""
    recs = [r for r in S.parse_log(log_file, mark) if r["role"] == "client" and S.addr_port(r["peer"]) == port]
    if len(recs) < conns:
        return "unverified (%d of %d client log lines)" % (len(recs), conns)
    bad = [r for r in recs if r["transport"] != expect]
    if bad:
        return "fallback:" + ",".join(sorted({"%s/%s" % (r["transport"], r["reason"]) for r in bad}))
    return expect


def compile_c(workdir, names=("sockbench", "shmspin", "memcpybw")):
    """bench/c/{names}.c -> workdir; returns name -> binary path."""
    out = {}
    for name in names:
        dst = os.path.join(workdir, name)
        S.run(["cc", "-O2", "-Wall", "-o", dst, os.path.join(CSRC, name + ".c")], timeout=120)
        out[name] = dst
    return out


def read_line(proc, timeout):
    """First stdout line of proc within timeout seconds ('' on EOF / timeout)."""
    end = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while b"\n" not in buf:
        left = end - time.monotonic()
        if left <= 0:
            return ""
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").split("\n", 1)[0]


def stop(proc, timeout=10):
    """Wait for a process we started; kill it (and its children) by PID if it lingers."""
    if proc is None:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        S.kill_tree(proc)
    for f in (proc.stdout, proc.stderr):
        if f:
            f.close()


def sock_pair(binary, kind, addr, cpus, preload, mode, size, secs, log_file, extra_env=None):
    """One run of sockbench: server then client, pinned; returns (value, port or None).
    extra_env: more environment for both sides (bench/rdma_vm.py: LD_PRELOAD, RDMASOCK_*)."""
    env = S.client_env(log_file, extra_env)
    srv = subprocess.Popen(S.pin(cpus[0]) + S.preload_cmd([binary, "server", kind, addr], preload),
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                           start_new_session=True)
    try:
        line = read_line(srv, 30)
        if kind == "tcp":
            m = re.match(r"port (\d+)", line)
            if not m:
                raise RuntimeError("sockbench server did not report its port: %r %s" % (line, _err(srv)))
            addr = m.group(1)
        elif line != "ready":
            raise RuntimeError("sockbench server not ready: %r %s" % (line, _err(srv)))
        res = S.run(S.pin(cpus[1]) + S.preload_cmd([binary, "client", kind, addr, mode, str(size), str(secs)],
                                                   preload), timeout=secs + RUN_TIMEOUT, env=env)
        out = res.stdout.decode()
        m = re.search(r"(round_trips_per_s|bytes_per_s) (\d+)", out)
        if not m:
            raise RuntimeError("sockbench client printed %r" % out)
        return float(m.group(2)), (int(addr) if kind == "tcp" else None)
    finally:
        stop(srv)


def _err(proc):
    if proc.poll() is None:
        return ""
    return "(exited %s: %s)" % (proc.returncode, proc.stderr.read().decode(errors="replace")[-500:])


def py_pair(impl, cpus, n, workdir, seq):
    """One run of bench/worker.py ping-pong (64 B); returns (round trips/s, transport)."""
    portfile = os.path.join(workdir, "port-%d" % seq)
    env = S.base_env({"PYTHONPATH": S.REPO})
    srv = subprocess.Popen(S.pin(cpus[0]) + [S.VENV_PY, WORKER, "server", impl, portfile],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                           start_new_session=True)
    try:
        if not S.wait_until(lambda: os.path.exists(portfile) or srv.poll() is not None, 30) \
                or not os.path.exists(portfile):
            raise RuntimeError("python worker server did not start %s" % _err(srv))
        with open(portfile) as f:
            port = f.read().strip()
        res = S.run(S.pin(cpus[1]) + [S.VENV_PY, WORKER, "client", impl, port, "pingpong", "64", str(n)],
                    timeout=RUN_TIMEOUT, env=env)
        d = json.loads(res.stdout.decode().strip().splitlines()[-1])
        return d["ops_per_s"], d["transport"]
    finally:
        stop(srv)


# ---------------------------------------------------------------------------------------------
# pingpong

def bench_pingpong(args, ctx):
    secs = args.duration or (0.3 if args.quick else 1.0)
    places = ctx["places"]
    bins, log_file, work = ctx["bins"], ctx["log_file"], ctx["work"]
    variants = []          # (Row, fn() -> (value, transport))
    for pl, cpus in places.items():
        for kind, label in (("tcp", "TCP (C)"), ("unix", "Unix socket (C)")):
            def fn(kind=kind, cpus=cpus):
                addr = "0" if kind == "tcp" else os.path.join(work, "pp.sock")
                v, _ = sock_pair(bins["sockbench"], kind, addr, cpus, False, "pingpong", 64, secs, None)
                return v, kind, v * secs
            variants.append((Row("pingpong", label, pl, cpus, "rt/s", baseline=(kind == "tcp"), kind=kind), fn))
    if not args.tcp_only:
        for pl, cpus in places.items():
            def fn(cpus=cpus):
                mark = S.log_size(log_file)
                v, port = sock_pair(bins["sockbench"], "tcp", "0", cpus, True, "pingpong", 64, secs, log_file)
                return v, verdict(log_file, mark, port), v * secs
            variants.append((Row("pingpong", "rdmasock shm, C via LD_PRELOAD", pl, cpus, "rt/s", rdmasock=True,
                                 kind="preload"), fn))
    py_n = {}
    for impl in (("tcp",) if args.tcp_only else ("tcp", "rdmasock")):
        for pl, cpus in places.items():
            key = (impl, pl)
            py_n[key] = 5000 if impl == "tcp" else 20000

            def fn(impl=impl, cpus=cpus, key=key):
                ctx["seq"] += 1
                n = py_n[key]
                v, tr = py_pair(impl, cpus, n, work, ctx["seq"])
                py_n[key] = max(1000, int(v * secs))         # next repetition runs ~secs
                return v, tr, n
            label = "TCP (Python socket)" if impl == "tcp" else "rdmasock shm, Python API"
            variants.append((Row("pingpong", label, pl, cpus, "rt/s", rdmasock=(impl == "rdmasock"),
                                 kind="python-" + impl), fn))
    if "cross" in places:
        def fn():
            res = S.run(["taskset", "-c", "%d,%d" % places["cross"], bins["shmspin"], str(places["cross"][0]),
                         str(places["cross"][1]), str(secs)], timeout=secs + RUN_TIMEOUT)
            return float(re.search(r"round_trips_per_s (\d+)", res.stdout.decode()).group(1)), "shm-raw"
        variants.append((Row("pingpong", "raw shared-memory spin (limit)", "cross", places["cross"], "rt/s",
                             kind="limit"), fn))
    rows = run_variants("pingpong", variants, args.reps, lambda v: "%.0f rt/s" % v)
    set_ratios(rows, "tcp")
    set_ratios(rows, "limit", "vs_limit", digits=3)
    set_rtt(rows)
    tcp, lim, pre = best(rows, "tcp"), best(rows, "limit"), best(rows, "preload")
    summary, targets = [], []
    if tcp:
        summary.append("host TCP best placement: %s (%.0f rt/s)" % (
            next(r["placement"] for r in rows if r["kind"] == "tcp" and r["median"] == tcp), tcp))
    if pre and tcp and lim:
        targets += [target("C ping-pong via LD_PRELOAD >= 1,000,000 rt/s", pre,
                           TARGETS["pingpong_c_preload_rt_s"], "%.0f rt/s"),
                    target("C ping-pong via LD_PRELOAD >= 20x TCP best", pre / tcp,
                           TARGETS["pingpong_c_preload_vs_tcp"], "%.2fx"),
                    target("C ping-pong via LD_PRELOAD >= 0.5 of raw spin limit", pre / lim,
                           TARGETS["pingpong_c_preload_vs_limit"], "%.2f")]
    elif not args.tcp_only:
        summary.append("no verified LD_PRELOAD row: targets not evaluated")
    for pl in places:
        cpu = {r["kind"]: r.get("cpu_us") for r in rows if r["placement"] == pl}
        if cpu.get("tcp") and cpu.get("preload"):
            summary.append("CPU per round trip [%s]: rdmasock C %.2f us vs TCP %.2f us (%.2fx)" % (
                pl, cpu["preload"], cpu["tcp"], cpu["preload"] / cpu["tcp"]))
    vm = pingpong_vm(args)                   # after the host rows: the VM keeps both CPUs busy
    return {"rows": rows + vm["rows"], "summary": summary + vm["summary"], "targets": targets + vm["targets"],
            "columns": PINGPONG_COLUMNS,
            "title": "64-byte ping-pong, round trips/s (host: %.1f s per repetition; rtt_us = 1e6 / median; cpu_us = "
                     "CPU time, user + system, of both processes per round trip, start-up included)" % secs}


def set_rtt(rows):
    """row["rtt_us"]: the round-trip time of the median, 1e6 / (round trips/s)."""
    for r in rows:
        if r["median"]:
            r["rtt_us"] = round(1e6 / r["median"], 3)


VM_PLACEHOLDER = "rdmasock rdma, inline on / off (Soft-RoCE VM)"


def pingpong_vm(args):
    """The Soft-RoCE VM rows of pingpong, from one VM run (bench/rdma_vm.py): TCP, rdmasock rdma
    with inline on and off, ib_write_lat, on the same rxe device.  Their ratios compare within the
    VM only (vs_tcp_best: the VM's TCP row; vs_limit: ib_write_lat): the host's TCP and spin limit
    do not apply to the emulated guest.  If the VM cannot run, or with --no-rdma / --tcp-only, one
    placeholder row says why.  Returns {rows, summary, targets, columns, title}."""
    import rdma_vm                           # here, not at the top: rdma_vm imports this module
    secs = args.duration or (1.0 if args.quick else 3.0)
    out = {"rows": [], "summary": [], "targets": [], "columns": PINGPONG_COLUMNS,
           "title": "64-byte ping-pong in the Soft-RoCE VM, round trips/s (%.3g s per repetition)" % secs}
    status, err = None, None
    if args.no_rdma or args.tcp_only:
        status = "skipped (%s)" % ("--no-rdma" if args.no_rdma else "--tcp-only")
    else:
        missing = rdma_vm.vm_missing()
        if missing:
            status = "not measured: the Soft-RoCE VM cannot run here: %s" % missing
    if status is None:
        log("Soft-RoCE VM: %d repetition(s) of TCP, rdma inline on/off, ib_write_lat, %.3g s each"
            % (args.reps, secs))
        try:
            rows, wall = rdma_vm.measure(args.reps, secs, S.require_preload(), echo=log)
        except Exception as e:               # noqa: BLE001 - the host rows must survive a broken VM
            err = "%s: %s" % (type(e).__name__, e)
            lines = err.strip().splitlines()
            status = "failed: %s%s" % (lines[0][:300], "; last output: " + lines[-1][:300] if len(lines) > 1 else "")
    if status:
        row = placeholder_row("pingpong", VM_PLACEHOLDER, rdma_vm.PLACEMENT, "rt/s", status)
        if err:
            row["errors"].append(err[-800:])
        out["rows"].append(row)
        out["summary"].append("Soft-RoCE VM rows: %s" % status)
        return out
    set_ratios(rows, "tcp")
    set_ratios(rows, "limit", "vs_limit", digits=3)
    set_rtt(rows)
    tcp, raw = best(rows, "tcp"), best(rows, "limit")
    for inline in (True, False):
        rd = best(rows, "rdma", inline=inline)
        what = "Soft-RoCE VM: rdmasock rdma, inline %s" % ("on" if inline else "off")
        if rd and raw:
            out["targets"].append(target("%s, round trip <= 2x ib_write_lat's" % what, raw / rd,
                                         TARGETS["pingpong_rdma_vm_rtt_vs_ib_write_lat_at_most"], "%.2fx",
                                         at_most=True))
        if rd and tcp:
            out["summary"].append("%s, round trip = %.2fx the VM's TCP round trip (%.1f us vs %.1f us)"
                                  % (what, tcp / rd, 1e6 / rd, 1e6 / tcp))
        if not rd:
            out["summary"].append("%s: no verified rdma row, ratios not evaluated" % what)
    if not raw:
        out["summary"].append("Soft-RoCE VM: no ib_write_lat figure, the 2x target is not evaluated")
    for r in rows:
        if r["errors"]:
            out["summary"].append("%s: %s" % (r["name"], r["errors"][-1].strip().splitlines()[-1][:300]))
    out["summary"].append(
        "Soft-RoCE VM rows: one QEMU guest (TCG-emulated, 2 vCPUs, rxe0 on its loopback), server on guest CPU "
        "%d, client on CPU %d, %.3g s per repetition; ib_write_lat -s 64 -n %d as round trips/s = 1e6 / "
        "(2 x t_typical us); their vs_tcp_best and vs_limit are against the VM's TCP row and ib_write_lat, "
        "not the host's; absolute figures are far from hardware.  VM part: %.0f s wall, boot included"
        % (rdma_vm.CPUS[0], rdma_vm.CPUS[1], secs, rdma_vm.IB_WRITE_LAT_ITERS, wall))
    out["rows"] = rows
    out["vm_wall_s"] = round(wall, 1)
    return out


def placeholder_row(bench, name, placement, unit, status):
    """A row that was not measured (the Soft-RoCE VM could not run, or was not asked for),
    with status saying why."""
    row = Row(bench, name, placement, None, unit, rdmasock=True, kind="rdma", vm=True).finish()
    row["status"] = status
    return row


def target(what, value, need, fmt, at_most=False):
    met = value <= need if at_most else value >= need
    return {"target": what, "value": value, "need": need, "at_most": at_most, "met": met,
            "text": "%s: %s -> %s" % (what, fmt % value, "MET" if met else "missed")}


def _matches(r, match):
    return all(r.get(k) == v for k, v in match.items())


def best(rows, kind, **match):
    """The highest median among the ok rows of kind whose fields equal match, or None."""
    c = [r["median"] for r in rows if r.get("kind") == kind and r["median"] and r["status"] == "ok"
         and _matches(r, match)]
    return max(c) if c else None


def set_ratios(rows, kind, field="vs_tcp_best", keys=(), digits=2):
    """row[field] = row median / the best ok median of kind among the rows with the same keys."""
    for r in rows:
        b = best(rows, kind, **{k: r.get(k) for k in keys})
        if b and r["median"]:
            r[field] = round(r["median"] / b, digits)


def ratio_target(rows, what, need, kind="rdmasock", **match):
    """[target] for best(kind) / best(tcp) among rows matching match, or [] if either is missing."""
    pre, tcp = best(rows, kind, **match), best(rows, "tcp", **match)
    return [target(what, pre / tcp, need, "%.2fx")] if pre and tcp else []


class RowGroup:
    """Several rows filled by one run (redis-benchmark measures all its tests at once): the run
    returns ({row key: value}, transport); a failure fails every row."""

    def __init__(self, name, placement, rows):
        self.d = {"name": name, "placement": placement}
        self.rows = rows

    def add(self, values, transport):
        for k, row in self.rows.items():
            row.add(values[k], transport)

    def fail(self, err):
        for row in self.rows.values():
            row.fail(err)

    def finish(self):
        return [row.finish() for row in self.rows.values()]


def children_cpu_s():
    """User + system CPU seconds of every child process waited for so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_variants(bench, variants, reps, fmt):
    """Runs every (row, fn) variant reps times, interleaved (rep 1 of all, then rep 2, ...);
    fn() returns (value, transport) or (value, transport, operations): then the CPU time of
    every process the run started and waited for (both ends, start-up included), per
    operation, goes into the row's cpu_us.  A failed run is recorded in its row and the
    rest go on.  Returns the finished row dicts."""
    prog = Progress(bench, len(variants) * reps)
    for rep in range(reps):
        for row, fn in variants:
            what = "rep %d %s [%s]" % (rep + 1, row.d["name"], row.d["placement"])
            try:
                cpu0 = children_cpu_s()
                v, tr, *ops = fn()
                cpu = children_cpu_s() - cpu0
                row.add(v, tr, cpu * 1e6 / ops[0] if ops and ops[0] else None)
                prog.step("%s: %s (%s)" % (what, fmt(v), tr))
            except Exception as e:               # noqa: BLE001 - a failed run is recorded, the suite goes on
                row.fail(e)
                prog.step("%s: FAILED %s" % (what, str(e).strip().splitlines()[-1][:200] if str(e).strip() else e))
    out = []
    for row, _ in variants:
        d = row.finish()
        out += d if isinstance(d, list) else [d]
    return out


# ---------------------------------------------------------------------------------------------
# stream

def bench_stream(args, ctx):
    secs = args.duration or (0.2 if args.quick else 0.5)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(STREAM_SIZES)
    places, bins, log_file = ctx["places"], ctx["bins"], ctx["log_file"]
    variants = []
    for size in sizes:
        for pl, cpus in places.items():
            for preload in ((False,) if args.tcp_only else (False, True)):
                def fn(size=size, cpus=cpus, preload=preload):
                    mark = S.log_size(log_file)
                    v, port = sock_pair(bins["sockbench"], "tcp", "0", cpus, preload, "stream", size, secs,
                                        log_file if preload else None)
                    return v / 1e6, (verdict(log_file, mark, port) if preload else "tcp")
                variants.append((Row("stream", "rdmasock shm (C via LD_PRELOAD)" if preload else "TCP (C)", pl,
                                     cpus, "MB/s", baseline=not preload, rdmasock=preload, size=size,
                                     kind="preload" if preload else "tcp"), fn))

        def fn(size=size):
            res = S.run(S.pin(SERVER_CPU) + [bins["memcpybw"], str(size), str(secs)], timeout=secs + RUN_TIMEOUT)
            return float(re.search(r"bytes_per_s (\d+)", res.stdout.decode()).group(1)) / 1e6, "memcpy"
        variants.append((Row("stream", "memcpy into 4 MiB ring (limit)", "one CPU", [SERVER_CPU], "MB/s",
                             size=size, kind="limit"), fn))
    rows = run_variants("stream", variants, args.reps, lambda v: "%.0f MB/s" % v)
    set_ratios(rows, "tcp", keys=("size",))
    set_ratios(rows, "limit", "vs_limit", keys=("size",), digits=3)
    targets = ratio_target(rows, "64 KiB stream >= 3x TCP best", TARGETS["stream_64k_vs_tcp"], kind="preload",
                           size=64 << 10)
    summary = [RDMA_PLACEHOLDER]
    return {"rows": rows, "summary": summary, "targets": targets,
            "columns": ["size", "name", "placement", "median", "min", "max", "vs_tcp_best", "vs_limit", "status"],
            "title": "stream: one connection, writes of SIZE bytes, MB/s (%.1f s per repetition)" % secs}


# ---------------------------------------------------------------------------------------------
# redis

# ---------------------------------------------------------------------------------------------
# sockperf

SOCKPERF_SIZES = (64, 1000)


def sockperf_run(srv, size, secs, impl, cpu, log_file):
    """One `sockperf ping-pong --tcp` against srv, pinned to cpu: (one-way latency in us, as
    sockperf reports it, transport verdict).  --mps above sockperf's default: it sizes its
    sequence table for <= 600 k messages/s and aborts on a faster link."""
    mark = S.log_size(log_file)
    argv = S.pin(cpu) + S.preload_cmd([S.SOCKPERF, "ping-pong", "--tcp", "-i", "127.0.0.1", "-p", str(srv.port),
                                       "-t", "%g" % secs, "-m", str(size), "--mps", "10000000"], impl == "rdmasock")
    res = S.run(argv, timeout=120, env=S.client_env(log_file))
    out = res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")
    m = re.search(r"Summary: Latency is ([0-9.]+) usec", out)
    if not m or "ERROR" in out:
        raise RuntimeError("sockperf gave no latency:\n" + out[-1500:])
    return float(m.group(1)), ("tcp" if impl == "tcp" else verdict(log_file, mark, srv.port))


def bench_sockperf(args, ctx):
    secs = args.duration or (1 if args.quick else 2)
    impls = ["tcp"] if args.tcp_only else ["tcp", "rdmasock"]
    places, log_file = ctx["places"], ctx["log_file"]
    variants = []
    with server_pair(S.SockperfServer, impls, log_file) as servers:
        for size in SOCKPERF_SIZES:
            for pl, cpus in places.items():
                for impl in impls:
                    row = Row("sockperf", "ping-pong %d B %s" % (size, impl), pl, cpus, "us", baseline=(impl == "tcp"),
                              rdmasock=(impl == "rdmasock"), size=size, impl=impl, kind=impl)

                    def fn(size=size, cpus=cpus, impl=impl):
                        return sockperf_run(servers[impl], size, secs, impl, cpus[1], log_file)
                    variants.append((row, fn))
        rows = run_variants("sockperf", variants, args.reps, lambda v: "%.3f us" % v)
    # latency: lower is better, so the ratio is TCP's (same size and placement) over ours
    for r in rows:
        tcp = [t["median"] for t in rows if t["kind"] == "tcp" and t["size"] == r["size"] and
               t["placement"] == r["placement"] and t["median"] and t["status"] == "ok"]
        if tcp and r["median"]:
            r["speedup_vs_tcp"] = round(tcp[0] / r["median"], 2)
    return {"rows": rows, "summary": ["sockperf ping-pong --tcp -t %g, server on CPU %d, client on the placement's "
                                      "CPU; latency = half the round trip, as sockperf reports it" % (secs, SERVER_CPU)],
            "columns": ["name", "placement", "median", "min", "max", "speedup_vs_tcp", "status"],
            "title": "sockperf ping-pong over TCP, latency (us, lower is better)"}


def redis_requests(conns, quick):
    """redis-benchmark -n for the redis sub-benchmark."""
    n = 20000 if conns == 1 else 100000
    return n // 4 if quick else n


def redis_run(srv, tests, conns, n, impl, cpu, log_file, wait=None):
    """One `redis-benchmark -t TESTS -c conns -n n --csv` against srv, plain or preloaded, pinned
    to cpu.  Returns ({TEST: requests/s}, transport verdict).  wait: see S.run(while_running)."""
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
    return {t: rates[t] for t in want}, ("tcp" if impl == "tcp" else verdict(log_file, mark, srv.port, conns))


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
    return {"rows": rows, "summary": ["server on CPU %d; redis-benchmark -n %s, no pipelining" % (
                SERVER_CPU, ",".join(str(redis_requests(c, args.quick)) for c in conns_list))],
            "targets": targets,
            "columns": ["name", "conns", "placement", "impl", "median", "min", "max", "vs_tcp_best", "status"],
            "title": "redis-benchmark, requests/s"}


# ---------------------------------------------------------------------------------------------
# pgbench

@contextlib.contextmanager
def server_pair(cls, impls, log_file, **kw):
    """One fresh server of class cls (S.PgServer, S.RedisServer) per impl ("tcp": plain,
    "rdmasock": under `rdmasock run`), pinned to SERVER_CPU; yields {impl: server} and stops
    them all afterwards."""
    servers = {}
    try:
        for impl in impls:
            servers[impl] = cls(preload=(impl == "rdmasock"), cpu=SERVER_CPU, log_file=log_file, **kw).start()
            log("%s (%s) on port %d, CPU %d" % (cls.name, impl, servers[impl].port, SERVER_CPU))
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()


def pg_init(srv, dbname, scale, preload, log_file):
    """CREATE DATABASE dbname and `pgbench -i -s scale` it (client on SERVER_CPU)."""
    log("pgbench -i -s %d %s (%s server)" % (scale, dbname, "rdmasock" if preload else "plain"))
    S.run(S.psql_argv(srv.port) + ["-c", "CREATE DATABASE %s" % dbname], timeout=60, env=S.client_env())
    S.run(S.pin(SERVER_CPU) + S.preload_cmd([PGBENCH, "-h", "127.0.0.1", "-p", str(srv.port), "-U", "postgres",
                                             "-i", "-s", str(scale), "-q", dbname], preload),
          timeout=900, env=S.client_env(log_file))


def pgbench_run(srv, dbname, opts, impl, cpu, log_file, wait=None):
    """One pgbench run (opts: -c/-j/-T/...) against srv, plain (impl "tcp") or preloaded, pinned
    to cpu.  Returns (tps without initial connection time, transport verdict).
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
    return float(m.group(1)), ("tcp" if impl == "tcp" else verdict(log_file, mark, srv.port, conns))


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
            "summary": ["synchronous_commit=off, fsync=off; server on CPU %d; pgbench -j 1 -T %d" % (SERVER_CPU,
                                                                                                  duration)],
            "columns": ["scale", "clients", "name", "placement", "median", "min", "max", "vs_tcp_best", "status"],
            "title": "pgbench TPC-B, tps"}


# ---------------------------------------------------------------------------------------------
# replay

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


# ---------------------------------------------------------------------------------------------
# scale

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


def bench_scale(args, ctx):
    """pgbench and redis-benchmark GET with N concurrent connections: throughput and memory."""
    conns_list = sorted(int(c) for c in args.scale_conns.split(","))
    duration = max(3, round(args.duration or (3 if args.quick else 6)))   # pgbench -T includes connecting
    impls = ["tcp"] if args.tcp_only else ["tcp", "rdmasock"]
    places, log_file = ctx["places"], ctx["log_file"]
    pl = args.scale_placement if args.scale_placement in places else list(places)[-1]
    cpus = places[pl]
    tools = [t for t in args.scale_tools.split(",") if t]
    pg_opts = ["-S"] if args.scale_pg_script == "select" else []
    variants, est = [], {}

    def add(tool, impl, n, fn):
        row = Row("scale", "%s %s" % (tool, "TCP" if impl == "tcp" else "rdmasock shm"), pl, cpus,
                  "tps" if tool == "pgbench" else "req/s", baseline=(impl == "tcp"), rdmasock=(impl == "rdmasock"),
                  tool=tool, conns=n, kind=impl, pss_kib=[], rss_kib=[])

        def measured():
            sampler = MemorySampler(servers[tool][impl], n, min(1.0, duration / 4))
            v, tr = fn(sampler)
            if sampler.sample:
                row.d["pss_kib"].append(sampler.sample["pss"])
                row.d["rss_kib"].append(sampler.sample["rss"])
            else:
                row.d.setdefault("notes", []).append("memory not sampled: run ended first")
            return v, tr
        variants.append((row, measured))

    servers = {}
    with contextlib.ExitStack() as stack:
        if "pgbench" in tools:
            servers["pgbench"] = stack.enter_context(server_pair(
                S.PgServer, impls, log_file, settings={"max_connections": str(max(conns_list) + 20)}))
            for impl, srv in servers["pgbench"].items():
                pg_init(srv, "scale", 1, impl == "rdmasock", log_file)
            for n in conns_list:
                for impl in impls:
                    def fn(sampler, n=n, impl=impl):
                        return pgbench_run(servers["pgbench"][impl], "scale", pg_opts + [
                            "-c", str(n), "-j", str(min(n, 2)), "-T", str(duration)], impl, cpus[1], log_file,
                            wait=sampler)
                    add("pgbench", impl, n, fn)
        if "redis" in tools:
            servers["redis"] = stack.enter_context(server_pair(S.RedisServer, impls, log_file))
            for n in conns_list:
                for impl in impls:
                    def fn(sampler, n=n, impl=impl):
                        reqs = max(2000, 50 * n, int(est.get((impl, n), 20000) * duration))
                        rates, tr = redis_run(servers["redis"][impl], ["get"], n, reqs, impl, cpus[1], log_file,
                                              wait=sampler)
                        est[(impl, n)] = rates["GET"]       # the next repetition runs ~duration seconds
                        return rates["GET"], tr
                    add("redis", impl, n, fn)
        for impl in impls:                       # warm-up (not recorded), and redis' request-count estimate
            if "pgbench" in tools:
                pgbench_run(servers["pgbench"][impl], "scale", pg_opts + ["-c", str(max(conns_list)), "-j", "2",
                                                                          "-T", str(duration)], impl, cpus[1], log_file)
            if "redis" in tools:
                for n in conns_list:
                    est[(impl, n)] = redis_run(servers["redis"][impl], ["get"], n, max(5000, 20 * n), impl, cpus[1],
                                               log_file)[0]["GET"]
        log("scale warm-up done")
        rows = run_variants("scale", variants, args.reps, lambda v: "%.0f/s" % v)

    for r in rows:
        r["pss_mib"] = statistics.median(r["pss_kib"]) / 1024 if r["pss_kib"] else None
        r["rss_mib"] = statistics.median(r["rss_kib"]) / 1024 if r["rss_kib"] else None
        one = [b for b in rows if b["tool"] == r["tool"] and b["kind"] == r["kind"] and b["conns"] == 1]
        if r["conns"] > 1 and one and one[0]["pss_mib"] is not None and r["pss_mib"] is not None:
            r["kib_per_conn"] = round((r["pss_mib"] - one[0]["pss_mib"]) * 1024 / (r["conns"] - 1), 1)
    set_ratios(rows, "tcp", "vs_tcp", keys=("tool", "conns"))
    return {"rows": rows, "summary": [
                "server on CPU %d, client on CPU %d (%s); pgbench %s scale 1, -j min(N,2), -T %d, max_connections "
                "%d; redis-benchmark -t get, requests sized for ~%d s" % (
                    SERVER_CPU, cpus[1], pl, "-S (select-only)" if pg_opts else "TPC-B", duration,
                    max(conns_list) + 20, duration),
                "memory: PSS summed over the server's and the client's processes from /proc/PID/smaps_rollup, "
                "sampled once during each run after all N connections were established (median over the "
                "repetitions; kernel socket buffers are not included); KiB/conn = (PSS(N) - PSS(1)) / (N - 1)"],
            "targets": [],
            "columns": ["tool", "conns", "name", "median", "min", "max", "vs_tcp", "pss_mib", "kib_per_conn",
                        "status"],
            "title": "scale: N concurrent connections, throughput and memory, TCP vs rdmasock"}


# ---------------------------------------------------------------------------------------------
# report

def fmt_cell(v):
    if v is None:
        return ""
    if isinstance(v, float):
        if abs(v) >= 100:
            return "{:,.0f}".format(v)
        return "%.3g" % v
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


def size_label(n):
    return "%d MiB" % (n >> 20) if n >= 1 << 20 and n % (1 << 20) == 0 else (
        "%d KiB" % (n >> 10) if n >= 1024 and n % 1024 == 0 else "%d B" % n)


def markdown(result):
    out = ["# rdmasock bench: %s" % ", ".join(result["benchmarks"]), "",
           "%s, host %s, %d CPUs, %s. Repetitions: %d%s. Command: `%s`%s" % (
               result["time"], result["host"], result["cpus"], result["kernel"], result["reps"],
               " (--quick: smoke run, not a measurement)" if result["quick"] else "", result["command"],
               ". Checkout " + checkout_text(result["git"]) if result.get("git") else ""), ""]
    for name, b in result["results"].items():
        out += ["## %s" % name, ""] + markdown_section(b)
    out.append("median / min / max over the repetitions; status `ok` on a rdmasock row means every connection "
               "of every repetition logged transport=shm (the Soft-RoCE VM's rdma rows: transport=rdma) in "
               "RDMASOCK_LOG_FILE.")
    return "\n".join(out) + "\n"


def markdown_section(b):
    """Markdown lines of one sub-benchmark's result: title, table, summary and targets."""
    out = [b.get("title", ""), ""]
    if "error" in b:
        return out + ["**failed:** `%s`" % b["error"][-500:], ""]
    cols = b["columns"]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "---|" * len(cols))
    for r in b["rows"]:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(size_label(v) if c == "size" else fmt_cell(v))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for s in b.get("summary", []):
        out.append("- " + s)
    for t in b.get("targets", []):
        out.append("- target " + t["text"])
    out.append("")
    return out


def plots(result, stem):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plots skipped: matplotlib is not importable (apt-get install python3-matplotlib, "
            "or pip install matplotlib into the venv)")
        return []
    made = []
    for name, b in result["results"].items():
        rows = [r for r in b.get("rows", []) if r.get("median")]
        if not rows:
            continue
        if name == "scale":
            made.append(plot_scale(plt, rows, b.get("title", ""), "%s-%s.png" % (stem, name)))
            continue
        fig, ax = plt.subplots(figsize=(9, 4.8))
        if name == "stream":
            series = {}
            for r in rows:
                series.setdefault("%s [%s]" % (r["name"], r["placement"]), []).append(r)
            for label, rs in series.items():
                rs.sort(key=lambda r: r["size"])
                ax.errorbar([r["size"] for r in rs], [r["median"] for r in rs],
                            yerr=[[r["median"] - r["min"] for r in rs], [r["max"] - r["median"] for r in rs]],
                            marker="o", capsize=3, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("write size (bytes)")
            ax.legend(fontsize=7)
        else:
            labels = []
            for r in rows:
                parts = [r["name"]]
                for k in ("conns", "scale", "clients", "impl"):
                    if k in r:
                        parts.append("%s=%s" % (k, r[k]))
                parts.append(r["placement"])
                labels.append(" ".join(parts) + ("" if r["status"] == "ok" else " (!)"))
            ys = [r["median"] for r in rows]
            colors = ["tab:green" if r.get("rdmasock") else ("tab:gray" if r.get("kind") == "limit" else "tab:blue")
                      for r in rows]
            ax.barh(range(len(rows)), ys, color=colors,
                    xerr=[[r["median"] - r["min"] for r in rows], [r["max"] - r["median"] for r in rows]], capsize=2)
            ax.set_yticks(range(len(rows)))
            ax.set_yticklabels(labels, fontsize=7)
            ax.invert_yaxis()
            if name == "pingpong":
                ax.set_xscale("log")
            ax.set_xlabel(rows[0]["unit"] + " (median, min-max)")
        title = b.get("title", "")
        ax.set_title(title if title.startswith(name) else "%s: %s" % (name, title), fontsize=9)
        fig.tight_layout()
        path = "%s-%s.png" % (stem, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def plot_scale(plt, rows, title, path):
    """scale: per tool, throughput vs N (top) and PSS per extra connection vs N (bottom)."""
    tools = sorted({r["tool"] for r in rows})
    fig, axes = plt.subplots(2, len(tools), figsize=(6 * len(tools), 7.5), squeeze=False)
    for col, tool in enumerate(tools):
        top, bottom = axes[0][col], axes[1][col]
        for kind, color in (("tcp", "tab:blue"), ("rdmasock", "tab:green")):
            rs = sorted((r for r in rows if r["tool"] == tool and r["kind"] == kind), key=lambda r: r["conns"])
            if not rs:
                continue
            label = rs[0]["name"] + ("" if all(r["status"] == "ok" for r in rs) else " (!)")
            top.errorbar([r["conns"] for r in rs], [r["median"] for r in rs],
                         yerr=[[r["median"] - r["min"] for r in rs], [r["max"] - r["median"] for r in rs]],
                         marker="o", capsize=3, color=color, label=label)
            mem = [r for r in rs if r.get("kib_per_conn") is not None]
            bottom.plot([r["conns"] for r in mem], [r["kib_per_conn"] for r in mem], marker="o", color=color,
                        label=label)
        top.set_title("%s: throughput" % tool, fontsize=9)
        top.set_ylabel("tps" if tool == "pgbench" else "GET requests/s")
        bottom.set_title("%s: memory per extra connection, (PSS(N) - PSS(1)) / (N - 1)" % tool, fontsize=9)
        bottom.set_ylabel("KiB per connection")
        ns = sorted({r["conns"] for r in rows if r["tool"] == tool})
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns)
            ax.set_xticklabels([str(n) for n in ns])
            ax.set_xlabel("concurrent connections N")
            ax.legend(fontsize=7)
            ax.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_table(name, b):
    print("\n== %s: %s" % (name, b.get("title", "")))
    if "error" in b:
        print("FAILED: %s" % b["error"][-1000:])
        return
    cols = b["columns"]
    table = [cols] + [[size_label(r.get(c)) if c == "size" else fmt_cell(r.get(c)) for c in cols] for r in b["rows"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print("  ".join(cell.ljust(w) if i in (0, 1) or not cell[:1].isdigit() else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))
    for s in b.get("summary", []):
        print("  " + s)
    for t in b.get("targets", []):
        print("  target " + t["text"])


# ---------------------------------------------------------------------------------------------

def checkout_text(git):
    """'<head>' or '<head> (shim/ or rdmasock/ modified)' from git_state()."""
    return git["head"] + (" (shim/ or rdmasock/ modified)" if git["shim_or_rdmasock_modified"] else "")


def git_state():
    """Commit of the checkout and whether shim/ or rdmasock/ had uncommitted changes (the
    numbers belong to the library as built, which may differ from the commit)."""
    try:
        head = subprocess.run(["git", "-C", S.REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", S.REPO, "status", "--porcelain", "--", "shim", "rdmasock"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"head": head, "shim_or_rdmasock_modified": bool(dirty)}
    except (OSError, subprocess.TimeoutExpired):
        return None


def parser():
    ap = argparse.ArgumentParser(prog="rdmasock bench", description=__doc__,
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
    ap.add_argument("--scale-tools", default="pgbench,redis", help="scale: pgbench and/or redis")
    ap.add_argument("--scale-pg-script", choices=("select", "tpcb"), default="select",
                    help="scale: pgbench -S (default) or TPC-B; at scale 1 TPC-B's N clients all update the one "
                         "pgbench_branches row, so it measures row-lock waits more than connections")
    ap.add_argument("--scale-placement", default="cross", help="scale: same or cross (default cross)")
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
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
           "replay": bench_replay, "scale": bench_scale}
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


if __name__ == "__main__":
    sys.exit(main())
