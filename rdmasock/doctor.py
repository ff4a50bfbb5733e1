"""`rdmasock doctor`: what this installation and this machine can do, and why not.

Each line is checked, not assumed: the build's RDMA support asks the compiled library,
pyverbs is imported, and the preload engine is started for real in a preloaded probe
process (bash's /dev/tcp) whose log line says which Python it embeds and whether it
could load pyverbs there."""
import os
import socket
import subprocess
import sys
import tempfile

from . import _world, config

NO_VERBS_BUILD = ("this build of rdmasock has no RDMA support: <infiniband/verbs.h> was missing when it was "
                  "compiled. Install libibverbs-dev (apt-get install libibverbs-dev) and reinstall rdmasock")
PYVERBS_SYSTEM_DIR = "/usr/lib/python3/dist-packages/pyverbs"


def package_dir():
    return os.path.dirname(os.path.abspath(__file__))


def build_has_verbs():
    """True/False, or the reason the compiled data path cannot be loaded."""
    try:
        from ._native import lib
    except ImportError as exc:
        return "%s: %s (reinstall rdmasock with its dependencies: pip install cffi)" % (type(exc).__name__, exc)
    return bool(lib.rs_rdma_supported())


def pyverbs_advice():
    """How to make pyverbs importable for this interpreter (it is not on the Python index)."""
    if not os.path.isdir(PYVERBS_SYSTEM_DIR):
        return "install Debian's python3-pyverbs and rdma-core (apt-get install python3-pyverbs rdma-core)"
    venv = _world.venv_dir(sys.executable)
    if venv and sys.prefix != sys.base_prefix:
        site_dir = next((p for p in sys.path if p.startswith(sys.prefix) and p.endswith("site-packages")), None)
        if site_dir:
            return ("this venv does not see the system's packages: link pyverbs into it "
                    "(ln -s %s %s/) or recreate the venv with --system-site-packages" % (PYVERBS_SYSTEM_DIR, site_dir))
    return "use an interpreter that sees %s (Debian's /usr/bin/python3)" % os.path.dirname(PYVERBS_SYSTEM_DIR)


def probe_engine(lib_path, timeout=20):
    """Starts the engine in a preloaded bash (connecting to a plain local listener) and
    returns (ok, text): the engine's debug line, or its engine=unavailable reason."""
    bash = "/bin/bash" if os.path.exists("/bin/bash") else None
    if bash is None:
        return None, "not checked (no /bin/bash to run a preloaded probe)"
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="rdmasock-doctor-") as tmp:
        log_file = os.path.join(tmp, "probe.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RDMASOCK_")}
        env.update(LD_PRELOAD=lib_path, RDMASOCK_LOG_FILE=log_file, RDMASOCK_LOG_LEVEL="debug")
        try:
            subprocess.run([bash, "-c", "exec 3<>/dev/tcp/127.0.0.1/%d" % port], env=env, timeout=timeout,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, "the preloaded probe did not finish in %d s" % timeout
        finally:
            srv.close()
        try:
            with open(log_file, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            lines = []
    for line in lines:
        if " engine=unavailable " in line:
            return False, line.split(" reason=", 1)[-1]
    for line in lines:
        if " engine=ready " in line:
            return True, line.split(" engine=ready ", 1)[1]
    return False, "the preloaded probe logged nothing (is %s loadable? try: LD_PRELOAD=%s /bin/true)" % (lib_path, lib_path)


def main(_args=None):
    from . import __version__, devices
    try:
        cfg = config.get()
    except ImportError:                  # the compiled module is broken: said below
        cfg = None
    pkg = package_dir()
    venv = _world.venv_dir(sys.executable)
    print("rdmasock %s in %s" % (__version__, pkg))
    print("python: %s (%s%s)" % (sys.version.split()[0], sys.executable, ", venv " + venv if venv else ""))
    if cfg is not None:
        print("enabled:", "no (RDMASOCK_DISABLE)" if cfg.disabled else "yes", "| transports:", ",".join(cfg.transports))
    verbs = build_has_verbs()
    if isinstance(verbs, str):
        print("shm: NOT usable: the compiled data path cannot be loaded")
        print("build: the compiled data path cannot be loaded: %s" % verbs)
    else:
        from . import transport_shm
        try:
            os.close(transport_shm.create_segment(4096, 1))
            print("shm: usable (memfd + sealing)")
        except OSError as exc:
            print("shm: NOT usable: %s" % exc)
        print("build: %s" % ("RDMA support compiled in" if verbs else "NO RDMA: " + NO_VERBS_BUILD))
    rep = devices.rdma_report()
    pv_ok = rep["pyverbs"]["available"]
    if not pv_ok:
        rep["pyverbs"]["error"] = "NOT importable from %s: %s" % (sys.executable, pyverbs_advice())
    print(devices.format_report(rep, summary=False).rstrip())

    lib = os.path.join(pkg, "librdmasock.so")
    if not os.path.exists(lib):
        print("preload: librdmasock.so missing in %s (reinstall)" % pkg)
        engine_ok, engine_text = False, "no library"
    else:
        print("preload: %s" % lib)
        engine_ok, engine_text = probe_engine(lib)
        print("preload engine: %s" % (("starts: " if engine_ok else "does NOT start: ") + engine_text
                                      if engine_ok is not None else engine_text))

    # One line that answers "will my connections use RDMA?"
    if isinstance(verbs, str):
        why = "the compiled data path cannot be loaded"
    elif not verbs:
        why = NO_VERBS_BUILD
    elif not pv_ok:
        why = "pyverbs is not importable: " + pyverbs_advice()
    elif engine_ok and "pyverbs=no" in engine_text:
        why = "preloaded programs cannot import pyverbs (their engine's Python does not see it): " + pyverbs_advice()
    elif not rep["usable"]:
        why = rep["reason"]
    else:
        why = None
    print("RDMA: %s" % ("usable (%s)" % rep["reason"] if why is None else "not usable: " + why))
    return 0
