"""stream: throughput of writes of 64 B .. 1 MiB, TCP vs rdmasock, memcpy bandwidth on one CPU
as the limit, and a raw two-process stream through shared memory (bench/c/shmstream.c) as
what moving bytes between two CPUs costs at least."""
import re

from . import servers as S
from .common import (RDMA_PLACEHOLDER, RUN_TIMEOUT, Row, SERVER_CPU, TARGETS, best, ratio_target, run_variants,
                     set_ratios, sock_pair, verdict)
from .pingpong import py_pair


STREAM_SIZES = (64, 256, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
PY_STREAM_SIZE = 64 << 10       # the Python API's bulk row: socket.socket vs rdmasock.socket


def python_variants(args, ctx, secs):
    """(Row, fn) pairs: 64 KiB writes between two Python processes (bench/worker.py)."""
    variants = []
    for impl in (("tcp",) if args.tcp_only else ("tcp", "rdmasock")):
        for pl, cpus in ctx["places"].items():
            key = (impl, pl)
            ctx.setdefault("py_stream_n", {})[key] = 2000

            def fn(impl=impl, cpus=cpus, key=key):
                ctx["seq"] += 1
                n = ctx["py_stream_n"][key]
                v, tr = py_pair(impl, cpus, n, ctx["work"], ctx["seq"], "stream", PY_STREAM_SIZE)
                ctx["py_stream_n"][key] = max(200, int(v * secs))     # the next repetition runs ~secs
                return v * PY_STREAM_SIZE / 1e6, tr
            label = "TCP (Python socket)" if impl == "tcp" else "rdmasock shm, Python API"
            variants.append((Row("stream", label, pl, cpus, "MB/s", rdmasock=(impl == "rdmasock"),
                                 size=PY_STREAM_SIZE, kind="python-" + impl), fn))
    return variants


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
        if "cross" in places:
            def fn(size=size, cpus=places["cross"]):
                res = S.run(["taskset", "-c", "%d,%d" % cpus, bins["shmstream"], str(cpus[0]), str(cpus[1]),
                             str(size), str(secs)], timeout=secs + RUN_TIMEOUT)
                return float(re.search(r"bytes_per_s (\d+)", res.stdout.decode()).group(1)) / 1e6, "shm-raw"
            variants.append((Row("stream", "raw shared-memory stream (two copies)", "cross", places["cross"],
                                 "MB/s", size=size, kind="xlimit"), fn))
    if PY_STREAM_SIZE in sizes:
        variants += python_variants(args, ctx, secs)
    rows = run_variants("stream", variants, args.reps, lambda v: "%.0f MB/s" % v)
    set_ratios(rows, "tcp", keys=("size",))
    set_ratios(rows, "limit", "vs_limit", keys=("size",), digits=3)
    set_ratios(rows, "xlimit", "vs_raw", keys=("size",), digits=3)
    targets = ratio_target(rows, "64 KiB stream >= 3x TCP best", TARGETS["stream_64k_vs_tcp"], kind="preload",
                           size=64 << 10)
    summary = [RDMA_PLACEHOLDER]
    raw, mem = best(rows, "xlimit", size=64 << 10), best(rows, "limit", size=64 << 10)
    pre = best(rows, "preload", size=64 << 10, placement="cross")
    if raw and mem and pre:
        summary.append("64 KiB across CPUs: rdmasock %.0f MB/s is %.2f of the raw two-process stream (%.0f MB/s), "
                       "which is itself %.2f of memcpy on one CPU (%.0f MB/s)" % (pre, pre / raw, raw, raw / mem, mem))
    for pl in ctx["places"]:
        py_tcp = best(rows, "python-tcp", placement=pl)
        py_rs = best(rows, "python-rdmasock", placement=pl)
        if py_tcp and py_rs:
            summary.append("Python API, 64 KiB writes [%s]: rdmasock.socket %.0f MB/s vs socket.socket %.0f MB/s "
                           "(%.2fx)" % (pl, py_rs, py_tcp, py_rs / py_tcp))
    return {"rows": rows, "summary": summary, "targets": targets,
            "columns": ["size", "name", "placement", "median", "min", "max", "vs_tcp_best", "vs_limit", "vs_raw",
                        "status"],
            "title": "stream: one connection, writes of SIZE bytes, MB/s (%.1f s per repetition)" % secs}
