"""Short demo: 64-byte ping-pong round trips/s, plain TCP vs rdmasock (shared memory).

    .venv/bin/python bench/demo.py

Each impl runs at every placement (same CPU, and cross CPU on a multi-core machine),
5 repetitions each; the median of the best placement is shown."""
import sys
import tempfile

import core


def main():
    reps, env, cells = 5, core.worker_env(), []
    print("64-byte ping-pong between two processes on this host (median of %d runs)..." % reps, flush=True)
    with tempfile.TemporaryDirectory(prefix="rdmasock-demo-") as tmp:
        for impl in core.IMPLS:
            for placement in core.placements():
                cells.append(core.measure_cell("pingpong", core.PINGPONG_SIZE, impl, placement, reps, tmp, env))
    tcp, rs, ratio = core.compare(cells)
    for c in cells:
        if c["status"] != "ok":
            print("  note: %s (%s) %s" % (c["impl"], c["placement"],
                  c.get("error") or "fell back to %s, not counted" % ",".join(c["transports"])))
    names = {"same": "same CPU", "cross": "cross CPU"}
    for label, c in (("TCP (best placement", tcp), ("rdmasock shm (best placement", rs)):
        if c:
            print("{:<40} {:>9,.0f} round trips/s".format("%s, %s):" % (label, names[c["placement"]]), c["median"]))
    if ratio is None:
        print("speed-up: n/a (a measurement failed)")
        return 1
    print("speed-up: %.1fx" % ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
