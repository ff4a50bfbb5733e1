"""RDMA tests: the inner tests of tests/rdma/ run inside the Soft-RoCE VM (one boot for all
of them, scripts/softroce/run.sh), or directly when this host has a usable RDMA device.

Without a usable device the VM is required: if QEMU or the guest kernel is missing these
tests FAIL (run `bash scripts/setup.sh`, which installs them) -- they never skip silently.
RDMASOCK_RDMA_TESTS=vm forces the VM even on a host with a device."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.rdma

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INNER = os.path.join(REPO, "tests", "rdma")
RUN = os.path.join(REPO, "scripts", "softroce", "run.sh")
PY = os.path.join(REPO, ".venv", "bin", "python")


def _inner_cases():
    """The case list of tests/rdma/run_inner.py, which runs them (one list, kept there)."""
    spec = importlib.util.spec_from_file_location("rdma_run_inner", os.path.join(INNER, "run_inner.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.CASES


CASES = _inner_cases()
VM_TIMEOUT = 900


def _vm_missing():
    """Why the VM cannot run here, or None."""
    if not shutil.which("qemu-system-x86_64"):
        return "qemu-system-x86_64 is not installed"
    mods = "/lib/modules"
    kvers = sorted(os.listdir(mods)) if os.path.isdir(mods) else []
    if not any(os.path.exists("/boot/vmlinuz-" + k) for k in kvers):
        return "no guest kernel (/boot/vmlinuz-* with /lib/modules/*; package linux-image-amd64)"
    for k in kvers:
        if os.path.exists(os.path.join(mods, k, "kernel/drivers/infiniband/sw/rxe/rdma_rxe.ko")):
            break
    else:
        return "the installed kernel has no rdma_rxe module"
    try:
        import pyverbs  # noqa: F401
    except ImportError as exc:
        return "pyverbs is not importable (%s; package python3-pyverbs)" % exc
    return None


def _run_suite():
    """Run all inner cases once; returns (results dict or None, log text, error or None)."""
    from rdmasock import doctor
    if doctor.build_has_verbs() is not True:
        return None, "", doctor.NO_VERBS_BUILD
    results = os.path.join(REPO, ".cache", "rdma-results", "run-%d.json" % os.getpid())
    if os.path.exists(results):
        os.unlink(results)
    host_ok, host_why = False, None
    if os.environ.get("RDMASOCK_RDMA_TESTS") != "vm":
        from rdmasock import devices
        host_ok, host_why = devices.usable()
    python = PY if os.path.exists(PY) else sys.executable
    # The C post helper is compiled here on the host (fast) rather than in the slow guest.
    build = subprocess.run([python, os.path.join(INNER, "native_post.py")], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    if build.returncode:
        return None, build.stdout + build.stderr, "cannot build tests/rdma/native_post.py helper"
    if host_ok:
        cmd = [python, os.path.join(INNER, "run_inner.py"), "--mode", "host", "--results", results]
    else:
        missing = _vm_missing()
        if missing:
            return None, "", ("no usable RDMA device on this host (%s) and the Soft-RoCE VM cannot run: %s. "
                              "Run `bash scripts/setup.sh` (it installs the VM prerequisites via "
                              "scripts/softroce/setup.sh)." % (host_why, missing))
        cmd = [RUN, "--topology", "lo,two-hosts", "--timeout", str(VM_TIMEOUT), "--",
               python, os.path.join(INNER, "run_inner.py"), "--mode", "vm", "--results", results]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=VM_TIMEOUT + 300)
    except subprocess.TimeoutExpired as exc:
        return None, str(exc.stdout or ""), "the RDMA test run did not finish in %d s" % (VM_TIMEOUT + 300)
    logtext = "$ %s\n%s%s\n[%s: %.1f s, exit %d]" % (" ".join(cmd), p.stdout, p.stderr,
                                                    "host" if host_ok else "vm", time.monotonic() - t0, p.returncode)
    if not os.path.exists(results):
        return None, logtext, "the inner test runner wrote no results (exit %d)" % p.returncode
    with open(results) as f:
        res = json.load(f)
    os.unlink(results)
    res["wall_seconds"] = round(time.monotonic() - t0, 1)
    return res, logtext, None


@pytest.fixture(scope="module")
def suite():
    return _run_suite()


@pytest.mark.parametrize("case", CASES)
def test_inner(suite, case):
    res, logtext, err = suite
    if err:
        pytest.fail("%s\n%s" % (err, logtext[-4000:]))
    r = res["cases"].get(case)
    assert r is not None, "case %s did not run\n%s" % (case, logtext[-4000:])
    if r["ok"] is None:
        pytest.skip("host mode (this host has an RDMA device): %s" % r["skipped"])
    assert r["ok"], "inner test %s failed:\n%s" % (case, r["output"])
