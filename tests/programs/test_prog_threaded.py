"""A threaded Python program with 200 concurrent connections (tests/programs/echo_prog.py,
run by Debian's /usr/bin/python3 3.11.2, the preload library's build base; the pyenv
`python3` on PATH is another patch version and is deliberately not used), in every pairing."""
import json

from progutil import ECHO_PROG, S

CONNS = 200
SIZE = 64 * 1024


def test_200_concurrent_connections(ctx):
    srv = ctx.server("echo")
    res = ctx.run([S.SYS_PY, ECHO_PROG, "client", str(srv.port), str(CONNS), str(SIZE)], timeout=180, check=False)
    lines = res.stdout.decode().strip().splitlines()
    assert res.returncode == 0 and lines, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    summary = json.loads(lines[-1])
    assert summary["n"] == CONNS and summary["ok"] == CONNS, summary
    ctx.check_transport(srv.port, min_conns=CONNS)
