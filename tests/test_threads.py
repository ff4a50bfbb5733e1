"""Threads behave as they do with kernel sockets (issue 15, point 2).

tests/c/threads.c races close/shutdown against blocked recv/send/poll/epoll_wait,
epoll_ctl against epoll_wait, dup2/dup3 onto a socket another thread sends on, fork
while other threads are inside calls, and a forking server's fork against its own
process's connect.  Each scenario runs under the preload library as
built, and under AddressSanitizer (+UBSan) and ThreadSanitizer builds of the library and
the program: a sanitizer report, a crash, a hang or a result TCP would not give fails.
"""
import os
import subprocess

import pytest

import sanitizers

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "c", "threads.c")
SCENARIOS = ["close_vs_recv", "shutdown_wakes_recv", "close_vs_send", "close_vs_wait", "epoll_ctl_vs_wait",
             "dup_onto_busy", "fork_in_calls", "fork_vs_connect"]
VARIANTS = ["plain", "asan", "tsan"]
PROGRAM_FLAGS = {"tsan": ["-DRS_DIRECT", "-ldl"]}     # see RS_DIRECT in tests/c/threads.c


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{variant: (program, LD_PRELOAD value)}"""
    base = str(tmp_path_factory.mktemp("threads"))
    return {v: (sanitizers.program(v, SRC, os.path.join(base, "threads-" + v), PROGRAM_FLAGS.get(v, ())),
                sanitizers.library(v, base)) for v in VARIANTS}


def _run(builds, variant, scenario, tmp_path):
    prog, preload = builds[variant]
    log = str(tmp_path / "rs.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDMASOCK_")}
    env.update(sanitizers.ENV, LD_PRELOAD=preload, RDMASOCK_LOG_FILE=log)
    p = subprocess.run([prog, scenario], capture_output=True, text=True, timeout=120, env=env)
    with open(log) if os.path.exists(log) else open(os.devnull) as f:
        upgraded = sum(1 for line in f if "transport=shm" in line)
    return p, upgraded


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_threads(builds, variant, scenario, tmp_path):
    p, upgraded = _run(builds, variant, scenario, tmp_path)
    report = "exit %d\nstdout:\n%s\nstderr:\n%s" % (p.returncode, p.stdout, p.stderr[-6000:])
    assert p.returncode == 0 and p.stdout.startswith("ok " + scenario), report
    assert not sanitizers.report_problems(p.stderr), report
    assert upgraded >= 2, "the connections were not upgraded (%d shm log lines)\n%s" % (upgraded, report)
