"""RDMA rows of the pingpong benchmark, measured in the Soft-RoCE VM (issue 4 point 8, issue 5).

`rdmasock bench pingpong` (pingpong.pingpong_vm) runs this measurement and puts its rows into
the pingpong table.  The VM exists only in a source checkout (scripts/softroce/): an installed
rdmasock reports the rows as not measured, with that reason.

Boots the VM (scripts/softroce/run.sh, topology lo: rxe0 on the guest's loopback) and, on
the same rxe device in the same run, measures 64-byte round trips of:
  - TCP: bench/c/sockbench.c, plain;
  - rdmasock rdma, inline on and off: the same binary, both sides with the library in
    LD_PRELOAD and RDMASOCK_TRANSPORTS=rdma (shm excluded); every connection must log
    transport=rdma, else the row is marked;
  - raw verbs: perftest's ib_write_lat -s 64 (its t_typical is half a round trip).
Server on guest CPU 0, client on CPU 1 (taskset), interleaved repetitions (common.run_variants
inside the guest, with common.sock_pair and common.verdict), median/min/max in round trips/s.
The guest is emulated (TCG): absolute figures are far from hardware; the ratios within the
VM are what the run compares (target: rdma round trip at most 2x ib_write_lat's)."""
import argparse
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from . import servers as S
from .common import Row, _err, compile_c, run_variants, sock_pair, stop, verdict

REPO = S.REPO                                            # the checkout this package lies in, if any
RUN = os.path.join(REPO, "scripts", "softroce", "run.sh")
VM_TESTS = os.path.join(REPO, "tests", "test_rdma_vm.py")
WORK = os.path.join(REPO, ".cache", "rdma-bench")        # the guest sees the repository, not the host's /tmp
CPUS = (0, 1)                                            # guest CPUs: server, client
PLACEMENT = "VM cross"
IB_WRITE_LAT_ITERS = 3000
NAMES = {"tcp": "TCP (Soft-RoCE VM)",
         "inline": "rdmasock rdma, inline on (Soft-RoCE VM)",
         "noinline": "rdmasock rdma, inline off (Soft-RoCE VM)",
         "raw": "ib_write_lat (Soft-RoCE VM, raw verbs)"}


def vm_missing():
    """Why the VM cannot run here, or None: the test suite's check (tests/test_rdma_vm.py
    _vm_missing: QEMU, a guest kernel with rdma_rxe, pyverbs), plus perftest's ib_write_lat,
    which the guest runs from the host's (read-only) root."""
    if not os.path.exists(RUN):
        return ("the Soft-RoCE VM runs from a source checkout (scripts/softroce/run.sh), "
                "which this installed rdmasock is not")
    try:
        spec = importlib.util.spec_from_file_location("_rdmasock_test_rdma_vm", VM_TESTS)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        why = mod._vm_missing()
    except Exception as e:                   # noqa: BLE001 - reported as the reason
        return "cannot run the VM prerequisites check of %s: %s: %s" % (os.path.relpath(VM_TESTS, REPO),
                                                                         type(e).__name__, e)
    if why:
        return why
    if not shutil.which("ib_write_lat"):
        return "ib_write_lat is not installed (package perftest; scripts/softroce/setup.sh)"
    return None


def measure(reps, seconds, lib, echo=print):
    """Boots the VM and runs `reps` interleaved repetitions of `seconds` each; returns
    (the finished row dicts of the four variants, wall seconds of the VM part, boot included).
    Each output line of the guest (progress) is passed to echo.  Raises RuntimeError if the
    VM run fails."""
    os.makedirs(WORK, exist_ok=True)
    job = tempfile.mkdtemp(prefix="run-", dir=WORK)
    try:
        binary, out = compile_c(job, ("sockbench",))["sockbench"], os.path.join(job, "rows.json")
        timeout = 600 + reps * 4 * (seconds + 30)
        cmd = [RUN, "--quiet", "--topology", "lo", "--timeout", str(int(timeout)), "--", sys.executable,
               "-m", __name__, "--inner", "--reps", str(reps), "--seconds", str(seconds),
               "--binary", binary, "--lib", lib, "--out", out]
        t0 = time.monotonic()
        tail = []
        with subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace") as p:
            for line in p.stdout:            # run.sh bounds the VM's life (timeout + its boot margin)
                echo(line.rstrip("\n"))
                tail = (tail + [line])[-30:]
        wall = time.monotonic() - t0
        if p.returncode or not os.path.exists(out):
            raise RuntimeError("the Soft-RoCE VM run failed (scripts/softroce/run.sh exit %d%s)\n%s"
                               % (p.returncode, "" if p.returncode else ", no rows written", "".join(tail)[-1500:]))
        with open(out) as f:
            return json.load(f), wall
    finally:
        shutil.rmtree(job, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# inside the guest

def listening(pid, port):
    """Whether process pid has a TCP socket listening on port."""
    import psutil                            # in the venv (an rdmasock dependency); needed in the guest only
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    except psutil.Error:
        return False


def ib_write_lat(port):
    """One ib_write_lat -s 64 run on the rxe device; returns its t_typical (us, one way)."""
    base = ["ib_write_lat", "-d", os.environ.get("SOFTROCE_DEVICE", "rxe0"), "-x", "1", "-s", "64",
            "-n", str(IB_WRITE_LAT_ITERS), "-F", "-p", str(port)]
    srv = subprocess.Popen(S.pin(CPUS[0]) + base, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, start_new_session=True)
    try:                                     # the client gives up if the server is not listening yet
        if not S.wait_until(lambda: srv.poll() is not None or listening(srv.pid, port), 60, interval=0.1) \
                or srv.poll() is not None:
            raise RuntimeError("ib_write_lat server not listening on port %d %s" % (port, _err(srv)))
        out = S.run(S.pin(CPUS[1]) + base + ["127.0.0.1"], timeout=300).stdout.decode(errors="replace")
    finally:
        stop(srv, 60)
    m = re.search(r"^\s*64\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out, re.M)
    if not m:
        raise RuntimeError("ib_write_lat printed: %s" % out[-800:])
    return float(m.group(3))


def inner(a):
    """Runs in the guest: the four variants through run_variants; writes the rows to a.out."""
    work = tempfile.mkdtemp(prefix="rs-rdma-vm-")      # the guest's private /tmp
    try:
        rows = run_variants("pingpong VM", guest_variants(a, S.make_log_file(work, "rdmasock.log")), a.reps,
                                  lambda v: "%.0f rt/s" % v)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(a.out, "w") as f:
        json.dump(rows, f)


def guest_variants(a, log_file):
    """(Row, fn) of the four variants, for run_variants in the guest."""
    pre = {"LD_PRELOAD": a.lib, "RDMASOCK_TRANSPORTS": "rdma",
           "RDMASOCK_RDMA_DEVICE": os.environ.get("SOFTROCE_DEVICE", "rxe0")}
    variants = []
    for key, env in (("tcp", None), ("inline", pre), ("noinline", dict(pre, RDMASOCK_RDMA_INLINE="0"))):
        def fn(env=env):
            mark = S.log_size(log_file)
            v, port = sock_pair(a.binary, "tcp", "0", CPUS, False, "pingpong", 64, a.seconds,
                                      log_file if env else None, env)
            return v, (verdict(log_file, mark, port, expect="rdma") if env else "tcp")
        variants.append((Row("pingpong", NAMES[key], PLACEMENT, CPUS, "rt/s", baseline=env is None,
                                   rdmasock=env is not None, kind="tcp" if env is None else "rdma",
                                   inline=None if env is None else key == "inline", expect="rdma", vm=True), fn))
    ports = itertools.count(18600)
    variants.append((Row("pingpong", NAMES["raw"], PLACEMENT, CPUS, "rt/s", kind="limit", vm=True),
                     lambda: (1e6 / (2 * ib_write_lat(next(ports))), "rdma-verbs")))
    return variants


# ---------------------------------------------------------------------------------------------

def main(argv=None):
    """In the guest (measure() starts it there): the measurement, rows written to --out."""
    ap = argparse.ArgumentParser(description="the guest side of " + __name__)
    ap.add_argument("--inner", action="store_true", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3)
    ap.add_argument("--binary", required=True)                   # sockbench
    ap.add_argument("--lib", required=True)                      # librdmasock.so
    ap.add_argument("--out", required=True)                      # rows JSON
    inner(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
