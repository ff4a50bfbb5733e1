"""The harness itself: log parsing and the per-pairing transport verdicts, on synthetic
RDMASOCK_LOG_FILE lines (no programs are started)."""
import pytest

from progutil import Ctx
from progutil import parse_log, preload_cmd, S

C = "2026-11-22T10:00:00 pid=11 role=client local=127.0.0.1:40000 peer=127.0.0.1:5432 transport=%s%s"
SV = "2026-11-22T10:00:00 pid=22 role=server local=127.0.0.1:5432 peer=127.0.0.1:40000 transport=%s%s"


def _ctx(pairing, tmp_path, lines):
    path = tmp_path / "log"
    path.write_text("".join(line + "\n" for line in lines))
    c = Ctx.__new__(Ctx)
    c.pairing, c.log_file, c.mark = pairing, str(path), 0
    return c


def test_parse_log(tmp_path):
    p = tmp_path / "log"
    p.write_text(C % ("tcp", " reason=peer_not_rdmasock") + "\n\n" + SV % ("shm", "") + "\n")
    recs = parse_log(str(p))
    assert [(r["role"], r["pid"], r["transport"], r["reason"]) for r in recs] == [
        ("client", 11, "tcp", "peer_not_rdmasock"), ("server", 22, "shm", None)]
    assert recs[0]["local"] == "127.0.0.1:40000" and recs[0]["peer"] == "127.0.0.1:5432"
    assert recs[0]["time"] == "2026-11-22T10:00:00"
    assert parse_log(str(p), offset=len((C % ("tcp", " reason=peer_not_rdmasock")).encode()) + 2)[0]["pid"] == 22
    assert parse_log(str(tmp_path / "missing")) == []


def test_preload_cmd():
    assert preload_cmd(["redis-cli", 1], False) == ["redis-cli", "1"]
    assert preload_cmd(["redis-cli"], True) == [S.VENV_PY, "-m", "rdmasock", "run", "--", "redis-cli"]


@pytest.mark.parametrize("pairing,lines,ok", [
    ("both", [C % ("shm", ""), SV % ("shm", "")], True),
    ("both", [C % ("shm", "")], False),                                   # server side missing
    ("both", [C % ("tcp", " reason=x"), SV % ("tcp", " reason=x")], False),
    ("client", [C % ("tcp", " reason=peer_not_rdmasock")], True),
    ("client", [C % ("tcp", "")], False),                                 # no reason
    ("client", [C % ("shm", "")], False),
    ("client", [], False),                                                # library not loaded?
    ("server", [SV % ("tcp", " reason=peer_not_rdmasock")], True),
    ("server", [SV % ("tcp", " reason=x"), C % ("tcp", " reason=x")], False),
    ("client", [(C % ("tcp", " reason=x")).replace("local=127.0.0.1:40000", "local=None")], False),
    ("plain", [], True),
    ("plain", [C % ("tcp", " reason=x")], False),
])
def test_transport_verdicts(tmp_path, pairing, lines, ok):
    c = _ctx(pairing, tmp_path, lines)
    probs = c._problems(c.records(5432), 1)
    assert (not probs) == ok, probs
