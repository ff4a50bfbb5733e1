"""Packaging: a wheel built from this checkout, installed into throwaway venvs outside it,
upgrades a connection between unmodified programs, says the truth in `rdmasock doctor`,
and never writes into a program's stderr when the install is broken.

The wheel is built as a user would build it (`pip wheel .`, with build isolation), from
the checkout as it is (in-place build outputs of the editable install included), so a
packaging regression fails here."""
import glob
import json
import os
import shutil
import sys
import socket
import subprocess
import tempfile
import time
import zipfile

import pytest

from conftest import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYS_PY = "/usr/bin/python3"
CURL = "/usr/bin/curl"
PIP_TIMEOUT = 600


def _run(cmd, timeout=PIP_TIMEOUT, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    assert p.returncode == 0, "%s failed (%d):\n%s\n%s" % (" ".join(cmd), p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


@pytest.fixture(scope="module")
def area():
    """A directory outside the checkout that other users (postgres) can traverse."""
    d = tempfile.mkdtemp(prefix="rdmasock-install-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def wheel(area):
    out = os.path.join(area, "wheelhouse")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", "-w", out, REPO])
    found = glob.glob(os.path.join(out, "rdmasock-*.whl"))
    assert len(found) == 1, found
    return found[0]


def _venv(area, name, wheel, system_site=False, deps=True):
    path = os.path.join(area, name)
    _run([SYS_PY, "-m", "venv"] + (["--system-site-packages"] if system_site else []) + [path])
    _run([os.path.join(path, "bin", "pip"), "install", "-q", "--disable-pip-version-check"]
         + ([] if deps else ["--no-deps"]) + [wheel])
    os.chmod(path, 0o755)
    return path


def _as(user):
    return ["setpriv", "--reuid=%s" % user, "--regid=%s" % user, "--init-groups", "--"] if user else []


def _curl_through(venv, area, user=None):
    """`rdmasock run -- python3 -m http.server` and `rdmasock run -- curl`, both from the
    venv's command; returns the log lines of the exchange."""
    log = os.path.join(area, "rs-%s-%s.log" % (os.path.basename(venv), user or "root"))
    if os.path.exists(log):
        os.unlink(log)
    with open(log, "w"):
        pass
    os.chmod(log, 0o666)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDMASOCK_")}
    env["RDMASOCK_LOG_FILE"] = log
    rs = os.path.join(venv, "bin", "rdmasock")
    port = free_port()
    srv = subprocess.Popen(_as(user) + [rs, "run", "--", SYS_PY, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                        "--directory", area],
                           env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert srv.poll() is None, "http.server exited: %s" % srv.stderr.read().decode()
                assert time.monotonic() < deadline, "http.server did not listen"
                time.sleep(0.1)
        res = subprocess.run(_as(user) + [rs, "run", "--", CURL, "-sS", "--fail", "--max-time", "20",
                                          "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:%d/" % port],
                             env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stdout == "200", res
        assert res.stderr == "", "curl's stderr got: %r" % res.stderr
    finally:
        srv.kill()
        srv.wait(10)
    deadline = time.monotonic() + 10
    while True:
        with open(log) as f:
            lines = f.read().splitlines()
        client = [l for l in lines if "role=client" in l and "peer=127.0.0.1:%d " % port in l]
        ends = {l.split(" local=")[1].split()[0] for l in client}        # curl's side of each connection
        served = [l for l in lines if "role=server" in l and l.split(" peer=")[1].split()[0] in ends]
        if (served and client) or time.monotonic() > deadline:
            return lines, served, client
        time.sleep(0.1)


def _doctor(venv, user=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDMASOCK_")}
    p = subprocess.run(_as(user) + [os.path.join(venv, "bin", "rdmasock"), "doctor"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p
    return dict(line.split(": ", 1) for line in p.stdout.splitlines() if ": " in line)


def test_wheel_contents(wheel):
    """Binaries built for this wheel, and no path of the build (checkout) inside it."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        binaries = sorted(n for n in names if n.endswith(".so"))
        assert [os.path.basename(n).split(".")[0] for n in binaries] == ["_engine", "_native", "librdmasock"], binaries
        for n in names:
            data = z.read(n)
            assert REPO.encode() not in data, "%s contains the checkout's path %s" % (n, REPO)


def test_venv_without_system_site(area, wheel):
    """The usual venv: shm works; pyverbs is not reachable and doctor says how to fix it."""
    venv = _venv(area, "plain-venv", wheel)
    lines, served, client = _curl_through(venv, area)
    assert served and client, "\n".join(lines)
    assert all("transport=shm" in l for l in served + client), "\n".join(lines)
    doc = _doctor(venv)
    assert doc["build"] == "RDMA support compiled in"
    assert doc["pyverbs"].startswith("NOT importable") and "ln -s " in doc["pyverbs"], doc
    assert doc["preload engine"].startswith("starts: ") and "pyverbs=no" in doc["preload engine"], doc
    assert venv in doc["preload engine"], doc                 # the engine embeds this venv's Python
    assert doc["RDMA"].startswith("not usable: pyverbs is not importable"), doc


def test_venv_with_system_site(area, wheel):
    """--system-site-packages: pyverbs is reachable from the venv and from the engine; with
    no RDMA device on the host, doctor says that is what is missing."""
    venv = _venv(area, "system-site-venv", wheel, system_site=True)
    lines, served, client = _curl_through(venv, area)
    assert served and client and all("transport=shm" in l for l in served + client), "\n".join(lines)
    doc = _doctor(venv)
    assert doc["pyverbs"] == "available", doc
    assert "pyverbs=yes" in doc["preload engine"], doc
    has_device = bool(os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"))
    if not has_device:
        assert doc["RDMA"].startswith("not usable: no_device"), doc


def test_other_user_from_root_owned_venv(area, wheel):
    """postgres runs the programs from a venv root installed."""
    venv = os.path.join(area, "plain-venv")
    if not os.path.isdir(venv):
        venv = _venv(area, "plain-venv", wheel)
    lines, served, client = _curl_through(venv, area, user="postgres")
    assert served and client and all("transport=shm" in l for l in served + client), "\n".join(lines)
    assert _doctor(venv, user="postgres")["preload engine"].startswith("starts: ")


def test_broken_install_is_silent(area, wheel):
    """The wheel without its dependencies: the engine cannot start.  The program runs on over
    TCP, its stderr is byte-identical to a plain run's, and the log line says why."""
    venv = _venv(area, "broken-venv", wheel, deps=False)
    lib = os.path.join(venv, "lib", "python3.11", "site-packages", "rdmasock", "librdmasock.so")
    assert os.path.exists(lib)
    log = os.path.join(area, "broken.log")
    port = free_port()
    srv = subprocess.Popen([SYS_PY, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", area],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        url = "http://127.0.0.1:%d/no-such-file" % port          # curl writes an error to stderr
        base = {k: v for k, v in os.environ.items() if not k.startswith("RDMASOCK_")}
        plain = subprocess.run([CURL, "-sS", "--fail", url], capture_output=True, timeout=30, env=base)
        pre = subprocess.run([CURL, "-sS", "--fail", url], capture_output=True, timeout=30,
                             env=dict(base, LD_PRELOAD=lib, RDMASOCK_LOG_FILE=log))
    finally:
        srv.kill()
        srv.wait(10)
    assert plain.returncode == pre.returncode == 22
    assert pre.stdout == plain.stdout
    assert pre.stderr == plain.stderr, (pre.stderr, plain.stderr)
    with open(log) as f:
        text = f.read()
    assert "engine=unavailable transport=tcp reason=engine_import_failed" in text, text
    assert "_cffi_backend" in text and "sys.path=" in text, text
    assert "NOT" in _doctor(venv)["preload engine"]


def test_build_without_rdma_is_reported(area):
    """RDMASOCK_BUILD_RDMA=0 builds a shm-only library on purpose: it still upgrades to
    shm, and doctor says plainly that RDMA is missing from the build and what to do."""
    out = os.path.join(area, "wheelhouse-nordma")
    env = dict(os.environ, RDMASOCK_BUILD_RDMA="0")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", "-w", out, REPO],
         env=env)
    whl = glob.glob(os.path.join(out, "rdmasock-*.whl"))[0]
    venv = _venv(area, "nordma-venv", whl, system_site=True)
    lines, served, client = _curl_through(venv, area)
    assert served and client and all("transport=shm" in l for l in served + client), "\n".join(lines)
    doc = _doctor(venv)
    assert doc["build"].startswith("NO RDMA: this build of rdmasock has no RDMA support"), doc
    assert "apt-get install libibverbs-dev" in doc["build"], doc
    assert doc["RDMA"].startswith("not usable: this build of rdmasock has no RDMA support"), doc


def test_bench_from_the_wheel(area, wheel):
    """`rdmasock bench` from an installed wheel, run outside any checkout: the suite ships in
    the package (its C programs included), measures the host rows, and says why the Soft-RoCE
    VM rows need a source checkout instead of looking for one."""
    venv = os.path.join(area, "plain-venv")
    if not os.path.exists(venv):
        venv = _venv(area, "plain-venv", wheel)
    out = os.path.join(area, "bench-out")
    p = subprocess.run([os.path.join(venv, "bin", "rdmasock"), "bench", "pingpong", "--quick", "--no-plots",
                        "--placements", "cross", "--out-dir", out], cwd=area, capture_output=True, text=True,
                       timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    found = glob.glob(os.path.join(out, "pingpong-*.json"))
    assert len(found) == 1, found
    with open(found[0]) as f:
        rows = json.load(f)["results"]["pingpong"]["rows"]
    host = [r for r in rows if not r.get("vm")]
    assert host and all(r["status"] == "ok" for r in host), [(r["name"], r["status"]) for r in host]
    vm = [r for r in rows if r.get("vm")]
    assert vm and all("source checkout" in r["status"] for r in vm), [(r["name"], r["status"]) for r in vm]
