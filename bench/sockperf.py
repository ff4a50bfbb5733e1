"""sockperf: the libvma-world latency tool's TCP ping-pong, plain vs preloaded."""
import re

from . import servers as S
from .common import Row, SERVER_CPU, run_variants, server_pair, verdict


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
