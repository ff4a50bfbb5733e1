"""Echo servers and clients in other languages' socket libraries, in every pairing (see
conftest.py), the bytes checked on both ends: Ruby (a thread per connection, its IO waits
in ppoll, reads and writes from two threads of one socket) and PHP (one process,
stream_select over every connection, non-blocking streams; the client's concurrent
connections are forked processes)."""
import pytest

from progutil import ECHO_PROGS


@pytest.mark.parametrize("lang", sorted(ECHO_PROGS))
def test_echo_connections_one_after_another_and_at_once(ctx, lang):
    srv = ctx.server(lang)
    seq, conc = 20, 10
    res = ctx.run(ECHO_PROGS[lang] + ["client", str(srv.port), str(seq), str(conc), "300000"], timeout=120,
                  check=False)
    out = res.stdout.decode()
    assert res.returncode == 0 and out.split() == ["ok", str(seq + conc)], out + res.stderr.decode()
    ctx.check_transport(srv.port, min_conns=seq + conc)
