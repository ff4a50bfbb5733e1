"""pingpong: 64-byte round trips/s, sockbench over TCP / Unix socket / rdmasock, the Python
API, the raw shared-memory spin limit, and the Soft-RoCE VM's rdma rows (rdma_vm.py)."""
import json
import os
import re
import subprocess

from . import rdma_vm, servers as S
from .common import (RUN_TIMEOUT, Row, TARGETS, WORKER, _err, best, log, placeholder_row, run_variants,
                     set_ratios, sock_pair, stop, target, verdict)


PINGPONG_COLUMNS = ["name", "placement", "median", "min", "max", "rtt_us", "cpu_us", "vs_tcp_best", "vs_limit", "status"]
VM_PLACEHOLDER = "rdmasock rdma, inline on / off (Soft-RoCE VM)"


def py_pair(impl, cpus, n, workdir, seq, test="pingpong", size=64):
    """One run of bench/worker.py: n round trips (pingpong) or writes (stream) of size bytes;
    returns (round trips or writes per second, transport)."""
    portfile = os.path.join(workdir, "port-%d" % seq)
    env = S.base_env()
    srv = subprocess.Popen(S.pin(cpus[0]) + [S.VENV_PY, WORKER, "server", impl, portfile],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                           start_new_session=True)
    try:
        if not S.wait_until(lambda: os.path.exists(portfile) or srv.poll() is not None, 30) \
                or not os.path.exists(portfile):
            raise RuntimeError("python worker server did not start %s" % _err(srv))
        with open(portfile) as f:
            port = f.read().strip()
        res = S.run(S.pin(cpus[1]) + [S.VENV_PY, WORKER, "client", impl, port, test, str(size), str(n)],
                    timeout=RUN_TIMEOUT, env=env)
        d = json.loads(res.stdout.decode().strip().splitlines()[-1])
        return d["ops_per_s"], d["transport"]
    finally:
        stop(srv)


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


def pingpong_vm(args):
    """The Soft-RoCE VM rows of pingpong, from one VM run (rdma_vm.py): TCP, rdmasock rdma
    with inline on and off, ib_write_lat, on the same rxe device.  Their ratios compare within the
    VM only (vs_tcp_best: the VM's TCP row; vs_limit: ib_write_lat): the host's TCP and spin limit
    do not apply to the emulated guest.  If the VM cannot run, or with --no-rdma / --tcp-only, one
    placeholder row says why.  Returns {rows, summary, targets, columns, title}."""
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
