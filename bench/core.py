"""Core benchmark: plain TCP vs rdmasock between two pinned processes on this host.

    .venv/bin/python bench/core.py [--quick] [--reps N] [--tests pingpong,stream]

Each cell (test, size, impl, placement) runs --reps repetitions; every repetition
starts a fresh server and client (bench/worker.py) pinned with `taskset -c`.
Placements: "same" (both on CPU 0) and "cross" (server CPU 0, client CPU 1).
rdmasock's best placement is compared with TCP's best placement.
Results: table on stdout, progress on stderr, JSON in bench/results/."""
import argparse
import importlib.util
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "worker.py")
RESULTS = os.path.join(HERE, "results")

IMPLS = ("tcp", "rdmasock")
STREAM_SIZES = (64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
PINGPONG_SIZE = 64
TARGETS = {("pingpong", 64): 5.0, ("stream", 64 << 10): 2.0}   # rdmasock / TCP best
TARGET_S = 0.3                 # aim for this many seconds per timed repetition
ACCEPT_S = (0.2, 0.6)          # a first run outside this is a calibration run, not counted
RUN_TIMEOUT = 60               # seconds, per process
_portfiles = itertools.count()


def placements():
    """name -> (server CPU, client CPU)."""
    p = {"same": (0, 0)}
    if (os.cpu_count() or 1) > 1:
        p["cross"] = (0, 1)
    return p


def initial_n(test, size, impl):
    """First guess of N; calibrate() corrects it from a real run."""
    fast = impl == "rdmasock"
    if test == "pingpong":
        return 100_000 if fast else 20_000
    total = (512 if fast else 256) << 20
    cap = 1_000_000 if fast else 100_000      # keeps tiny writes from running for seconds
    return max(200, min(total // size, cap))


def worker_env():
    env = dict(os.environ)
    if importlib.util.find_spec("rdmasock") is None:   # not installed: use the checkout
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _stop(proc, timeout):
    """Wait for proc up to timeout seconds, then kill it (by its PID)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def run_once(test, size, impl, cpus, n, tmpdir, env):
    """One repetition: fresh server + client. Returns the client's JSON dict; raises on failure."""
    portfile = os.path.join(tmpdir, "port-%d-%d" % (os.getpid(), next(_portfiles)))
    pin = lambda cpu: ["taskset", "-c", str(cpu), sys.executable, WORKER]
    server = subprocess.Popen(pin(cpus[0]) + ["server", impl, portfile], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = None
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(portfile):
            if server.poll() is not None:
                raise RuntimeError("server exited %s: %s" % (server.returncode, server.stderr.read().decode()[-500:]))
            if time.monotonic() > deadline:
                raise RuntimeError("server wrote no port file within 10 s")
            time.sleep(0.005)
        with open(portfile) as f:
            port = f.read().strip()
        client = subprocess.Popen(pin(cpus[1]) + ["client", impl, port, test, str(size), str(n)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = client.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RuntimeError("client timed out after %d s" % RUN_TIMEOUT)
        if client.returncode != 0:
            raise RuntimeError("client exited %d: %s" % (client.returncode, err.decode()[-500:]))
        if _stop(server, 10) is None:
            raise RuntimeError("server did not exit after the client finished")
        return json.loads(out.decode().strip().splitlines()[-1])
    finally:
        for p in (client, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if server.stderr:
            server.stderr.close()


def measure_cell(test, size, impl, placement, reps, tmpdir, env=None):
    """Run one cell; returns a dict with status, n, reps (rates) and median/min/max."""
    env = env or worker_env()
    cpus = placements()[placement]
    key = "ops_per_s" if test == "pingpong" else "mb_per_s"
    cell = {"test": test, "size": size, "impl": impl, "placement": placement, "cpus": list(cpus),
            "metric": key, "status": "ok", "runs": [], "calibration": []}
    n = initial_n(test, size, impl)
    try:
        for _ in range(3):                   # calibrate N: a run far from TARGET_S is not counted
            r = run_once(test, size, impl, cpus, n, tmpdir, env)
            if ACCEPT_S[0] <= r["seconds"] <= ACCEPT_S[1]:
                cell["runs"].append(r)
                break
            cell["calibration"].append(r)
            n = max(200, int(n * TARGET_S / max(r["seconds"], 1e-6)))
        while len(cell["runs"]) < reps:
            cell["runs"].append(run_once(test, size, impl, cpus, n, tmpdir, env))
    except Exception as e:                   # worker crash, timeout, bad output
        cell["status"], cell["error"] = "failed", str(e)
    cell["n"] = n
    transports = sorted({r["transport"] for r in cell["runs"] + cell["calibration"]})
    cell["transports"] = transports
    if cell["status"] == "ok" and impl == "rdmasock" and transports != ["shm"]:
        cell["status"] = "fallback"          # rdmasock did not upgrade: not a shm measurement
    values = [r[key] for r in cell["runs"]]
    if values:
        cell.update(median=statistics.median(values), min=min(values), max=max(values),
                    seconds=[r["seconds"] for r in cell["runs"]])
    return cell


def best(cells, impl):
    """The ok cell of impl with the highest median, or None."""
    ok = [c for c in cells if c["impl"] == impl and c["status"] == "ok"]
    return max(ok, key=lambda c: c["median"]) if ok else None


def compare(cells):
    """cells of one (test, size) -> (tcp best, rdmasock best, ratio or None)."""
    t, r = best(cells, "tcp"), best(cells, "rdmasock")
    return t, r, (r["median"] / t["median"] if t and r else None)


def fmt_size(size):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= div and size % div == 0:
            return "%d %s" % (size // div, unit)
    return "%d B" % size


def fmt_rate(cell):
    if cell is None:
        return "n/a"
    unit = "rt/s" if cell["test"] == "pingpong" else "MB/s"
    return "{:,.0f} {} ({})".format(cell["median"], unit, cell["placement"])


def progress(i, total, c):
    if "median" in c:
        unit = "rt/s" if c["test"] == "pingpong" else "MB/s"
        what = "median {:,.0f} {} (min {:,.0f}, max {:,.0f}), n={}".format(c["median"], unit, c["min"], c["max"], c["n"])
    else:
        what = "no result"
    status = "" if c["status"] == "ok" else "  [%s: %s]" % (c["status"].upper(), c.get("error") or "transport=" + ",".join(c["transports"]))
    print("[%d/%d] %-8s %7s %-8s %-5s %s%s" % (i, total, c["test"], fmt_size(c["size"]), c["impl"], c["placement"], what, status),
          file=sys.stderr, flush=True)


def machine_info():
    info = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0], "executable": sys.executable,
            "kernel": platform.release(), "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "rdmasock_env": {k: v for k, v in os.environ.items() if k.startswith("RDMASOCK_")}}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
        info["git_commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                            text=True, timeout=5).stdout.strip() or None
    except Exception:
        pass
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="ping-pong and the 64 KiB stream only")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per cell (default 5)")
    ap.add_argument("--tests", default="pingpong,stream", help="comma list of pingpong,stream")
    args = ap.parse_args(argv)
    tests = [t.strip() for t in args.tests.split(",") if t.strip()]
    if not tests or set(tests) - {"pingpong", "stream"} or args.reps < 1:
        ap.error("--tests takes pingpong and/or stream; --reps must be >= 1")

    groups = []                              # (test, size)
    if "pingpong" in tests:
        groups.append(("pingpong", PINGPONG_SIZE))
    if "stream" in tests:
        groups += [("stream", s) for s in ((64 << 10,) if args.quick else STREAM_SIZES)]
    plan = [(t, s, i, p) for t, s in groups for i in IMPLS for p in placements()]

    env, cells, t0 = worker_env(), [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rdmasock-bench-") as tmp:
        for k, (t, s, i, p) in enumerate(plan, 1):
            cells.append(measure_cell(t, s, i, p, args.reps, tmp, env))
            progress(k, len(plan), cells[-1])
    elapsed = time.monotonic() - t0

    rows, summary = [], []
    for t, s in groups:
        tb, rb, ratio = compare([c for c in cells if (c["test"], c["size"]) == (t, s)])
        target = TARGETS.get((t, s))
        verdict = "" if target is None else ">= %gx: %s" % (target, "PASS" if ratio and ratio >= target else "MISS")
        rows.append((t, fmt_size(s), fmt_rate(tb), fmt_rate(rb), "%.2fx" % ratio if ratio else "n/a", verdict))
        summary.append({"test": t, "size": s, "tcp_best": tb and tb["placement"], "rdmasock_best": rb and rb["placement"],
                        "tcp_median": tb and tb["median"], "rdmasock_median": rb and rb["median"],
                        "ratio": ratio, "target": target, "pass": None if target is None else bool(ratio and ratio >= target)})

    head = ("test", "size", "TCP best (placement)", "rdmasock best (placement)", "ratio", "target")
    widths = [max(len(r[j]) for r in rows + [head]) for j in range(len(head))]
    line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
    print(line(head))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))
    bad = [c for c in cells if c["status"] != "ok"]
    for c in bad:
        print("NOTE: %s %s %s %s: %s" % (c["test"], fmt_size(c["size"]), c["impl"], c["placement"],
              "FAILED: " + c["error"] if c["status"] == "failed"
              else "FALLBACK: rdmasock did not use shm (transport=%s); excluded" % ",".join(c["transports"])))
    print("ratio = rdmasock best placement / TCP best placement (medians of %d reps); %.0f s total"
          % (args.reps, elapsed))

    os.makedirs(RESULTS, exist_ok=True)
    doc = {"machine": machine_info(), "args": vars(args), "elapsed_s": elapsed,
           "placements": placements(), "summary": summary, "cells": cells}
    path = os.path.join(RESULTS, "core-%s.json" % time.strftime("%Y%m%d-%H%M%S"))
    for p in (path, os.path.join(RESULTS, "core-latest.json")):
        with open(p, "w") as f:
            json.dump(doc, f, indent=1)
    print("results: %s" % os.path.relpath(path, ROOT))
    return 1 if any(c["status"] == "failed" for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
