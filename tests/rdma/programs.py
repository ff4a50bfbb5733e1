#!/usr/bin/env python3
"""Unmodified programs over the rdma transport between the VM's two "hosts" (issue 4, point 7).

Needs `scripts/softroce/run.sh --topology two-hosts` (or lo,two-hosts): network namespaces
rs-h1 / rs-h2 with TCP addresses 10.48.0.1 / 10.48.0.2 and rxe devices rxe-h1 / rxe-h2
(SOFTROCE_H{1,2}_{NS,IP,DEV}).  Every program runs with LD_PRELOAD=rdmasock/librdmasock.so,
the server in rs-h1, the clients in rs-h2; each side lists the other in RDMASOCK_PEERS and
picks its device with RDMASOCK_RDMA_DEVICE.  RDMASOCK_TRANSPORTS keeps its default (shm,rdma):
shm is impossible between namespaces, so rdma must be chosen on its own merits.

    programs.py pg      PostgreSQL 15 (as user postgres, cluster in /tmp) in rs-h1; from rs-h2
                        psql (create, a client-side INSERT of 20000 rows, aggregates checked),
                        psql \\copy of a few MB in and back out (sha256 equal), pgbench -i -s 1,
                        pgbench -T 5 -c 2 -j 2 (0 failed transactions, tps > 0)
    programs.py curl    /usr/bin/python3 -m http.server in rs-h1, curl in rs-h2 fetches a
                        100 MB file (sha256 equal)
    programs.py curl --link-down-at MB
                        the same, and once curl has MB of the file the RoCE link of rs-h1
                        goes down (TCP stays): the transfer goes on over TCP, sha256 equal,
                        and both sides log the connection again as transport=tcp
                        reason=rdma_failed

Both check, from each side's RDMASOCK_LOG_FILE, that every connection of both sides used
transport=rdma (never shm, never tcp) and that client and server lines pair up, and count the
RoCE packets received on rs-roce2 (rxe-h2's veth end) to show the traffic crossed the veth.
Every wait is bounded; every process started is stopped by its PID (postgres by
`pg_ctl stop -m fast`, also on failure).  Exit status 0 and a last line "PASS ..." on success.
"""
import argparse
import hashlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIB = os.path.join(REPO, "rdmasock", "librdmasock.so")
PG_BIN = "/usr/lib/postgresql/15/bin"
PG_USER = "postgres"
PG_PORT = 5439
HTTP_PORT = 18680
ROCE_RX = "/sys/class/net/rs-roce2/statistics/rx_packets"
T0 = time.monotonic()
DEADLINE = [float("inf")]      # --budget: every wait of the test proper ends by then (not the clean-up)


class Fail(Exception):
    pass


def say(msg):
    print("[programs %6.1fs] %s" % (time.monotonic() - T0, msg), flush=True)


def check(cond, msg):
    if not cond:
        raise Fail(msg)


class Host:
    """One side of the two-hosts topology."""

    def __init__(self, n):
        e = os.environ
        self.ns = e.get("SOFTROCE_H%d_NS" % n)
        self.ip = e.get("SOFTROCE_H%d_IP" % n)
        self.dev = e.get("SOFTROCE_H%d_DEV" % n)
        if not (self.ns and self.ip and self.dev):
            raise Fail("two-hosts topology not set up (SOFTROCE_H%d_* missing; "
                       "run under scripts/softroce/run.sh --topology lo,two-hosts)" % n)


def base_env(extra=None):
    """The caller's environment without any preload (each program gets it through `env`, so
    `ip` and `setpriv` are never preloaded themselves)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(extra or {})
    return env


def preloaded(host, peers, log_file, argv):
    """argv run on host (its namespace) with the library preloaded and rdmasock configured."""
    return ["ip", "netns", "exec", host.ns, "env", "LD_PRELOAD=" + LIB, "RDMASOCK_RDMA_DEVICE=" + host.dev,
            "RDMASOCK_PEERS=" + peers, "RDMASOCK_LOG_FILE=" + log_file] + argv


def as_user(user):
    """argv prefix running a command as user (no PAM, environment and rlimits kept)."""
    return ["setpriv", "--reuid=" + user, "--regid=" + user, "--init-groups", "--"]


def bounded(timeout):
    """timeout, cut to what is left of the --budget."""
    return max(1, min(timeout, DEADLINE[0] - time.monotonic()))


def run(argv, timeout, env=None, what=None, check_rc=True, cleanup=False):
    """Runs argv to completion within timeout (also within --budget unless cleanup; killed
    by PID otherwise); returns (rc, output).  Raises Fail on timeout or, with check_rc, on a
    non-zero status."""
    what = what or os.path.basename(argv[-1] if argv[0] != "ip" else argv[0])
    t = time.monotonic()
    timeout = timeout if cleanup else bounded(timeout)
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=env or base_env(), start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_pid(p, signal.SIGKILL, 5)
        out, _ = p.communicate(timeout=10)
        raise Fail("%s did not finish in %.0f s:\n%s" % (what, timeout, out.decode(errors="replace")[-3000:]))
    out = out.decode(errors="replace")
    say("%s: exit %d in %.1f s" % (what, p.returncode, time.monotonic() - t))
    if check_rc and p.returncode:
        raise Fail("%s failed (exit %d):\n%s" % (what, p.returncode, out[-3000:]))
    return p.returncode, out


def session_pids(sid):
    """PIDs of the processes in session sid (what a server started with start_new_session left)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid:
                    pids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def stop_pid(proc, sig, wait):
    """Sends sig to proc (a Popen that leads its own session), waits up to `wait` s, then
    SIGKILLs it and whatever is left in its session, by PID."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    for pid in session_pids(proc.pid) + ([proc.pid] if proc.poll() is None else []):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def listening(pid, ip, port):
    """True once the process pid (in its own network namespace) has a TCP listener on ip:port:
    /proc/PID/net/tcp shows that process's namespace, so no probe connection is made."""
    a = [int(x) for x in ip.split(".")]
    want = "%02X%02X%02X%02X:%04X" % (a[3], a[2], a[1], a[0], port)
    try:
        with open("/proc/%d/net/tcp" % pid) as f:
            next(f)
            return any(l.split()[1] == want and l.split()[3] == "0A" for l in f)
    except OSError:
        return False


def wait_for(cond, timeout, what, proc=None):
    limit = bounded(timeout)
    deadline = time.monotonic() + limit
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise Fail("%s: the process exited (status %s) while waiting" % (what, proc.returncode))
        if time.monotonic() > deadline:
            raise Fail("%s: not ready after %.0f s" % (what, limit))
        time.sleep(0.1)


def new_log(path):
    """An empty log file every preloaded process (root or postgres) can append to."""
    with open(path, "w"):
        pass
    os.chmod(path, 0o666)
    return path


def roce_rx():
    with open(ROCE_RX) as f:
        return int(f.read())


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


LOG_FIELD = re.compile(r"(\w+)=(\S+)")


def read_log(path):
    with open(path) as f:
        return [(l.rstrip("\n"), dict(LOG_FIELD.findall(l))) for l in f if l.strip()]


def check_rdma_log(server_log, client_log, server_addr, min_conns):
    """Every line of both logs is one connection with transport=rdma; each client connection
    (its local address) is the peer of exactly one server connection and vice versa."""
    srv, cli = read_log(server_log), read_log(client_log)
    text = "server log %s:\n%s\nclient log %s:\n%s" % (
        server_log, "\n".join(l for l, _ in srv), client_log, "\n".join(l for l, _ in cli))
    bad = [l for l, f in srv + cli if f.get("transport") != "rdma" or "reason" in f]
    check(not bad, "connections not over rdma:\n%s\n\n%s" % ("\n".join(bad), text))
    check(all(f.get("role") == "server" and f.get("local") == server_addr for _, f in srv),
          "unexpected server line (role/local)\n" + text)
    check(all(f.get("role") == "client" and f.get("peer") == server_addr for _, f in cli),
          "unexpected client line (role/peer)\n" + text)
    ends_c = sorted(f["local"] for _, f in cli)
    ends_s = sorted(f["peer"] for _, f in srv)
    check(ends_c == ends_s, "client and server lines do not pair up\n" + text)
    check(len(cli) >= min_conns, "%d connections logged, expected at least %d\n%s" % (len(cli), min_conns, text))
    say("log: %d connections, every one transport=rdma on both sides" % len(cli))
    return len(cli)


def check_roce(before, min_packets):
    got = roce_rx() - before
    say("RoCE packets received on rs-roce2 (rxe-h2's veth end): %d" % got)
    check(got >= min_packets, "only %d RoCE packets crossed the veth (expected >= %d)" % (got, min_packets))
    return got


# ---------------------------------------------------------------------------------------------
# PostgreSQL

class Postgres:
    def __init__(self, workdir, h1, h2, log_file):
        self.h1, self.h2 = h1, h2
        self.dir = os.path.join(workdir, "pg")
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(workdir, "postgres.log")
        self.log_file = log_file
        self.proc = None
        pw = pwd.getpwnam(PG_USER)
        os.mkdir(self.dir, 0o700)
        os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.env = base_env({"HOME": self.dir, "USER": PG_USER, "LOGNAME": PG_USER})
        self.env.pop("RDMASOCK_LOG_FILE", None)

    def start(self):
        run(as_user(PG_USER) + [os.path.join(PG_BIN, "initdb"), "-D", self.data, "-U", "postgres", "--auth=trust",
                                "-E", "UTF8", "--locale=C.UTF-8", "-N", "--no-instructions"],
            120, env=self.env, what="initdb")
        with open(os.path.join(self.data, "pg_hba.conf"), "a") as f:
            f.write("host all all %s/32 trust\n" % self.h2.ip)
        argv = [os.path.join(PG_BIN, "postgres"), "-D", self.data, "-p", str(PG_PORT),
                "-c", "listen_addresses=" + self.h1.ip, "-c", "unix_socket_directories=" + self.dir,
                "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                "-c", "shared_buffers=32MB", "-c", "max_connections=20"]
        cmd = ["ip", "netns", "exec", self.h1.ns] + as_user(PG_USER) + [
            "env", "LD_PRELOAD=" + LIB, "RDMASOCK_RDMA_DEVICE=" + self.h1.dev, "RDMASOCK_PEERS=" + self.h2.ip,
            "RDMASOCK_LOG_FILE=" + self.log_file] + argv
        say("server: " + " ".join(cmd))
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        wait_for(self.ready, 90, "postgres", self.proc)
        wait_for(lambda: listening(self.proc.pid, self.h1.ip, PG_PORT), 10, "postgres listener", self.proc)
        say("postgres ready (pid %d)" % self.proc.pid)

    def ready(self):
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                lines = f.read().splitlines()
        except OSError:
            return False
        return len(lines) >= 8 and lines[7].strip() == "ready"

    def stop(self):
        """pg_ctl stop -m fast; whatever survives it is killed by PID."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                run(as_user(PG_USER) + [os.path.join(PG_BIN, "pg_ctl"), "stop", "-D", self.data, "-m", "fast",
                                        "-t", "30"], 45, env=self.env, what="pg_ctl stop -m fast", cleanup=True)
            except Fail as exc:
                say("pg_ctl stop failed, killing by PID: %s" % exc)
        stop_pid(self.proc, signal.SIGQUIT, 10)
        say("postgres stopped (status %s)" % self.proc.returncode)

    def tail(self, n=40):
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def do_pg(a):
    h1, h2 = Host(1), Host(2)
    workdir = tempfile.mkdtemp(prefix="rs-prog-pg-")
    os.chmod(workdir, 0o755)                       # postgres reaches its cluster and the log file
    slog = new_log(os.path.join(workdir, "server.log"))
    clog = new_log(os.path.join(workdir, "client.log"))
    server_addr = "%s:%d" % (h1.ip, PG_PORT)
    pg = Postgres(workdir, h1, h2, slog)

    def client(argv, timeout, what):
        return run(preloaded(h2, server_addr, clog, argv), timeout,
                   env=base_env({"PGCONNECT_TIMEOUT": "30"}), what=what)[1]

    conn = ["-h", h1.ip, "-p", str(PG_PORT), "-U", "postgres"]
    psql = [os.path.join(PG_BIN, "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"] + conn + ["-d", "postgres"]
    pgbench = os.path.join(PG_BIN, "pgbench")
    try:
        with open("/proc/self/limits") as f:
            say("memlock: " + next((l.strip() for l in f if l.startswith("Max locked memory")), "?"))
        pg.start()
        rx0 = roce_rx()

        # 1. Queries: the rows travel client -> server inside one multi-row INSERT.
        n = a.rows
        vals = [hashlib.sha256(str(i).encode()).hexdigest()[:8 + i % 57] for i in range(1, n + 1)]
        sql = os.path.join(workdir, "queries.sql")
        with open(sql, "w") as f:
            f.write("CREATE TABLE t (a int PRIMARY KEY, b text);\n")
            f.write("INSERT INTO t VALUES %s;\n" % ",".join("(%d,'%s')" % (i, v) for i, v in enumerate(vals, 1)))
            f.write("SELECT count(*), sum(a), sum(length(b)), md5(string_agg(b, ',' ORDER BY a)) FROM t;\n")
            f.write("SELECT b FROM t WHERE a % 1000 = 0 ORDER BY a;\n")
        out = client(psql + ["-f", sql], 120, "psql: create, insert %d rows, aggregate" % n).split()
        want = ["%d|%d|%d|%s" % (n, n * (n + 1) // 2, sum(map(len, vals)),
                                 hashlib.md5(",".join(vals).encode()).hexdigest())]
        want += [vals[i - 1] for i in range(1000, n + 1, 1000)]
        check(out == want, "psql output differs:\n got %s\nwant %s" % (out[:3], want[:3]))
        say("psql: %d rows inserted, aggregates and md5 of all values match" % n)

        # 2. \copy a few MB in and back out.
        src = os.path.join(workdir, "copy_in.tsv")
        dst = os.path.join(workdir, "copy_out.tsv")
        rows, size = 0, 0
        with open(src, "w") as f:
            while size < a.copy_mb << 20:
                line = "%d\t%s\n" % (rows, os.urandom(48 + rows % 40).hex())
                f.write(line)
                size += len(line)
                rows += 1
        sql = os.path.join(workdir, "copy.sql")
        with open(sql, "w") as f:
            f.write("CREATE TABLE c (id bigint, h text);\n")
            f.write("\\copy c FROM '%s'\n" % src)
            f.write("SELECT count(*) FROM c;\n")
            f.write("\\copy (SELECT id, h FROM c ORDER BY id) TO '%s'\n" % dst)
        out = client(psql + ["-f", sql], 120, "psql: \\copy %d rows (%.1f MB) in and out" % (rows, size / 2**20))
        check(out.split() == [str(rows)], "count after \\copy: %r, expected %d" % (out, rows))
        check(os.path.getsize(dst) == size, "copy out: %d bytes, expected %d" % (os.path.getsize(dst), size))
        h_in, h_out = sha256_file(src), sha256_file(dst)
        check(h_in == h_out, "copy: sha256 differs: %s in, %s out" % (h_in, h_out))
        say("\\copy: %d bytes out and back, sha256 %s equal" % (size, h_in[:16]))

        # 3. pgbench
        out = client([pgbench, "-i", "-s", "1", "-q"] + conn + ["postgres"], 120, "pgbench -i -s 1")
        check("done in" in out and not re.search(r"error|fatal|abort", out, re.I), "pgbench -i:\n" + out)
        out = client([pgbench, "-T", str(a.seconds), "-c", "2", "-j", "2"] + conn + ["postgres"],
                     a.seconds + 90, "pgbench -T %d -c 2 -j 2" % a.seconds)
        m = re.search(r"^tps = ([\d.]+) \(without initial connection time\)", out, re.M)
        failed = re.search(r"^number of failed transactions: (\d+)", out, re.M)
        done = re.search(r"^number of transactions actually processed: (\d+)", out, re.M)
        check(m and float(m.group(1)) > 0 and failed and failed.group(1) == "0"
              and not re.search(r"error|fatal|abort", out, re.I), "pgbench:\n" + out)
        say("pgbench: tps %s, %s transactions, 0 failed" % (m.group(1), done.group(1) if done else "?"))

        # psql 1 + psql 1 + pgbench -i 1 + pgbench -T (2 clients, 1 set-up connection)
        conns = check_rdma_log(slog, clog, server_addr, 6)
        pkts = check_roce(rx0, 1000)
    except Exception:
        say("postgres log (tail):\n" + pg.tail())
        raise
    finally:
        pg.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    print("PASS pg: %d connections over rdma, %d RoCE packets, %.1f s" % (conns, pkts, time.monotonic() - T0),
          flush=True)


# ---------------------------------------------------------------------------------------------
# curl + python3 -m http.server

def do_curl(a):
    h1, h2 = Host(1), Host(2)
    workdir = tempfile.mkdtemp(prefix="rs-prog-curl-")
    slog = new_log(os.path.join(workdir, "server.log"))
    clog = new_log(os.path.join(workdir, "client.log"))
    server_addr = "%s:%d" % (h1.ip, HTTP_PORT)
    served = os.path.join(workdir, "www")
    os.mkdir(served)
    src = os.path.join(served, "f.bin")
    dst = os.path.join(workdir, "got.bin")
    h = hashlib.sha256()
    with open(src, "wb") as f:
        for _ in range(a.mb):
            chunk = os.urandom(1 << 20)
            h.update(chunk)
            f.write(chunk)
    h_src = h.hexdigest()
    say("%d MB file written" % a.mb)
    srv = None
    try:
        cmd = preloaded(h1, h2.ip, slog, ["/usr/bin/python3", "-m", "http.server", "--bind", h1.ip,
                                          "--directory", served, str(HTTP_PORT)])
        say("server: " + " ".join(cmd))
        srv_out = open(os.path.join(workdir, "http.log"), "wb")
        srv = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=srv_out, stderr=subprocess.STDOUT,
                               env=base_env(), start_new_session=True)
        srv_out.close()
        wait_for(lambda: listening(srv.pid, h1.ip, HTTP_PORT), 60, "http.server", srv)
        say("http.server listening (pid %d)" % srv.pid)
        rx0 = roce_rx()
        t = time.monotonic()
        curl = preloaded(h2, server_addr, clog, ["curl", "-sS", "--fail", "--max-time", str(a.max_time), "-o", dst,
                                                 "http://%s/f.bin" % server_addr])
        if a.link_down_at:
            fetch_with_link_down(curl, dst, a, srv)
        else:
            run(curl, a.max_time + 30, what="curl %d MB" % a.mb)
        dt = time.monotonic() - t
        check(os.path.getsize(dst) == a.mb << 20, "curl got %d bytes, expected %d" % (os.path.getsize(dst), a.mb << 20))
        h_dst = sha256_file(dst)
        check(h_dst == h_src, "sha256 differs: served %s, received %s" % (h_src, h_dst))
        say("curl: %d MB in %.1f s (%.1f MB/s guest time), sha256 %s equal" % (a.mb, dt, a.mb / dt, h_src[:16]))
        if a.link_down_at:
            pkts = check_roce(rx0, (a.link_down_at << 20) // 4096)
            conns = check_fallback_log(slog, clog)
        else:
            pkts = check_roce(rx0, (a.mb << 20) // 4096)     # at least one packet per 4 KiB (the largest MTU)
            conns = check_rdma_log(slog, clog, server_addr, 1)
    except Exception:
        # what each side saw (the rdmasock logs say which transport, when it moved and why)
        for what, path in (("http.server output", os.path.join(workdir, "http.log")),
                           ("server rdmasock log", slog), ("client rdmasock log", clog)):
            try:
                with open(path, errors="replace") as f:
                    say("%s (tail):\n" % what + "".join(f.readlines()[-20:]))
            except OSError:
                pass
        raise
    finally:
        if srv is not None:
            stop_pid(srv, signal.SIGTERM, 10)
            say("http.server stopped (status %s)" % srv.returncode)
    shutil.rmtree(workdir, ignore_errors=True)
    print("PASS curl: %d MB, %d connection(s) over rdma%s, %d RoCE packets, %.1f s"
          % (a.mb, conns, ", RoCE link down at %d MB: went on over TCP" % a.link_down_at if a.link_down_at else "",
             pkts, time.monotonic() - T0), flush=True)


STALL_S = 60


def snapshot(leaders):
    """What the processes of the given sessions are doing: each thread's state, system call
    and kernel wait channel, the rdmasock table of each, and the rxe devices' counters."""
    out = []
    for sid in leaders:
        for pid in sorted(set(session_pids(sid) + [sid])):
            try:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    out.append("pid %d: %s" % (pid, f.read().replace(b"\0", b" ").decode(errors="replace")[:120]))
                for tid in sorted(os.listdir("/proc/%d/task" % pid), key=int):
                    t = "/proc/%d/task/%s/" % (pid, tid)
                    fields = []
                    for name in ("stat", "syscall", "wchan"):
                        try:
                            with open(t + name) as f:
                                v = f.read().strip()
                        except OSError as e:
                            v = "(%s)" % e.strerror
                        fields.append(v.rsplit(")", 1)[-1].split()[0] if name == "stat" else v)
                    out.append("  tid %s state %s syscall %s wchan %s" % (tid, *fields))
            except OSError:
                pass
    r = subprocess.run([sys.executable, "-m", "rdmasock.cli", "stat"], capture_output=True, text=True, timeout=30,
                       cwd=REPO)
    out.append(r.stdout + r.stderr)
    for dev in sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []:
        d = "/sys/class/infiniband/%s/ports/1/" % dev
        try:
            with open(d + "state") as f:
                state = f.read().strip()
            counters = {}
            for n in os.listdir(d + "hw_counters"):
                with open(d + "hw_counters/" + n) as f:
                    v = f.read().strip()
                if v != "0":
                    counters[n] = v
            out.append("%s: %s %s" % (dev, state, counters))
        except OSError as e:
            out.append("%s: %s" % (dev, e))
    return "\n".join(out)


def fetch_with_link_down(curl, dst, a, srv):
    """Runs curl; once dst holds a.link_down_at MB, rs-h1's RoCE veth goes down (TCP is on
    another veth pair and stays up).  The link comes back up whatever happens."""
    t = time.monotonic()
    p = subprocess.Popen(curl, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=base_env(), start_new_session=True)
    try:
        size = lambda: os.path.getsize(dst) if os.path.exists(dst) else 0
        wait_for(lambda: size() >= a.link_down_at << 20 or p.poll() is not None, 120, "curl's first MB", p)
        check(p.poll() is None, "curl ended before the link went down (%d bytes)" % size())
        say("curl has %d bytes: ip link set rs-roce1 down (RoCE of rs-h1; TCP stays)" % size())
        subprocess.run(["ip", "link", "set", "rs-roce1", "down"], check=True)
        # The move to TCP takes a few seconds at most (sync_timeout): a transfer that makes
        # no progress for STALL_S is hung, and what each process is doing is the evidence.
        last, since, limit = size(), time.monotonic(), time.monotonic() + bounded(a.max_time + 30)
        while p.poll() is None and time.monotonic() < limit:
            time.sleep(0.5)
            if size() != last:
                last, since = size(), time.monotonic()
            elif time.monotonic() - since > STALL_S:
                say("no progress for %d s at %d bytes:\n%s" % (STALL_S, last, snapshot([p.pid, srv.pid])))
                raise Fail("curl made no progress for %d s after the link went down (%d bytes)" % (STALL_S, last))
        out, _ = p.communicate(timeout=bounded(30))
    except subprocess.TimeoutExpired:
        stop_pid(p, signal.SIGKILL, 5)
        raise Fail("curl did not finish after the link went down")
    finally:
        subprocess.run(["ip", "link", "set", "rs-roce1", "up"])
        if p.poll() is None:
            stop_pid(p, signal.SIGKILL, 5)
    say("curl: exit %d in %.1f s" % (p.returncode, time.monotonic() - t))
    check(p.returncode == 0, "curl failed (exit %d): %s" % (p.returncode, out.decode(errors="replace")[-2000:]))


def check_fallback_log(server_log, client_log):
    """Each side logged the connection over rdma, then once more as tcp with reason
    rdma_failed (the RDMA path failed mid-stream and the connection went on over TCP)."""
    srv, cli = read_log(server_log), read_log(client_log)
    text = "server log:\n%s\nclient log:\n%s" % ("\n".join(l for l, _ in srv), "\n".join(l for l, _ in cli))
    for name, lines in (("server", srv), ("client", cli)):
        check(any(f.get("transport") == "rdma" for _, f in lines), "%s: no rdma connection logged\n%s" % (name, text))
        check(any(f.get("transport") == "tcp" and f.get("reason") == "rdma_failed" for _, f in lines),
              "%s: no 'transport=tcp reason=rdma_failed' line\n%s" % (name, text))
    say("log: both sides went from rdma to tcp with reason rdma_failed:\n" + text)
    return sum(1 for _, f in cli if f.get("transport") == "rdma")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pg")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--copy-mb", type=int, default=4)
    p.add_argument("--seconds", type=int, default=5, help="pgbench -T")
    p.add_argument("--budget", type=float, default=220, help="seconds for the whole test before clean-up")
    p = sub.add_parser("curl")
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--max-time", type=int, default=240, help="curl --max-time")
    p.add_argument("--link-down-at", type=int, default=0, metavar="MB",
                   help="take the RoCE link of rs-h1 down once curl has this many MB")
    p.add_argument("--budget", type=float, default=320, help="seconds for the whole test before clean-up")
    a = ap.parse_args()
    DEADLINE[0] = T0 + a.budget
    try:
        check(os.path.exists(LIB), "%s is missing (bash scripts/setup.sh)" % LIB)
        {"pg": do_pg, "curl": do_curl}[a.cmd](a)
    except Fail as exc:
        print("FAIL %s: %s" % (a.cmd, exc), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
