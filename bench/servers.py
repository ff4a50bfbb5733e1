"""Real servers for the program tests (tests/programs/) and the benchmarks (this package): PostgreSQL 15, redis-server and
`python3 -m http.server`, each started on 127.0.0.1 with a free port, optionally under
`rdmasock run` (LD_PRELOAD), and stopped by PID.  Every wait here is bounded.

Also the two helpers all users need: `preload_cmd()` (argv prefix for `rdmasock run`) and
`parse_log()` (the RDMASOCK_LOG_FILE connection-outcome lines).

Permissions: PostgreSQL refuses to run as root, so initdb and postgres run as user
`postgres` via setpriv.  Under the preload the postgres processes must then be able to read
this interpreter, the rdmasock package and the preload library: check_user_can_preload()
verifies that as `postgres` and fails with the offending path (namei -l) if not."""
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# In a source checkout this directory is bench/, beside rdmasock/ and scripts/ (the Soft-RoCE
# VM's); installed, it is rdmasock/bench and REPO has no scripts/.
REPO = os.path.dirname(HERE)
VENV_PY = sys.executable               # the interpreter rdmasock is installed in
SYS_PY = "/usr/bin/python3"        # Debian's 3.11.2: the interpreter the preload library is built against
PG_BIN = "/usr/lib/postgresql/15/bin"
PG_USER = "postgres"
REDIS_SERVER = "/usr/bin/redis-server"

try:
    import psutil
except ImportError:            # the venv has it (a dependency of rdmasock); /usr/bin/python3 may not
    psutil = None


SOCKPERF = shutil.which("sockperf") or "/usr/bin/sockperf"

# Servers and the commands run() starts each get a session of their own, so a terminal's
# signals stay with the benchmark.  The scheduler shares a CPU fairly between sessions
# (autogroups) before it shares it between tasks; the crowded placement (bench/scale.py)
# keeps everything in the benchmark's session, beside its busy loops.
NEW_SESSION = True


class ServerError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# preload and log helpers

def preload_prefix():
    return [VENV_PY, "-m", "rdmasock", "run", "--"]


def preload_cmd(cmd, enabled):
    """argv for running cmd, under `rdmasock run` (LD_PRELOAD) when enabled."""
    cmd = [str(c) for c in cmd]
    return preload_prefix() + cmd if enabled else cmd


_preload_state = None


def preload_status():
    """(ok, message): whether `python -m rdmasock preload-path` names a readable library.
    Cached per process."""
    global _preload_state
    if _preload_state is None:
        try:
            p = subprocess.run([VENV_PY, "-m", "rdmasock", "preload-path"], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            _preload_state = (False, "`python -m rdmasock preload-path` did not finish within 60 s")
            return _preload_state
        path = p.stdout.strip().splitlines()[-1].strip() if p.stdout.strip() else ""
        if p.returncode != 0:
            _preload_state = (False, "`%s -m rdmasock preload-path` exited %d (the LD_PRELOAD library / "
                                     "`rdmasock run` is not available): %s"
                              % (VENV_PY, p.returncode, (p.stderr or p.stdout).strip()[-600:]))
        elif not path or not os.path.isfile(path):
            _preload_state = (False, "`rdmasock preload-path` printed %r, which is not a file" % path)
        else:
            _preload_state = (True, path)
    return _preload_state


def require_preload():
    """Returns the library path or raises ServerError saying why the preload is unusable."""
    ok, msg = preload_status()
    if not ok:
        raise ServerError(msg)
    return msg


_LOG_RE = re.compile(r"(\w+)=(\S*)")


def parse_log(path, offset=0):
    """Records of an RDMASOCK_LOG_FILE from byte offset on: a list of dicts with at least
    role, pid (int), transport, reason (None if absent), local, peer, plus 'time' and any other
    key=value fields, and 'line' (the raw line).  A missing file gives []."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return []
    recs = []
    for raw in data.decode("utf-8", "replace").splitlines():
        raw = raw.strip()
        if not raw:
            continue
        rec = {"role": None, "pid": None, "transport": None, "reason": None, "local": None, "peer": None,
               "time": raw.split(None, 1)[0] if "=" not in raw.split(None, 1)[0] else None, "line": raw}
        for k, v in _LOG_RE.findall(raw):
            rec[k] = v
        try:
            rec["pid"] = int(rec["pid"]) if rec["pid"] is not None else None
        except ValueError:
            pass
        recs.append(rec)
    return recs


def addr_port(addr):
    """'127.0.0.1:5432' / '[::1]:5432' -> 5432 (None if unparsable)."""
    try:
        return int(str(addr).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def make_log_file(directory, name):
    """An empty log file every user can append to, in a directory every user can write."""
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, 0o1777)
    path = os.path.join(directory, name)
    with open(path, "ab"):
        pass
    os.chmod(path, 0o666)
    return path


def log_size(path):
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


# ---------------------------------------------------------------------------------------------
# processes

def free_port():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
    finally:
        s.close()


def wait_until(pred, timeout, interval=0.02):
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= end:
            return v
        time.sleep(interval)


def process_tree(pid):
    """[pid] + its live descendants' PIDs (needs psutil; else just [pid])."""
    pids = [pid]
    if psutil is not None:
        try:
            pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            pass
    return pids


def pid_alive(pid):
    if psutil is not None:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def kill_pids(pids, sig=signal.SIGKILL):
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(proc, sig=signal.SIGKILL, timeout=10):
    """Signal a Popen we started and every descendant of it (by PID), then reap it."""
    if proc is None:
        return
    kill_pids(process_tree(proc.pid), sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_pids(process_tree(proc.pid), signal.SIGKILL)
        proc.wait(timeout)


def run(cmd, timeout, check=True, while_running=None, **kw):
    """subprocess.run (input= for stdin data) with a hard timeout that kills the child's whole
    tree; raises ServerError with the output tail on timeout or (check) non-zero exit.
    while_running(popen), if given, runs in a thread while the command runs (its output is
    still drained); its exception, if any, is raised after the command ended."""
    data = kw.pop("input", None)
    if data is not None:
        kw["stdin"] = subprocess.PIPE
    elif kw.get("stdin") is None:
        kw["stdin"] = subprocess.DEVNULL
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    p = subprocess.Popen(cmd, start_new_session=NEW_SESSION, **kw)
    side, side_err = None, []
    if while_running is not None:
        def _side():
            try:
                while_running(p)
            except Exception as exc:          # noqa: BLE001 - handed to the caller below
                side_err.append(exc)
        side = threading.Thread(target=_side, daemon=True)
        side.start()
    try:
        out, err = p.communicate(input=data, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p)
        out, err = p.communicate()
        raise ServerError("timed out after %ss: %s\nstdout: %s\nstderr: %s"
                          % (timeout, " ".join(map(str, cmd)), _tail(out), _tail(err)))
    finally:
        if side is not None:
            side.join(30)
    if side_err:
        raise side_err[0]
    cp = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if check and p.returncode != 0:
        raise ServerError("exit %d: %s\nstdout: %s\nstderr: %s"
                          % (p.returncode, " ".join(map(str, cmd)), _tail(out), _tail(err)))
    return cp


def _tail(b, n=1500):
    if b is None:
        return ""
    if isinstance(b, bytes):
        b = b.decode("utf-8", "replace")
    return b[-n:]


def read_tail(path, n=3000):
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def pin(cpu):
    return [] if cpu is None else ["taskset", "-c", str(cpu)]


def as_user(user):
    """argv prefix running a command as user (no PAM, environment kept)."""
    return ["setpriv", "--reuid=" + user, "--regid=" + user, "--init-groups", "--"]


def check_user_can_preload(user, env):
    """Raises ServerError unless user can run this python, import rdmasock and read the
    preload library (all needed for `rdmasock run` as that user)."""
    import rdmasock
    lib = require_preload()
    probe = ("import os, sys, rdmasock; lib = sys.argv[1]; "
             "sys.exit(0 if os.access(lib, os.R_OK) else 'cannot read ' + lib)")
    try:
        run(as_user(user) + [VENV_PY, "-c", probe, lib], timeout=60, env=env)
    except ServerError as exc:
        diag = []
        for path in (VENV_PY, rdmasock.__file__, lib):
            d = run(["namei", "-l", path], timeout=10, check=False)
            diag.append(d.stdout.decode(errors="replace"))
        raise ServerError("user %r cannot use the preload (venv python, rdmasock package or library "
                          "unreadable/untraversable).  Fix the permissions shown below (e.g. chmod o+rx on the "
                          "directories), or build the venv/library under a path %s can read.\n%s\n%s"
                          % (user, user, exc, "\n".join(diag)))


def base_env(extra=None):
    env = dict(os.environ)
    for k in list(env):          # a stale LD_PRELOAD from the caller must not leak into "plain" runs
        if k == "LD_PRELOAD":
            del env[k]
    env.update(extra or {})
    return env


class _Server:
    """Common start/stop for one server process started with Popen (new session)."""

    name = "server"
    python = False           # a Python server program: run it with PYTHONUNBUFFERED=1

    def __init__(self, preload=False, cpu=None, log_file=None, env=None, workdir=None):
        self.preload = preload
        self.cpu = cpu
        self.log_file = log_file
        self.port = None
        self.proc = None
        self._own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="rs-%s-" % self.name)
        os.chmod(self.workdir, 0o755)
        extra = dict(env or {})
        if log_file:
            extra["RDMASOCK_LOG_FILE"] = log_file
        if self.python:
            extra["PYTHONUNBUFFERED"] = "1"
        self.env = base_env(extra)
        self.out_path = os.path.join(self.workdir, "%s.out" % self.name)

    def _popen(self, argv):
        if self.preload:
            require_preload()
        self._out = open(self.out_path, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._out, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=NEW_SESSION)

    def _start_on_free_port(self, argv_for, ready, timeout):
        """Starts pin(cpu) + argv_for(port) on a free port and waits until ready(); when the port
        was taken in the meantime ("in use" in the output), tries again on another (3 tries)."""
        for attempt in range(3):
            self.port = free_port()
            self._popen(pin(self.cpu) + argv_for(self.port))
            try:
                self._wait_ready(ready, timeout)
                return self
            except ServerError:
                if attempt < 2 and "in use" in read_tail(self.out_path):
                    kill_tree(self.proc)
                    self._out.close()
                    continue
                self.stop()
                raise
            except BaseException:
                self.stop()             # interrupted while it starts (SIGTERM, Ctrl-C): not left running
                raise
        return self

    def _wait_ready(self, pred, timeout=30):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred():
                return
            if self.proc.poll() is not None:
                raise ServerError("%s exited %s during start-up:\n%s"
                                  % (self.name, self.proc.returncode, read_tail(self.out_path)))
            time.sleep(0.02)
        raise ServerError("%s not ready within %d s:\n%s" % (self.name, timeout, read_tail(self.out_path)))

    def pids(self):
        return process_tree(self.proc.pid) if self.proc else []

    pidfile = None           # where the server program writes its PID, if it does

    def main_pid(self):
        """PID of the server program itself (the Popen may be a `rdmasock run` wrapper):
        from its pid file once written, else the Popen's."""
        try:
            with open(self.pidfile) as f:
                return int(f.read().strip())
        except (TypeError, OSError, ValueError):
            return self.proc.pid

    def kill(self):
        """SIGKILL the server and everything under it (the fault tests' 'peer dies')."""
        kill_tree(self.proc, signal.SIGKILL)

    def stop(self, timeout=10):
        if self.proc is not None:
            if self.proc.poll() is None:
                pids = self.pids()
                self._graceful()
                if not wait_until(lambda: self.proc.poll() is not None, timeout):
                    kill_pids(pids + self.pids(), signal.SIGKILL)
                else:
                    kill_pids([p for p in pids if pid_alive(p)], signal.SIGKILL)   # stragglers
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc)
            self._out.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _graceful(self):
        kill_pids([self.main_pid()], signal.SIGTERM)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class PgServer(_Server):
    """PostgreSQL 15 in a fresh cluster: initdb into a temp dir owned by postgres, listening
    on 127.0.0.1:<free port> only, unix socket in the temp dir, fsync=off,
    synchronous_commit=off.  Stopped by an immediate shutdown (SIGQUIT to the postmaster's
    PID), then SIGKILL of whatever is left; the dir is removed."""

    name = "postgres"

    def __init__(self, preload=False, cpu=None, log_file=None, env=None, settings=None):
        super().__init__(preload, cpu, log_file, env)
        self.data = os.path.join(self.workdir, "data")
        self.sock = os.path.join(self.workdir, "sock")
        self.settings = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
                         "max_connections": "100", "shared_buffers": "128MB"}
        self.settings.update(settings or {})
        pw = pwd.getpwnam(PG_USER)
        self.env.update({"HOME": self.workdir, "USER": PG_USER, "LOGNAME": PG_USER})
        for d in (self.data, self.sock):
            os.mkdir(d, 0o700)
            os.chown(d, pw.pw_uid, pw.pw_gid)
        os.chown(self.workdir, pw.pw_uid, pw.pw_gid)   # postgres writes its log next to the cluster

    def start(self, timeout=60):
        if self.preload:
            check_user_can_preload(PG_USER, self.env)
        env = dict(self.env)
        env.pop("RDMASOCK_LOG_FILE", None)
        run(as_user(PG_USER) + [os.path.join(PG_BIN, "initdb"), "-D", self.data, "-U", "postgres",
                                "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8", "-N"], timeout=120, env=env)

        def argv(port):
            cmd = [os.path.join(PG_BIN, "postgres"), "-D", self.data, "-p", str(port),
                   "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=" + self.sock]
            for k, v in self.settings.items():
                cmd += ["-c", "%s=%s" % (k, v)]
            return as_user(PG_USER) + preload_cmd(cmd, self.preload)
        return self._start_on_free_port(argv, self._ready, timeout)

    def _pidfile(self):
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                return f.read().splitlines()
        except (FileNotFoundError, PermissionError):
            return []

    def _ready(self):
        lines = self._pidfile()
        return len(lines) >= 8 and lines[7].strip() == "ready"

    def main_pid(self):
        lines = self._pidfile()
        try:
            return int(lines[0])
        except (IndexError, ValueError):
            return self.proc.pid

    def _graceful(self):
        kill_pids([self.main_pid()], signal.SIGQUIT)     # immediate shutdown

    def backend_pids(self):
        """PIDs of backends (postmaster children that hold a TCP connection on our port)."""
        out = []
        for pid in self.pids():
            if conns_of([pid], self.port, established_only=True):
                if pid != self.main_pid():
                    out.append(pid)
        return out

    def psql(self, *args, preload=False, timeout=120, dbname="postgres", check=True, log_file=None, **kw):
        return run(preload_cmd(psql_argv(self.port, dbname) + list(args), preload), timeout=timeout, check=check,
                   env=client_env(log_file or self.log_file), **kw)


def psql_argv(port, dbname="postgres"):
    return ["/usr/bin/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", str(port),
            "-U", "postgres", "-d", dbname]


def client_env(log_file=None, extra=None):
    e = {"PGCONNECT_TIMEOUT": "20"}
    if log_file:
        e["RDMASOCK_LOG_FILE"] = log_file
    e.update(extra or {})
    return base_env(e)


class RedisServer(_Server):
    """redis-server --port <free> --bind 127.0.0.1 --save '' --appendonly no, stopped by PID."""

    name = "redis"

    def start(self, timeout=30):
        self.pidfile = os.path.join(self.workdir, "redis.pid")
        return self._start_on_free_port(
            lambda port: preload_cmd([REDIS_SERVER, "--port", port, "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.workdir, "--pidfile", self.pidfile,
                                      "--daemonize", "no", "--protected-mode", "no", "--logfile", ""], self.preload),
            lambda: "Ready to accept connections" in read_tail(self.out_path, 20000), timeout)


    def cli(self, *args, preload=False, timeout=60, check=True, log_file=None, **kw):
        argv = ["/usr/bin/redis-cli", "-h", "127.0.0.1", "-p", str(self.port)] + [str(a) for a in args]
        return run(preload_cmd(argv, preload), timeout=timeout, check=check,
                   env=client_env(log_file or self.log_file), **kw)


MARIADB_USER = "mysql"


class MariaDbServer(_Server):
    """MariaDB in a fresh data dir owned by mysql (mariadb-install-db), listening on
    127.0.0.1:<free port> only, no grant tables (any user, no password), unix socket and
    pid file in the temp dir; /etc/mysql is not read.  Stopped by SIGTERM to mariadbd's
    PID, then SIGKILL of whatever is left; the dir is removed."""

    name = "mariadb"

    def __init__(self, preload=False, cpu=None, log_file=None, env=None):
        super().__init__(preload, cpu, log_file, env)
        self.data = os.path.join(self.workdir, "data")
        self.sock = os.path.join(self.workdir, "mysqld.sock")
        self.pidfile = os.path.join(self.workdir, "mysqld.pid")
        pw = pwd.getpwnam(MARIADB_USER)
        os.mkdir(self.data, 0o700)
        os.chown(self.data, pw.pw_uid, pw.pw_gid)
        os.chown(self.workdir, pw.pw_uid, pw.pw_gid)

    def start(self, timeout=60):
        if self.preload:
            check_user_can_preload(MARIADB_USER, self.env)
        env = dict(self.env)
        env.pop("RDMASOCK_LOG_FILE", None)
        run(["/usr/bin/mariadb-install-db", "--no-defaults", "--user=" + MARIADB_USER, "--datadir=" + self.data,
             "--auth-root-authentication-method=normal", "--skip-test-db"], timeout=120, env=env)

        def argv(port):
            cmd = ["/usr/sbin/mariadbd", "--no-defaults", "--datadir=" + self.data, "--port=%s" % port,
                   "--bind-address=127.0.0.1", "--socket=" + self.sock, "--pid-file=" + self.pidfile,
                   "--skip-grant-tables", "--max-allowed-packet=64M", "--innodb-buffer-pool-size=64M",
                   "--max-connections=200", "--skip-name-resolve"]
            return as_user(MARIADB_USER) + preload_cmd(cmd, self.preload)
        return self._start_on_free_port(argv, lambda: "ready for connections" in read_tail(self.out_path, 20000),
                                        timeout)



class ProgramServer(_Server):
    """Any server program that prints 'port N' on a line of its own after binding port 0."""

    name = "program"
    python = True
    port_re = r"^port (\d+)$"

    def __init__(self, argv, **kw):
        super().__init__(**kw)
        self.argv = argv

    def start(self, timeout=30):
        self._popen(pin(self.cpu) + preload_cmd(self.argv, self.preload))

        def ready():
            m = re.search(self.port_re, read_tail(self.out_path), re.M)
            if m:
                self.port = int(m.group(1))
            return m
        self._wait_ready(ready, timeout)
        return self


class SockperfServer(_Server):
    """`sockperf server --tcp` on 127.0.0.1 (the latency tool of the libvma world)."""

    name = "sockperf"

    def start(self, timeout=30):
        def argv_for(port):
            return preload_cmd([SOCKPERF, "server", "--tcp", "-i", "127.0.0.1", "-p", str(port)], self.preload)

        def ready():
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            except OSError:
                return False
        return self._start_on_free_port(argv_for, ready, timeout)


class HttpServer(ProgramServer):
    """/usr/bin/python3 -m http.server on directory, 127.0.0.1, port 0 (the port is read from
    its 'Serving HTTP on 127.0.0.1 port N' line)."""

    name = "http"
    port_re = r"Serving HTTP on \S+ port (\d+)"

    def __init__(self, directory, **kw):
        super().__init__([SYS_PY, "-u", "-m", "http.server", "--bind", "127.0.0.1", "--directory", directory, "0"],
                         **kw)
        self.directory = directory

    def url(self, name):
        return "http://127.0.0.1:%d/%s" % (self.port, name)


def memory_kib(pids):
    """{"pss": .., "rss": ..} in KiB summed over pids from /proc/PID/smaps_rollup (PSS splits
    each shared page among the processes that map it, so shared memory is counted once in
    total).  Processes that vanished or cannot be read are skipped; "procs" counts the read ones."""
    tot = {"pss": 0, "rss": 0, "procs": 0}
    for pid in pids:
        try:
            with open("/proc/%d/smaps_rollup" % pid) as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key in ("Pss", "Rss"):
                tot[key.lower()] += int(rest.split()[0])
        tot["procs"] += 1
    return tot


def conns_of(pids, port, established_only=False):
    """TCP connections (psutil) of the given processes whose local or remote port is port,
    excluding listening sockets."""
    found = []
    if psutil is None:
        return found
    for pid in pids:
        try:
            cs = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in cs:
            if c.status == psutil.CONN_LISTEN:
                continue
            if established_only and c.status != psutil.CONN_ESTABLISHED:
                continue
            if (c.laddr and c.laddr.port == port) or (c.raddr and c.raddr.port == port):
                found.append((pid, c))
    return found


if __name__ == "__main__":
    print(preload_status())
    sys.exit(0)
