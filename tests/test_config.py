"""Configuration: include/exclude filters, transport choice, log level, unwritable log."""
import os

import pytest

import rdmasock
from rdmasock import config
from conftest import recv_exact


@pytest.mark.parametrize("env,expect", [
    ({"RDMASOCK_EXCLUDE": "127.0.0.1"}, "excluded"),
    ({"RDMASOCK_EXCLUDE": "127.0.0.0/8"}, "excluded"),
    ({"RDMASOCK_EXCLUDE": ":{port}"}, "excluded"),
    ({"RDMASOCK_EXCLUDE": "127.0.0.1:{port}"}, "excluded"),
    ({"RDMASOCK_EXCLUDE": "127.0.0.1:1"}, None),
    ({"RDMASOCK_INCLUDE": "10.0.0.0/8"}, "excluded"),
    ({"RDMASOCK_INCLUDE": "127.0.0.1"}, None),
    ({"RDMASOCK_EXCLUDE_PORTS": "{port}"}, "excluded"),
    ({"RDMASOCK_DISABLE": "1"}, "disabled"),
    ({"RDMASOCK_TRANSPORTS": "rdma"}, "rdma_unavailable"),     # no RDMA device on this host
    ({"RDMASOCK_TRANSPORTS": "tcp"}, "no_common_transport"),
])
def test_filters_decide_the_upgrade(env, expect):
    srv = rdmasock.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    config.reload({k: v.format(port=port) for k, v in env.items()})
    try:
        c = rdmasock.create_connection(("127.0.0.1", port))
        s, _ = srv.accept()
        c.sendall(b"ping")
        assert recv_exact(s, 4) == b"ping"
        assert c.fallback_reason == expect
        assert c.transport == ("shm" if expect is None else "tcp")
        c.close(); s.close()
    finally:
        srv.close()
        config.reload()


def test_log_file_and_level(tmp_path):
    path = str(tmp_path / "log")
    for level, lines in (("off", 0), ("error", 0), ("info", 2)):
        if os.path.exists(path):
            os.unlink(path)
        config.reload({"RDMASOCK_LOG_FILE": path, "RDMASOCK_LOG_LEVEL": level})
        with rdmasock.create_server(("127.0.0.1", 0)) as srv:
            c = rdmasock.create_connection(srv.getsockname())
            s, _ = srv.accept()
            c.sendall(b"x"); recv_exact(s, 1)
            c.close(); s.close()
        got = open(path).read().splitlines() if os.path.exists(path) else []
        assert len(got) == lines, (level, got)
        assert all("transport=shm" in g for g in got)
    config.reload()


def test_unwritable_log_file_runs_on(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    # not appendable, even by root: missing directory, a /proc file without a write
    # operation (opens, but the write fails), a directory
    bad = [str(d / "sub" / "log"), "/proc/version", str(d)]
    for path in bad:
        with pytest.raises(OSError):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, b"x")
            finally:
                os.close(fd)
    for path in bad:
        config.reload({"RDMASOCK_LOG_FILE": path})
        with rdmasock.create_server(("127.0.0.1", 0)) as srv:
            c = rdmasock.create_connection(srv.getsockname())
            s, _ = srv.accept()
            c.sendall(b"still works"); assert recv_exact(s, 11) == b"still works"
            assert c.transport == "shm"
            c.close(); s.close()
    config.reload()


def test_readme_documents_every_configuration_key_with_its_default():
    """The configuration table (shim/rs_contract.h RS_CONFIG, read by C and Python) and the
    README's table name the same variables, and each default there is the table's."""
    import os
    import re
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    rows = {}
    for line in readme.splitlines():
        if line.startswith("| `RDMASOCK_"):
            cells = line.split(" | ")
            for name in re.findall(r"`(RDMASOCK_[A-Z_]+)", cells[0]):
                rows[name] = cells[-1]
    table = dict(config.keys().values())
    assert set(rows) == set(table), (sorted(set(rows) - set(table)), sorted(set(table) - set(rows)))
    for name, default in table.items():
        if default:
            assert "`%s`" % default in rows[name] or rows[name].startswith(default), (name, default, rows[name])
