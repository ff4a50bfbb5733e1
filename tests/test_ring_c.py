"""The C data-path unit tests (tests/c/test_ring.c), built together with every shim/*.c.

They cover the ring (records, wrap, credit, doorbells, FIN, peer death) and the preamble
frames a client writes before the server's answer (rs_preamble.c; the pre_* tests: frame
bytes, order of frames / SWITCH / ring or plain bytes, MSG_PEEK, MSG_WAITALL, garbage
headers, EOF, partial headers, full sockets, 1 MiB of frames).

Two builds: one under AddressSanitizer + UndefinedBehaviorSanitizer (-O1 -g), one optimised
(-O2), each run as a separate process with a 120 s timeout.  A run passes when the program
exits 0 and neither sanitizer reported anything.

Tests that expose a known, not yet fixed bug of shim/ are listed in KNOWN_SHIM_BUGS: the
main runs skip them (`-x NAME`) and they run on their own as strict expected failures, so
the day the bug is fixed they XPASS and fail the suite until the entry is removed.  A
sanitizer report in one of them is never "expected": it fails the test.
"""
import glob
import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHIM = os.path.join(ROOT, "shim")
TEST_SRC = os.path.join(HERE, "c", "test_ring.c")
RUN_TIMEOUT = 120

BUILDS = {
    "asan": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer"],
    "O2": ["-O2"],
}
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "runtime error", "ERROR: LeakSanitizer")

# test name in test_ring.c -> the shim bug it exposes (see the test's comment for details)
KNOWN_SHIM_BUGS = {
}


class KnownShimBug(Exception):
    """The C test failed a check (no sanitizer report): the expected outcome of a known bug."""


def _compile(out, flags, sources):
    cmd = ["gcc", "-std=gnu11", "-Wall", "-I", SHIM, *flags, *sources, "-pthread", "-o", out]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _asan_unavailable(tmpdir):
    """None if gcc links -fsanitize=address, else the reason (linker output)."""
    src = os.path.join(tmpdir, "asan_probe.c")
    with open(src, "w") as f:
        f.write("#include <stdlib.h>\nint main(void) { char *p = malloc(4); p[0] = 1; free(p); return 0; }\n")
    r = _compile(os.path.join(tmpdir, "asan_probe"), ["-fsanitize=address"], [src])
    if r.returncode == 0:
        return None
    lines = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
    detail = "; ".join(ln for ln in lines if "asan" in ln.lower()) or "; ".join(lines[-3:])
    return "gcc cannot link -fsanitize=address (libasan missing?): " + detail


@pytest.fixture(scope="module", params=sorted(BUILDS), ids=lambda b: b)
def binary(request, tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    build = request.param
    tmpdir = str(tmp_path_factory.mktemp("ring_c_" + build))
    if build == "asan":
        why = _asan_unavailable(tmpdir)
        if why:
            pytest.skip(why)
    sources = [TEST_SRC] + sorted(glob.glob(os.path.join(SHIM, "*.c")))
    exe = os.path.join(tmpdir, "test_ring_" + build)
    r = _compile(exe, BUILDS[build], sources)
    assert r.returncode == 0, "compiling test_ring.c (%s) failed:\n%s%s" % (build, r.stdout, r.stderr)
    return exe


def _run(exe, args):
    env = dict(os.environ)
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:halt_on_error=1")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1")
    try:
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=RUN_TIMEOUT, env=env)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        pytest.fail("test_ring %s: no result within %d s\n%s" % (" ".join(args), RUN_TIMEOUT, out))
    out = p.stdout + p.stderr
    for mark in SANITIZER_MARKS:
        assert mark not in out, "sanitizer report (%s):\n%s" % (mark, out)
    return p.returncode, out


def _all_tests(exe):
    rc, out = _run(exe, ["-l"])
    assert rc == 0, out
    names = out.split()
    assert set(KNOWN_SHIM_BUGS) <= set(names), "KNOWN_SHIM_BUGS names a test test_ring.c does not have"
    return names


def test_ring_c(binary):
    expected = [n for n in _all_tests(binary) if n not in KNOWN_SHIM_BUGS]
    args = []
    for name in sorted(KNOWN_SHIM_BUGS):
        args += ["-x", name]
    rc, out = _run(binary, args)
    print(out)
    assert rc == 0, "test_ring exited with %d:\n%s" % (rc, out)
    for name in expected:
        assert ("ok %s " % name) in out, "test %s did not report ok:\n%s" % (name, out)


# Strict: once a bug is fixed its test XPASSes, which fails the run until the entry is removed.
# (Defined only while there are known bugs, so an empty list adds no "skipped" item.)
if KNOWN_SHIM_BUGS:
    @pytest.mark.xfail(strict=True, raises=KnownShimBug, reason="known shim bug, see KNOWN_SHIM_BUGS")
    @pytest.mark.parametrize("name", sorted(KNOWN_SHIM_BUGS))
    def test_ring_c_known_shim_bug(binary, name):
        rc, out = _run(binary, [name])
        print(out)
        if rc != 0:
            raise KnownShimBug("%s: %s\n%s" % (name, KNOWN_SHIM_BUGS[name], out))
        assert ("ok %s " % name) in out, out
