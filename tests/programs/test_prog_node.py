"""Node.js (libuv's event loop) echoing over TCP, in every pairing (see conftest.py):
tests/programs/node_echo.js.  libuv closes descriptors with syscall(SYS_close, fd), where
libc's close() is not called, and its next connection takes the same number.  In the
cluster variants the primary accepts each connection and passes it to one of two workers
(SCM_RIGHTS), which answers the client's HELLO, or both workers accept on the listening
socket, whose rendezvous name only one of them can hold."""
import pytest

from progutil import NODE, NODE_PROG


@pytest.mark.parametrize("kind", ["node", "node-cluster", "node-cluster-shared"])
def test_node_echo_connections_one_after_another_and_at_once(ctx, kind):
    srv = ctx.server(kind)
    seq, conc = 30, 20
    res = ctx.run([NODE, NODE_PROG, "client", str(srv.port), str(seq), str(conc), "300000"], timeout=120,
                  check=False)
    out = res.stdout.decode()
    assert res.returncode == 0 and out.split() == ["ok", str(seq + conc)], out + res.stderr.decode()
    ctx.check_transport(srv.port, min_conns=seq + conc)
