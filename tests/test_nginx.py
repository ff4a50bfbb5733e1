"""nginx (Debian's nginx-light, unmodified) serves files byte-exact to curl, both under the
preload library: 1 KB to 1 GB, with sendfile on and off, tcp_nopush and tcp_nodelay on
and off, with epoll (edge-triggered: Debian's nginx has no other event method; level-
triggered epoll is covered by tests/c/preload_calls.c).  nginx's worker writes until EAGAIN and then waits for EPOLLOUT: the wait
must end when the ring has room again (the reader's credit), never only at a timeout.
The server and the client log transport=shm for every connection.

nginx runs as root here with its own configuration, in the foreground, on a free loopback
port; it is stopped by PID."""
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import free_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
CURL = "/usr/bin/curl"
RUN = [sys.executable, "-m", "rdmasock", "run", "--"]
SIZES = {"1k.bin": 1 << 10, "1m.bin": 1 << 20, "50m.bin": 50 << 20, "1g.bin": 1 << 30}

pytestmark = pytest.mark.skipif(not os.path.exists(NGINX),
                                reason="nginx is not installed (scripts/setup.sh installs nginx-light)")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("www")
    sums = {}
    for name, size in SIZES.items():
        h = hashlib.sha256()
        with open(d / name, "wb") as f:
            left = size
            block = os.urandom(1 << 20)
            while left:
                b = block[: min(left, len(block))]
                f.write(b)
                h.update(b)
                left -= len(b)
                block = hashlib.sha256(block[:64]).digest() * (1 << 15)
        sums[name] = h.hexdigest()
    os.chmod(d, 0o755)
    return str(d), sums


def _conf(tmp, root, port, sendfile, nopush, nodelay, method):
    conf = tmp / "nginx.conf"
    conf.write_text("""
daemon off;
master_process on;
worker_processes 1;
user root;
pid %(tmp)s/nginx.pid;
error_log %(tmp)s/error.log warn;
events { use %(method)s; worker_connections 64; }
http {
    access_log off;
    client_body_temp_path %(tmp)s/body;
    proxy_temp_path %(tmp)s/proxy;
    fastcgi_temp_path %(tmp)s/fastcgi;
    uwsgi_temp_path %(tmp)s/uwsgi;
    scgi_temp_path %(tmp)s/scgi;
    sendfile %(sendfile)s;
    tcp_nopush %(nopush)s;
    tcp_nodelay %(nodelay)s;
    keepalive_timeout 5;
    server {
        listen 127.0.0.1:%(port)d;
        root %(root)s;
    }
}
""" % dict(tmp=tmp, root=root, port=port, sendfile=sendfile, nopush=nopush, nodelay=nodelay, method=method))
    return str(conf)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def _start_nginx(tmp_path, root, env, sendfile="on", nopush="off", nodelay="on", method="epoll"):
    port = free_port()
    conf = _conf(tmp_path, root, port, sendfile, nopush, nodelay, method)
    srv = subprocess.Popen(RUN + [NGINX, "-c", conf, "-e", str(tmp_path / "error.log")], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return srv, port
        except OSError:
            if srv.poll() is not None or time.monotonic() > deadline:
                _stop_nginx(srv)
                pytest.fail("nginx did not start: %s" % srv.stderr.read())
            time.sleep(0.05)


def _stop_nginx(srv):
    if srv.poll() is None:
        srv.send_signal(signal.SIGQUIT)
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait(10)


@pytest.mark.parametrize("method", ["epoll"])   # Debian's nginx is built with epoll only (no poll/select module)
@pytest.mark.parametrize("sendfile,nopush,nodelay", [("on", "off", "on"), ("on", "on", "off"), ("off", "off", "on"),
                                                     ("off", "on", "off")],
                         ids=["sendfile", "sendfile-nopush-nodelay_off", "copy", "copy-nopush-nodelay_off"])
def test_nginx_serves_files_byte_exact(files, tmp_path, method, sendfile, nopush, nodelay):
    root, sums = files
    log = str(tmp_path / "rs.log")
    env = dict(os.environ, RDMASOCK_LOG_FILE=log)
    srv, port = _start_nginx(tmp_path, root, env, sendfile, nopush, nodelay, method)
    try:
        for name, size in SIZES.items():
            out = str(tmp_path / ("got-" + name))
            r = subprocess.run(RUN + [CURL, "-sS", "--fail", "--max-time", "120", "-o", out, "-w", "%{size_download}",
                                      "http://127.0.0.1:%d/%s" % (port, name)], env=env, capture_output=True,
                               timeout=150)
            assert r.returncode == 0 and not r.stderr, (name, r.returncode, r.stderr)
            assert r.stdout == str(size).encode() and _sha256(out) == sums[name], name
            os.unlink(out)
    finally:
        _stop_nginx(srv)
    text = open(log).read()
    lines = [l for l in text.splitlines() if "transport=" in l]
    # the readiness probe above connects plain (not preloaded): the server logs it as tcp
    clients = [l for l in lines if "role=client" in l]
    assert len(clients) == len(SIZES) and all("transport=shm" in l for l in clients), text
    assert sum("role=server" in l and "transport=shm" in l for l in lines) >= len(SIZES), text


WRK, AB = shutil.which("wrk") or "/usr/bin/wrk", shutil.which("ab") or "/usr/bin/ab"


@pytest.mark.parametrize("tool", ["wrk", "ab"])
def test_load_generators_with_20_connections(files, tmp_path, tool):
    """epoll-driven HTTP load generators (wrk; ab, whose APR poll is epoll) with 20
    concurrent keep-alive connections to nginx, all preloaded: every request completes,
    none fails, and the connections are upgraded."""
    exe = WRK if tool == "wrk" else AB
    if not os.path.exists(exe):
        pytest.skip("%s is not installed (scripts/setup.sh installs wrk and apache2-utils)" % tool)
    root, _ = files
    log = str(tmp_path / "rs.log")
    env = dict(os.environ, RDMASOCK_LOG_FILE=log)
    srv, port = _start_nginx(tmp_path, root, env)
    url = "http://127.0.0.1:%d/1k.bin" % port
    try:
        argv = [WRK, "-t", "2", "-c", "20", "-d", "2s", url] if tool == "wrk" else \
               [AB, "-q", "-k", "-c", "20", "-n", "20000", "-s", "10", url]
        r = subprocess.run(RUN + argv, env=env, capture_output=True, text=True, timeout=60)
    finally:
        _stop_nginx(srv)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    if tool == "wrk":
        assert "Socket errors" not in out and "Non-2xx" not in out, out
        assert int(out.split(" requests in ")[0].split()[-1]) > 1000, out
    else:
        assert "Complete requests:      20000" in out and "Failed requests:        0" in out, out
    text = open(log).read()
    clients = [l for l in text.splitlines() if "role=client" in l]
    assert len(clients) >= 20 and all("transport=shm" in l for l in clients), text

