"""Network tools nobody wrote for rdmasock, in every pairing (see conftest.py): socat (a
forking listener that execs `cat` on each connection, and one-way copies), OpenSSL's TLS
server and curl over it, an rsync daemon (pull, push and a delta transfer) and git daemon
(clone and push; it reads the request, then execs upload-pack or receive-pack on the
connection, which moves it to TCP: reason exec)."""
import os
import subprocess

from progutil import sha256_file

SOCAT = "/usr/bin/socat"
OPENSSL = "/usr/bin/openssl"
CURL = "/usr/bin/curl"
RSYNC = "/usr/bin/rsync"
GIT = "/usr/bin/git"
LISTEN = "TCP-LISTEN:%d,bind=127.0.0.1,reuseaddr,fork"


def _random_file(path, size):
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    return sha256_file(path)


def test_socat_fork_exec_echo_and_copies(ctx, tmp_path):
    """Each connection's forked socat child execs `cat` on it (a socket accepted and not yet
    used: the new program upgrades it); 3 MB echoed byte-exact, 3 times; then a 20 MB file
    each way through `socat -u`."""
    echo = ctx.fresh_server(lambda port, d: [SOCAT, LISTEN % port, "EXEC:cat"])
    data = tmp_path / "data.bin"
    digest = _random_file(data, 3 << 20)
    for i in range(3):
        out = tmp_path / ("echo%d.bin" % i)
        with open(data, "rb") as src, open(out, "wb") as dst:
            ctx.run([SOCAT, "-t", "10", "TCP:127.0.0.1:%d" % echo.port, "-"], timeout=60, stdin=src, stdout=dst)
        assert sha256_file(out) == digest, "echo %d" % i
    big = tmp_path / "big.bin"
    big_digest = _random_file(big, 20 << 20)
    sender = ctx.fresh_server(lambda port, d: [SOCAT, "-U", LISTEN % port, "OPEN:%s,rdonly" % big])
    got = tmp_path / "got.bin"
    ctx.run([SOCAT, "-u", "TCP:127.0.0.1:%d" % sender.port, "CREATE:%s" % got], timeout=60)
    assert sha256_file(got) == big_digest
    up = tmp_path / "up.bin"
    receiver = ctx.fresh_server(lambda port, d: [SOCAT, "-u", "TCP-LISTEN:%d,bind=127.0.0.1,reuseaddr" % port,
                                                 "CREATE:%s" % up])
    ctx.run([SOCAT, "-u", "OPEN:%s,rdonly" % big, "TCP:127.0.0.1:%d" % receiver.port], timeout=60)
    assert receiver.proc.wait(30) == 0 and sha256_file(up) == big_digest
    for srv, n in ((echo, 3), (sender, 1), (receiver, 1)):
        ctx.check_transport(srv.port, min_conns=n)


def test_openssl_tls_server_with_curl(ctx, tmp_path):
    """`openssl s_server -WWW` serves a 20 MB file over TLS; curl fetches it twice."""
    www = tmp_path / "www"
    www.mkdir()
    digest = _random_file(www / "big.bin", 20 << 20)
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=localhost"], check=True, capture_output=True, timeout=60)

    def argv(port, d):
        return ["/usr/bin/env", "-C", str(www), OPENSSL, "s_server", "-quiet", "-accept", "127.0.0.1:%d" % port,
                "-cert", cert, "-key", key, "-WWW"]
    srv = ctx.fresh_server(argv)
    for i in range(2):
        out = str(tmp_path / ("got%d.bin" % i))
        ctx.run([CURL, "-sSk", "--fail", "--max-time", "60", "-o", out, "https://127.0.0.1:%d/big.bin" % srv.port],
                timeout=90)
        assert sha256_file(out) == digest, "fetch %d" % i
    ctx.check_transport(srv.port, min_conns=2)


def test_rsync_daemon_pull_push_delta(ctx, tmp_path):
    """An rsync daemon (a process per connection): a 20 MB file pulled, changed in the middle
    and pulled again (the delta algorithm's two-way traffic), and 5 MB pushed."""
    mod = tmp_path / "mod"
    mod.mkdir()
    digest = _random_file(mod / "big.bin", 20 << 20)
    conf = tmp_path / "rsyncd.conf"
    conf.write_text("use chroot = no\npid file = %s\n[m]\npath = %s\nread only = no\nuid = root\ngid = root\n"
                    % (tmp_path / "rsyncd.pid", mod))
    srv = ctx.fresh_server(lambda port, d: [RSYNC, "--daemon", "--no-detach", "--config=%s" % conf,
                                            "--port=%d" % port, "--address=127.0.0.1"])
    url = "rsync://127.0.0.1:%d/m/" % srv.port
    dst = tmp_path / "dst"
    ctx.run([RSYNC, "-a", url, str(dst) + "/"], timeout=90)
    assert sha256_file(dst / "big.bin") == digest
    with open(dst / "big.bin", "r+b") as f:
        f.seek(10 << 20)
        f.write(os.urandom(4096))
    ctx.run([RSYNC, "-a", "--ignore-times", "--no-whole-file", url, str(dst) + "/"], timeout=90)
    assert sha256_file(dst / "big.bin") == digest
    up = tmp_path / "up"
    up.mkdir()
    up_digest = _random_file(up / "u.bin", 5 << 20)
    ctx.run([RSYNC, "-a", str(up) + "/", url + "up/"], timeout=90)
    assert sha256_file(mod / "up" / "u.bin") == up_digest
    ctx.check_transport(srv.port, min_conns=3)


def test_git_daemon_clone_and_push(ctx, tmp_path):
    """git daemon reads each request, then execs upload-pack (clone) or receive-pack (push)
    on the connection: the connection goes on over TCP (reason exec) and the clone and the
    push are whole."""
    src = tmp_path / "src"
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.invalid", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.invalid")

    def git(*args, cwd=None):
        return subprocess.run([GIT, *args], cwd=cwd, env=env, check=True, capture_output=True, timeout=60)
    git("init", "-q", str(src))
    for i in range(3):
        _random_file(src / ("f%d.bin" % i), 2 << 20)
        git("add", ".", cwd=src)
        git("commit", "-q", "-m", "c%d" % i, cwd=src)
    base = tmp_path / "base"
    base.mkdir()
    git("clone", "-q", "--bare", str(src), str(base / "r.git"))
    head = git("rev-parse", "HEAD", cwd=src).stdout.strip()
    srv = ctx.fresh_server(lambda port, d: [GIT, "daemon", "--export-all", "--base-path=%s" % base, "--reuseaddr",
                                            "--listen=127.0.0.1", "--port=%d" % port, "--enable=receive-pack"])
    url = "git://127.0.0.1:%d/r.git" % srv.port
    clone = tmp_path / "clone"
    ctx.run([GIT, "clone", "-q", url, str(clone)], timeout=90, env=env)
    assert git("rev-parse", "HEAD", cwd=clone).stdout.strip() == head
    git("fsck", "--strict", cwd=clone)                 # raises on a damaged clone
    _random_file(clone / "new.bin", 1 << 20)
    git("add", ".", cwd=clone)
    git("commit", "-q", "-m", "pushed", cwd=clone)
    ctx.run([GIT, "push", "-q", "origin", "HEAD:refs/heads/pushed"], timeout=90, env=env, cwd=str(clone))
    assert git("rev-parse", "pushed", cwd=base / "r.git").stdout == git("rev-parse", "HEAD", cwd=clone).stdout
    ctx.check_transport(srv.port, min_conns=2)
    if ctx.pairing == "both":
        moved = [r for r in ctx.records(srv.port) if "reason=exec" in r["line"]]
        assert len(moved) >= 2 and all(r["role"] == "server" for r in moved), moved
