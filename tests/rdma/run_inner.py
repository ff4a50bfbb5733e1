#!/usr/bin/env python3
"""Runs the RDMA inner tests in sequence (one VM boot for all of them) and writes a JSON
summary.  Used by tests/test_rdma_vm.py; also by hand:

    scripts/softroce/run.sh --topology lo,two-hosts -- .venv/bin/python tests/rdma/run_inner.py
    .venv/bin/python tests/rdma/run_inner.py --mode host       # a host with an RDMA device

Cases (`--only a,b`):
  checks         devices report / choice, PARAMS codec, C posts on the QP rs_verbs.c made (checks.py)
  memlock        RLIMIT_MEMLOCK 64 KiB, no CAP_IPC_LOCK: usable() says why, registration refused
  ring_lo        two processes, one device: framed messages RDMA-written into a ring (ring_write.py)
  qp_error       QP forced to ERR, remote access error, peer QP destroyed (faults.py)
  two_hosts      ring_write.py between network namespaces rs-h1 / rs-h2, rxe-h1 -> rxe-h2 (VM)
  device_events  netdev down/up and `rdma link delete` under a streaming QP (VM, root)
  prog_pg        PostgreSQL 15 in rs-h1, psql / \\copy / pgbench from rs-h2, all preloaded, rdma (programs.py, VM)
  prog_curl      curl in rs-h2 fetches 100 MB from python3 -m http.server in rs-h1, rdma (programs.py, VM)
  prog_curl_link_down  the same (60 MB), RoCE link down at 15 MB: goes on over TCP, sha256 equal
  sock_*         rdmasock sockets over rdma: faults, link down, credit probe, dead peer (sockets.py)
  write_first    write-before-read echo (1, 4 MiB), through a proxy, 64 MiB duplex, to a server
                 away from its sockets, the client's QP forced to ERR half-way, over rdma (bulk_echo.py)
  write_first_two_hosts  4 MiB write-before-read echo and the forced QP error, between rs-h1 and rs-h2
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
CASES = ["checks", "memlock", "ring_lo", "qp_error", "two_hosts", "device_events", "prog_pg", "prog_curl", "prog_curl_link_down",
         "api_stream", "api_two_hosts", "sock_qp_error", "sock_qp_error_at_answer", "sock_qp_error_duplex", "sock_bad_resync", "sock_link_down", "sock_credit_probe", "sock_dead_peer", "sock_fallbacks",
         "sock_device_delete", "api_sigio", "write_first", "write_first_two_hosts"]
_TWO = "needs the VM's two-namespace topology (scripts/softroce/guest/two-hosts.sh)"
VM_ONLY = {"api_two_hosts": _TWO, "sock_link_down": _TWO, "sock_credit_probe": _TWO, "sock_dead_peer": _TWO,
           "sock_device_delete": "deletes an rdma link: only inside the throw-away VM",
           "two_hosts": "needs the VM's two-namespace topology (scripts/softroce/guest/two-hosts.sh)",
           "device_events": "deletes an rdma link: only inside the throw-away VM",
           "prog_pg": "needs the VM's two-namespace topology (scripts/softroce/guest/two-hosts.sh)",
           "prog_curl": "needs the VM's two-namespace topology (scripts/softroce/guest/two-hosts.sh)",
           "prog_curl_link_down": "takes a RoCE link down: only inside the throw-away VM",
           "write_first_two_hosts": _TWO}


def run(cmds, timeout, env=None):
    """Start all commands (a list of argv lists, e.g. server then client), wait for all;
    returns (ok, combined output)."""
    procs = []
    outs = []
    for i, argv in enumerate(cmds):
        procs.append(subprocess.Popen(argv, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env))
        if i + 1 < len(cmds):
            time.sleep(0.3)
    deadline = time.monotonic() + timeout
    ok = True
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n[run_inner] killed after %d s" % timeout
            ok = False
        outs.append(out)
        ok = ok and p.returncode == 0
    return ok, "\n".join(outs)


def case_env(extra=None):
    env = dict(os.environ)
    env.update(extra or {})
    return env


def do_checks():
    env = case_env()
    if os.environ.get("SOFTROCE_DEVICE"):
        env["RDMASOCK_RDMA_DEVICE"] = os.environ["SOFTROCE_DEVICE"]
    return run([[PY, "checks.py"]], 240, env)


def do_ring_lo():
    env = case_env()
    if os.environ.get("SOFTROCE_DEVICE"):
        env["RDMASOCK_RDMA_DEVICE"] = os.environ["SOFTROCE_DEVICE"]
    port = "18611"
    return run([[PY, "ring_write.py", "server", "--port", port, "--count", "1200"],
                [PY, "ring_write.py", "client", "--port", port, "--count", "1200"]], 240, env)


def do_qp_error():
    env = case_env()
    if os.environ.get("SOFTROCE_DEVICE"):
        env["RDMASOCK_RDMA_DEVICE"] = os.environ["SOFTROCE_DEVICE"]
    return run([[PY, "faults.py", "qp_error"]], 240, env)


def do_memlock():
    env = case_env()
    if os.environ.get("SOFTROCE_DEVICE"):
        env["RDMASOCK_RDMA_DEVICE"] = os.environ["SOFTROCE_DEVICE"]
    inner = "ulimit -l 64 && exec %s checks.py memlock" % PY
    if os.geteuid() == 0:
        # root keeps CAP_IPC_LOCK (limit not applied) unless it leaves the bounding set
        argv = ["setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock", "sh", "-c", inner]
    else:
        argv = ["sh", "-c", inner]
    return run([argv], 120, env)


def do_two_hosts():
    e = os.environ
    if not e.get("SOFTROCE_H1_NS"):
        return False, "two-hosts topology not set up (run.sh --topology lo,two-hosts)"
    stat = "/sys/class/net/rs-roce2/statistics/rx_packets"
    before = int(open(stat).read())
    port = "18612"
    ok, out = run([["ip", "netns", "exec", e["SOFTROCE_H1_NS"], "env", "RDMASOCK_RDMA_DEVICE=" + e["SOFTROCE_H1_DEV"],
                    PY, "ring_write.py", "server", "--bind", e["SOFTROCE_H1_IP"], "--port", port, "--count", "800"],
                   ["ip", "netns", "exec", e["SOFTROCE_H2_NS"], "env", "RDMASOCK_RDMA_DEVICE=" + e["SOFTROCE_H2_DEV"],
                    PY, "ring_write.py", "client", "--connect", e["SOFTROCE_H1_IP"], "--port", port, "--count", "800"]],
                  240)
    crossed = int(open(stat).read()) - before
    out += "\n[run_inner] RoCE packets received on rs-roce2 (the veth end of rxe-h2): %d" % crossed
    if ok and crossed < 100:
        ok = False
        out += "\n[run_inner] too few: the traffic did not cross the veth pair"
    return ok, out


def do_device_events():
    return run([[PY, "faults.py", "device_events"]], 240)


def _lo_env(extra=None):
    env = case_env(extra)
    if os.environ.get("SOFTROCE_DEVICE"):
        env["RDMASOCK_RDMA_DEVICE"] = os.environ["SOFTROCE_DEVICE"]
    return env


def do_api_stream():
    """The core's stream property test (tests/test_stream_property.py) over rdma in one
    namespace: shm excluded by configuration, so the listener's rendezvous leads to rdma."""
    env = _lo_env({"RDMASOCK_TRANSPORTS": "rdma", "RDMASOCK_TEST_TRANSPORT": "rdma",
                   "RDMASOCK_TEST_EXAMPLES": "10", "RDMASOCK_TEST_MAX_WRITE": str(256 * 1024)})
    return run([[PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                 os.path.join(os.path.dirname(HERE), "test_stream_property.py")]], 400, env)


AWAY = 4          # seconds the write_first "away" server keeps away from its sockets


def do_write_first(two_hosts=False):
    """Write-before-read traffic over rdma (tests/bulk_echo.py), the shapes of
    tests/test_bulk_flow.py: a client writes 1 or 4 MiB before it reads to an echo server
    that answers as it reads, so both end up writing more than a ring holds with neither
    reading; the same through a proxy relaying both ways at once; 64 MiB written while a
    second thread reads.  Each writer, waiting for room, takes what its own receive ring
    has into memory (shim/rs_hold.c), as a TCP socket's kernel would; every connection
    stays rdma.  And a client that writes 1 MiB to a server that stays away from its
    sockets for AWAY seconds: the server's holder thread takes the bytes in, so the write
    is done before the server is back.  And the client's queue pair forced into the error
    state half-way through its 4 MiB: the connection goes on over TCP, whose buffers,
    cold after carrying only doorbells, hold less than the rings and holds did, so each
    writer goes on taking what it can read into its hold.  Plain TCP runs first, for
    comparison (reported, not required).  two_hosts: server in rs-h1, client in rs-h2
    (1500-byte MTU; the cold TCP buffers hold far less than over the loopback's 64 KiB
    segments)."""
    prog = os.path.join(os.path.dirname(HERE), "bulk_echo.py")
    outs, ok = [], True
    for name in ("tcp_rmem", "tcp_wmem"):
        with open("/proc/sys/net/ipv4/" + name) as f:
            outs.append("%s: %s" % (name, f.read().strip()))

    def argv(host, mode, *args):
        ns = ["ip", "netns", "exec", os.environ["SOFTROCE_H%s_NS" % host]] if two_hosts else []
        if mode == "plain":
            return ns + ["/usr/bin/python3", prog, args[0], "plain"] + list(args[1:])
        if mode == "preload":
            return ns + [PY, "-m", "rdmasock", "run", "--", "/usr/bin/python3", prog, args[0], "plain"] + list(args[1:])
        return ns + [PY, prog, args[0], "api"] + list(args[1:])

    def env_of(host, log_file):
        extra = {"RDMASOCK_TRANSPORTS": "rdma", "RDMASOCK_LOG_FILE": log_file}
        if not two_hosts:
            return _lo_env(extra)
        other = "2" if host == "1" else "1"
        extra.update(RDMASOCK_RDMA_DEVICE=os.environ["SOFTROCE_H%s_DEV" % host],
                     RDMASOCK_PEERS=os.environ["SOFTROCE_H%s_IP" % other], BULK_ECHO_HOST=os.environ["SOFTROCE_H1_IP"])
        return case_env(extra)

    def start(mode, env, *args):
        # a server that crashes says where, on the stderr the run reports
        p = subprocess.Popen(argv("1", mode, *args), cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=dict(env, PYTHONFAULTHANDLER="1"))
        line = p.stdout.readline().split()
        if not line or line[0] != "port":
            p.kill()
            p.wait(10)
            raise RuntimeError("%s did not start: %r" % (args[0], line))
        return p, line[1]

    MiB = 1 << 20
    runs = [("plain", "plain", 1 * MiB, ""), ("plain", "plain", 4 * MiB, "")]
    if two_hosts:
        runs = runs[1:] + [("api", "api", 4 * MiB, "")]
    else:
        runs += [(s_, c_, size, "") for s_, c_ in (("api", "api"), ("preload", "preload"), ("api", "preload"))
                 for size in (1 * MiB, 4 * MiB)]
    # the client's QP forced to ERR half-way through its write: both ends go on over TCP
    # while both write, the server into a client that reads nothing until it is done
    runs += [("api", "api", 4 * MiB, "qp_error"), ("preload", "api", 4 * MiB, "qp_error")]
    if not two_hosts:
        runs += [("api", "api", 4 * MiB, "proxy"), ("preload", "preload", 4 * MiB, "proxy"),
                 ("preload", "preload", 64 * MiB, "duplex")]
        # a server away from its sockets for AWAY s: the client's 1 MiB (four rings; within what
        # the guest's TCP takes in, with its small tcp_rmem/tcp_wmem) is in before it is back
        runs += [(m, m, 1 * MiB, "away") for m in ("plain", "api", "preload")]
    for smode, cmode, size, shape in runs:
        name = "%s server, %s client, %d MiB%s" % (smode, cmode, size // MiB, " " + shape if shape else "")
        logs = ["/tmp/write_first.%s.log" % h for h in ("1", "2")] if two_hosts else ["/tmp/write_first.log"] * 2
        for f in logs:
            if os.path.exists(f):
                os.unlink(f)
        procs, took, detail, good = [], 0.0, "", False
        try:
            srv, port = start(smode, env_of("1", logs[0]), *(("away", str(AWAY)) if shape == "away" else ("server",)))
            procs.append(srv)
            if shape == "proxy":
                prx, port = start(smode, env_of("1", logs[0]), "proxy", port)
                procs.append(prx)
            t0 = time.monotonic()
            r = subprocess.run(argv("2", cmode, "client", port, str(size)) + ([shape] if shape in ("duplex", "away", "qp_error") else []),
                               cwd=HERE, capture_output=True, text=True, env=env_of("2", logs[1]), timeout=300)
            took, detail = time.monotonic() - t0, r.stdout.strip() + r.stderr.strip()
            good = r.returncode == 0 and '"ok": true' in r.stdout and not r.stderr
            if good and shape == "away":
                good = json.loads(r.stdout.strip().splitlines()[-1])["written"] < AWAY
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            took, detail, good = 0.0, str(exc), False
        finally:
            for p in procs:              # a server that died or complained fails the run too
                died = p.poll()
                p.kill()
                try:
                    _, err = p.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    err = "(no end within 10 s of SIGKILL)"
                if died is not None or err.strip():
                    good = False
                    detail += "\n%s (pid %d) %s:\n%s" % ("server" if p is procs[0] else "proxy", p.pid,
                                                        "exited with %s before the end" % died if died is not None
                                                        else "wrote to stderr", err.strip()[-3000:])
        log_text = "".join(open(f).read() for f in sorted(set(logs)) if os.path.exists(f))
        if shape == "qp_error":
            good = good and log_text.count("transport=rdma") == 2 and log_text.count("reason=rdma_failed") == 2
        elif smode != "plain":
            good = good and "transport=rdma" in log_text and "transport=tcp" not in log_text
        # Plain TCP is the comparison, not a requirement: what its buffers take in grows
        # with autotuning, so on a loaded guest its own 4 MiB echo may wait for ever.  The
        # holds keep a fixed amount (tcp_wmem max + SO_RCVBUF), so rdmasock's runs must pass.
        verdict = "ok" if good else "FAILED" if smode != "plain" else "waited (TCP's own limit, not counted)"
        ok = ok and (good or smode == "plain")
        outs.append("%s: %s in %.2f s %s\n%s" % (name, verdict, took, detail, log_text.strip()))
    return ok, "\n".join(outs)


def do_write_first_two_hosts():
    return do_write_first(two_hosts=True)


def do_api_sigio():
    """O_ASYNC over rdma: the consumer asks for a doorbell after every posting (want_seq
    bit 63), so each arrival raises SIGIO, read or not (tests/sigio_program.py)."""
    ok, out = run([[PY, os.path.join(os.path.dirname(HERE), "sigio_program.py"), "api"]], 120,
                  _lo_env({"RDMASOCK_TRANSPORTS": "rdma"}))
    return ok and "3 m0m1m2 rdma" in out, out


def do_api_two_hosts():
    return run([[PY, "sockets.py", "two_hosts"]], 300)


def do_sock_qp_error():
    return run([[PY, "sockets.py", "qp_error"]], 200, _lo_env())


def do_sock_qp_error_at_answer():
    return run([[PY, "sockets.py", "qp_error_at_answer"]], 200, _lo_env())


def do_sock_qp_error_duplex():
    return run([[PY, "sockets.py", "qp_error_duplex"]], 200, _lo_env())


def do_sock_bad_resync():
    return run([[PY, "sockets.py", "bad_resync"]], 200, _lo_env())


def do_sock_link_down():
    return run([[PY, "sockets.py", "link_down"]], 200)


def do_sock_credit_probe():
    return run([[PY, "sockets.py", "credit_probe"]], 200)


def do_sock_dead_peer():
    return run([[PY, "sockets.py", "dead_peer"]], 200)


def do_sock_fallbacks():
    ok1, out1 = run([[PY, "sockets.py", "fallback", "memlock"]], 120, _lo_env())
    ok2, out2 = run([[PY, "sockets.py", "fallback", "rdma_unavailable"]], 120, _lo_env())
    return ok1 and ok2, out1 + "\n" + out2


def do_sock_device_delete():
    return run([[PY, "sockets.py", "device_delete"]], 300)


def do_prog_pg():
    return run([[PY, "programs.py", "pg"]], 300)


def do_prog_curl():
    return run([[PY, "programs.py", "curl"]], 400)


def do_prog_curl_link_down():
    return run([[PY, "programs.py", "curl", "--mb", "60", "--link-down-at", "15"]], 400)


def save(res, path):
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", help="write the JSON summary here")
    ap.add_argument("--only", help="comma-separated cases")
    ap.add_argument("--mode", choices=("vm", "host"), default="vm" if os.environ.get("SOFTROCE_GUEST") else "host")
    a = ap.parse_args()
    names = a.only.split(",") if a.only else CASES
    res = {"mode": a.mode, "cases": {}}
    t_all = time.monotonic()
    for name in names:
        if a.mode == "host" and name in VM_ONLY:
            res["cases"][name] = {"ok": None, "skipped": VM_ONLY[name], "seconds": 0, "output": ""}
            print("[run_inner] %-14s SKIP (%s)" % (name, VM_ONLY[name]), flush=True)
            continue
        t0 = time.monotonic()
        try:
            ok, out = globals()["do_" + name]()
        except Exception as exc:
            ok, out = False, "[run_inner] %s: %r" % (name, exc)
        dt = time.monotonic() - t0
        observed = [json.loads(l[len("OBSERVED "):]) for l in out.splitlines() if l.startswith("OBSERVED ")]
        res["cases"][name] = {"ok": ok, "seconds": round(dt, 1), "output": out[-6000:], "observed": observed}
        print(out.rstrip(), flush=True)
        print("[run_inner] %-14s %s in %.1f s" % (name, "PASS" if ok else "FAIL", dt), flush=True)
        res["seconds"] = round(time.monotonic() - t_all, 1)
        save(res, a.results)          # after each case: a run cut short keeps what finished
    res["seconds"] = round(time.monotonic() - t_all, 1)
    save(res, a.results)
    failed = [n for n, r in res["cases"].items() if r["ok"] is False]
    print("[run_inner] %d cases, %d failed%s, %.1f s" % (len(names), len(failed),
          (": " + ", ".join(failed)) if failed else "", res["seconds"]), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
