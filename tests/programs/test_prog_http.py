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
