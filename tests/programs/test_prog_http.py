"""curl fetching a 100 MB file from `python3 -m http.server` (Debian's /usr/bin/python3), in
every pairing (see conftest.py)."""
import os

from progutil import sha256_file

CURL = "/usr/bin/curl"


def test_curl_100mb(ctx, http_dir, tmp_path):
    srv = ctx.server("http")
    out = str(tmp_path / "got.bin")
    url = "http://127.0.0.1:%d/%s" % (srv.port, http_dir["big"])
    res = ctx.run([CURL, "-sS", "--fail", "--max-time", "120", "-o", out, "-w", "%{http_code} %{size_download}",
                   url], timeout=150)
    assert res.stdout.decode().split() == ["200", str(http_dir["size"])]
    assert os.path.getsize(out) == http_dir["size"]
    assert sha256_file(out) == http_dir["sha256"]
    small = ctx.run([CURL, "-sS", "--fail", "--max-time", "30",
                     "http://127.0.0.1:%d/small.txt" % srv.port], timeout=40)
    assert small.stdout == b"hello from http.server\n"
    ctx.check_transport(srv.port, min_conns=2)


def _aborts_on_data():
    """The kernel's count of connections closed with unread bytes, which it ends with a
    reset instead of a FIN (TcpExt TCPAbortOnData)."""
    with open("/proc/net/netstat") as f:
        names, values = [line.split() for line in f.readlines()[:2]]
    return int(values[names.index("TCPAbortOnData")])


def test_short_connections_end_with_fin(ctx, http_dir):
    """500 HTTP/1.0 requests of ab, one connection each: every connection ends as over TCP,
    with no reset.  A server whose client's request came before the handshake's answer
    (preamble frames) used to close with its doorbell request still standing; the client's
    end of stream then rang into the closed socket, which the kernel answered with a reset
    (102 of 500 connections)."""
    srv = ctx.server("http")
    before = _aborts_on_data()
    res = ctx.run(["/usr/bin/ab", "-q", "-n", "500", "-c", "1", "http://127.0.0.1:%d/small.txt" % srv.port],
                  timeout=120)
    out = res.stdout.decode()
    assert "Complete requests:      500" in out and "Failed requests:        0" in out, out
    assert _aborts_on_data() - before == 0
    ctx.check_transport(srv.port, min_conns=500)
