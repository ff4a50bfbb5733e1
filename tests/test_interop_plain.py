"""rdmasock with ordinary socket.socket programs: exactly TCP, never a foreign byte."""
import hashlib
import socket

import rdmasock
from conftest import recv_all, recv_exact


def test_rdmasock_client_plain_server_in_process():
    srv = socket.create_server(("127.0.0.1", 0))
    c = rdmasock.create_connection(srv.getsockname())
    s, _ = srv.accept()
    c.sendall(b"hello plain")
    c.shutdown(socket.SHUT_WR)
    assert recv_all(s) == b"hello plain"          # exactly the application's bytes
    s.sendall(b"reply")
    s.close()
    assert recv_all(c) == b"reply"
    assert c.transport == "tcp" and c.fallback_reason == "peer_not_rdmasock"
    c.close()
    srv.close()


def test_plain_client_rdmasock_server_in_process():
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname())
    s, _ = srv.accept()
    assert s.transport == "tcp" and s.fallback_reason == "peer_not_rdmasock"
    s.sendall(b"server speaks first")
    assert recv_exact(c, 19) == b"server speaks first"   # no handshake byte before it
    c.sendall(b"x" * 100000)
    c.close()
    assert recv_all(s) == b"x" * 100000
    s.close()
    srv.close()


def test_plain_server_process_gets_exact_bytes(peers):
    p = peers("sink-server", "plain")
    payload = bytes(range(256)) * 4000
    c = rdmasock.create_connection(("127.0.0.1", p.port))
    c.sendall(payload)
    c.close()
    line = p.readline().split()
    assert line[:3] == ["got", str(len(payload)), hashlib.sha256(payload).hexdigest()]


def test_rdmasock_server_process_plain_client(peers):
    p = peers("source-server", "rdmasock", 300000)
    c = socket.create_connection(("127.0.0.1", p.port))
    got = recv_all(c)
    import random
    assert got == random.Random(7).randbytes(300000)
    assert p.readline() == "transport tcp"
    c.close()


def test_rdmasock_both_processes_upgrade(peers):
    p = peers("sink-server", "rdmasock")
    payload = bytes(range(256)) * 40000
    c = rdmasock.create_connection(("127.0.0.1", p.port))
    c.sendall(payload)
    assert c.transport == "shm"
    c.close()
    line = p.readline().split()
    assert line == ["got", str(len(payload)), hashlib.sha256(payload).hexdigest(), "shm"]


def test_disabled_and_excluded_stay_tcp(monkeypatch):
    from rdmasock import config
    monkeypatch.setenv("RDMASOCK_DISABLE", "1")
    config.reload()
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c = rdmasock.create_connection(srv.getsockname())
    s, _ = srv.accept()
    c.sendall(b"a")
    assert recv_exact(s, 1) == b"a"
    assert c.fallback_reason == "disabled" and s.transport == "tcp"
    for x in (c, s, srv):
        x.close()
    monkeypatch.delenv("RDMASOCK_DISABLE")
    srv = rdmasock.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("RDMASOCK_EXCLUDE_PORTS", str(srv.getsockname()[1]))
    config.reload()
    c = rdmasock.create_connection(srv.getsockname())
    s, _ = srv.accept()
    c.sendall(b"b")
    assert recv_exact(s, 1) == b"b" and c.fallback_reason == "excluded"
    for x in (c, s, srv):
        x.close()


def test_log_file_lines(tmp_path, monkeypatch):
    from rdmasock import config
    log = tmp_path / "rs.log"
    monkeypatch.setenv("RDMASOCK_LOG_FILE", str(log))
    config.reload()
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c = rdmasock.create_connection(srv.getsockname())
    s, _ = srv.accept()
    c.sendall(b"1")
    recv_exact(s, 1)
    plain_srv = socket.create_server(("127.0.0.1", 0))
    c2 = rdmasock.create_connection(plain_srv.getsockname())
    for x in (c, s, srv, c2, plain_srv):
        x.close()
    lines = log.read_text().splitlines()
    assert sum("role=server" in ln and "transport=shm" in ln for ln in lines) == 1
    assert sum("role=client" in ln and "transport=shm" in ln for ln in lines) == 1
    assert any("transport=tcp" in ln and "reason=peer_not_rdmasock" in ln for ln in lines)


def test_unwritable_log_file_program_runs_on(tmp_path, monkeypatch, capfd):
    from rdmasock import config
    monkeypatch.setenv("RDMASOCK_LOG_FILE", str(tmp_path / "no-such-dir" / "x.log"))
    config.reload()
    srv = rdmasock.create_server(("127.0.0.1", 0))
    c = rdmasock.create_connection(srv.getsockname())
    s, _ = srv.accept()
    c.sendall(b"z")
    assert recv_exact(s, 1) == b"z" and s.transport == "shm"
    for x in (c, s, srv):
        x.close()
    out, err = capfd.readouterr()
    assert out == "" and err == ""                # never prints into the program's output
