"""RDMA rows of the benchmarks, measured in the Soft-RoCE VM (issue 4 point 8).

    .venv/bin/python bench/rdma_vm.py [--reps 5] [--seconds 3]

Boots the VM (scripts/softroce/run.sh, topology lo: rxe0 on the guest's loopback) and, on
the same rxe device in the same run, measures 64-byte round trips of:
  - TCP: bench/c/sockbench.c, plain;
  - rdmasock rdma, inline on and off: the same binary, both sides under LD_PRELOAD with
    RDMASOCK_TRANSPORTS=rdma (shm excluded), every connection checked to be rdma in the log;
  - raw verbs: perftest's ib_write_lat -s 64 (its t_typical is half a round trip).
Server on guest CPU 0, client on CPU 1 (taskset), interleaved repetitions, medians.
Prints our round-trip time divided by raw verbs' (target: at most 2x) and by TCP's, and
writes bench/results/rdma-vm-<time>.{json,md}.  The guest is emulated (TCG): absolute
figures are far from hardware; the ratios are what the run compares."""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORK = os.path.join(REPO, ".cache", "rdma-bench")
LIB = os.path.join(REPO, "rdmasock", "librdmasock.so")


def pin(cpu):
    return ["taskset", "-c", str(cpu)]


def sockbench_pair(binary, env, seconds):
    srv = subprocess.Popen(pin(0) + [binary, "server", "tcp", "0"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        line = srv.stdout.readline()
        port = re.match(r"port (\d+)", line).group(1)
        out = subprocess.run(pin(1) + [binary, "client", "tcp", port, "pingpong", "64", str(seconds)],
                             capture_output=True, text=True, env=env, timeout=seconds + 120).stdout
        return float(re.search(r"round_trips_per_s (\d+)", out).group(1))
    finally:
        try:
            srv.wait(20)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait(5)


def ib_write_lat(port, iters=3000):
    base = ["ib_write_lat", "-d", os.environ.get("SOFTROCE_DEVICE", "rxe0"), "-x", "1", "-s", "64",
            "-n", str(iters), "-F", "-p", str(port)]
    srv = subprocess.Popen(pin(0) + base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    cli = subprocess.run(pin(1) + base + ["127.0.0.1"], capture_output=True, text=True, timeout=300)
    srv.wait(60)
    m = re.search(r"^\s*64\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", cli.stdout, re.M)
    if not m:
        raise RuntimeError("ib_write_lat printed: %s" % cli.stdout[-800:])
    return float(m.group(3))                 # t_typical, microseconds, one way


def inner(args):
    binary = os.path.join(WORK, "sockbench")
    log = os.path.join(WORK, "rdma-vm.log")
    open(log, "w").close()
    base = dict(os.environ)
    pre = dict(base, LD_PRELOAD=LIB, RDMASOCK_TRANSPORTS="rdma", RDMASOCK_LOG_FILE=log,
               RDMASOCK_RDMA_DEVICE=os.environ.get("SOFTROCE_DEVICE", "rxe0"))
    variants = {"tcp": base, "rdmasock_rdma_inline": pre, "rdmasock_rdma_noinline": dict(pre, RDMASOCK_RDMA_INLINE="0")}
    res = {k: [] for k in variants}
    res["ib_write_lat_us"] = []
    for rep in range(args.reps):
        for name, env in variants.items():
            res[name].append(sockbench_pair(binary, env, args.seconds))
            print("rep %d %-24s %.0f rt/s" % (rep + 1, name, res[name][-1]), flush=True)
        res["ib_write_lat_us"].append(ib_write_lat(18600 + rep))
        print("rep %d %-24s %.2f us one way" % (rep + 1, "ib_write_lat", res["ib_write_lat_us"][-1]), flush=True)
    with open(log) as f:
        lines = f.read().splitlines()
    res["log_transports"] = sorted(set(re.findall(r"transport=(\w+)", "\n".join(lines))))
    res["log_connections"] = len(lines)
    with open(os.path.join(WORK, "result.json"), "w") as f:
        json.dump(res, f)


def outer(args):
    os.makedirs(WORK, exist_ok=True)
    subprocess.run(["cc", "-O2", "-Wall", "-o", os.path.join(WORK, "sockbench"),
                    os.path.join(HERE, "c", "sockbench.c")], check=True)
    result = os.path.join(WORK, "result.json")
    if os.path.exists(result):
        os.unlink(result)
    t0 = time.monotonic()
    p = subprocess.run([os.path.join(REPO, "scripts", "softroce", "run.sh"), "--quiet", "--topology", "lo",
                        "--timeout", "1500", "--", sys.executable, os.path.abspath(__file__), "--inner",
                        "--reps", str(args.reps), "--seconds", str(args.seconds)], cwd=REPO)
    if p.returncode or not os.path.exists(result):
        sys.exit("the VM run failed (exit %d)" % p.returncode)
    with open(result) as f:
        res = json.load(f)
    med = {k: statistics.median(v) for k, v in res.items() if k.startswith(("tcp", "rdmasock", "ib_"))}
    rtt = {k: 1e6 / med[k] for k in ("tcp", "rdmasock_rdma_inline", "rdmasock_rdma_noinline")}
    raw_rtt = 2 * med["ib_write_lat_us"]
    rows = [("TCP (sockbench, plain)", rtt["tcp"]), ("rdmasock rdma, inline (LD_PRELOAD)", rtt["rdmasock_rdma_inline"]),
            ("rdmasock rdma, no inline", rtt["rdmasock_rdma_noinline"]), ("raw verbs: ib_write_lat (2 x t_typical)", raw_rtt)]
    ok = res["log_transports"] == ["rdma"]
    md = ["# RDMA in the Soft-RoCE VM: 64-byte round trips (median of %d, %s s each)" % (args.reps, args.seconds), "",
          "Guest: TCG-emulated, 2 vCPUs, rxe0 on loopback; server CPU 0, client CPU 1.  Log: %d connections, transports %s%s."
          % (res["log_connections"], ",".join(res["log_transports"]), "" if ok else " (NOT all rdma)"), "",
          "| variant | round trip (us) | round trips/s | vs raw verbs | vs TCP |", "|---|---|---|---|---|"]
    for name, us in rows:
        md.append("| %s | %.1f | %.0f | %.2fx | %.2fx |" % (name, us, 1e6 / us, us / raw_rtt, us / rtt["tcp"]))
    ratio = rtt["rdmasock_rdma_inline"] / raw_rtt
    md += ["", "Target: rdmasock rdma round trip at most 2x raw verbs: %.2fx, %s." % (ratio, "met" if ratio <= 2 else "missed"),
           "", "Raw figures: " + json.dumps(res)]
    text = "\n".join(md) + "\n"
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.join(HERE, "results", "rdma-vm-%s" % stamp)
    with open(out + ".md", "w") as f:
        f.write(text)
    with open(out + ".json", "w") as f:
        json.dump(dict(res, medians=med, wall_s=round(time.monotonic() - t0, 1)), f, indent=1)
    print("written: %s.md / .json" % out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3)
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    inner(a) if a.inner else outer(a)


if __name__ == "__main__":
    main()
