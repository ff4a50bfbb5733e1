"""What every benchmark of the suite shares: rows and repetitions, pinning, the transport
verdict from the rdmasock log, the C programs, and the targets."""
import contextlib
import os
import re
import resource
import select
import statistics
import subprocess
import sys
import time

import psutil

from . import servers as S


HERE = os.path.dirname(os.path.abspath(__file__))
# bench/results in a source checkout (where the README's figures come from); an installed
# rdmasock writes under the current directory instead of into its own package.
RESULTS = (os.path.join(HERE, "results") if os.path.exists(os.path.join(os.path.dirname(HERE), "pyproject.toml"))
           else os.path.join(os.getcwd(), "rdmasock-bench-results"))
CSRC = os.path.join(HERE, "c")
WORKER = os.path.join(HERE, "worker.py")
SERVER_CPU = 0
RUN_TIMEOUT = 120
BENCHES = ("pingpong", "stream", "sockperf", "redis", "pgbench", "replay", "scale", "idle")
PGBENCH = "/usr/bin/pgbench"
REDIS_BENCHMARK = "/usr/bin/redis-benchmark"
RDMA_PLACEHOLDER = "rdma: not measured here; the Soft-RoCE VM measures pingpong (bench/rdma_vm.py)"
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
        p["crowded"] = (SERVER_CPU, 1)        # as cross, each CPU shared with a busy loop (scale only)
    p["unpinned"] = (None, None)              # the scheduler places everything (scale only)
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


def compile_c(workdir, names=("sockbench", "shmspin", "memcpybw", "shmstream")):
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

    def add(self, values, transport, cpu_us=None):
        """cpu_us: CPU per operation of the whole run (all its rows' operations together)."""
        for k, row in self.rows.items():
            row.add(values[k], transport, cpu_us)

    def fail(self, err):
        for row in self.rows.values():
            row.fail(err)

    def finish(self):
        return [row.finish() for row in self.rows.values()]


def children_cpu_s():
    """User + system CPU seconds of every child process waited for so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


_servers = []        # running servers (server_pair): their CPU counts in every run's cpu_us


def servers_cpu_s():
    """User + system CPU seconds of every running server's processes, with what the ones
    that ended (PostgreSQL backends) left in their parents' children times."""
    total = 0.0
    for srv in _servers:
        for pid in srv.pids():
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
    return total


def run_variants(bench, variants, reps, fmt):
    """Runs every (row, fn) variant reps times, interleaved (rep 1 of all, then rep 2, ...);
    fn() returns (value, transport) or (value, transport, operations): then the CPU time of
    every process the run started and waited for and of the running servers (both ends,
    start-up included), per operation, goes into the row's cpu_us.  A failed run is recorded in its row and the
    rest go on.  Returns the finished row dicts."""
    prog = Progress(bench, len(variants) * reps)
    for rep in range(reps):
        for row, fn in variants:
            what = "rep %d %s [%s]" % (rep + 1, row.d["name"], row.d["placement"])
            try:
                cpu0 = children_cpu_s() + servers_cpu_s()
                v, tr, *ops = fn()
                cpu = children_cpu_s() + servers_cpu_s() - cpu0
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


@contextlib.contextmanager
def server_pair(cls, impls, log_file, cpu=SERVER_CPU, **kw):
    """One fresh server of class cls (S.PgServer, S.RedisServer) per impl ("tcp": plain,
    "rdmasock": under `rdmasock run`), pinned to cpu (None: not pinned); yields {impl: server}
    and stops them all afterwards."""
    servers = {}
    try:
        for impl in impls:
            servers[impl] = cls(preload=(impl == "rdmasock"), cpu=cpu, log_file=log_file, **kw).start()
            _servers.append(servers[impl])
            log("%s (%s) on port %d, CPU %s" % (cls.name, impl, servers[impl].port, "any" if cpu is None else cpu))
        yield servers
    finally:
        for srv in servers.values():
            if srv in _servers:
                _servers.remove(srv)
            srv.stop()
