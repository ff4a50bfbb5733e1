"""Builds of the preload library for the C tests: as installed, and with AddressSanitizer
(+UBSan) or ThreadSanitizer.  A sanitized library lives in a package directory of its
own, beside links to the built package's other files, so that it finds the engine and
the package as an installed one would (shim/preload/rs_pyworld.c)."""
import glob
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PKG = os.path.join(ROOT, "rdmasock")
FLAGS = {
    "plain": [],
    "asan": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"],
    "tsan": ["-fsanitize=thread"],
}
RUNTIME = {"asan": "libasan.so", "tsan": "libtsan.so"}
ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=66",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=66",
    "TSAN_OPTIONS": "exitcode=66:report_signal_unsafe=0:second_deadlock_stack=1:suppressions="
                    + os.path.join(HERE, "c", "tsan.supp"),
}


def _engine_file():
    engines = glob.glob(os.path.join(PKG, "_engine*.so"))
    assert engines, "rdmasock._engine is not built (run scripts/setup.sh)"
    return os.path.basename(engines[0])


def library(variant, where):
    """Builds the preload library `variant` under directory `where`; returns the value
    for LD_PRELOAD (the sanitizer's runtime first, as it must be)."""
    pkg = os.path.join(where, variant, "rdmasock")
    os.makedirs(pkg, exist_ok=True)
    for f in os.listdir(PKG):
        if f != "librdmasock.so" and not f.startswith("__pycache__") and not os.path.exists(os.path.join(pkg, f)):
            os.symlink(os.path.join(PKG, f), os.path.join(pkg, f))
    lib = os.path.join(pkg, "librdmasock.so")
    if variant == "plain":
        shutil.copy(os.path.join(PKG, "librdmasock.so"), lib)
        return lib
    sources = sorted(glob.glob(os.path.join(ROOT, "shim", "preload", "*.c"))) + \
        sorted(glob.glob(os.path.join(ROOT, "shim", "rs_*.c")))
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-g", "-std=gnu11", "-fvisibility=hidden", *FLAGS[variant],
                    "-I", os.path.join(ROOT, "shim"), '-DRS_PY_VERSION="%d.%d"' % sys.version_info[:2],
                    '-DRS_ENGINE_FILE="%s"' % _engine_file(), *sources, "-o", lib, "-ldl", "-lpthread"],
                   check=True, timeout=300, capture_output=True)
    rt = subprocess.run(["gcc", "-print-file-name=" + RUNTIME[variant]], capture_output=True, text=True).stdout.strip()
    return rt + ":" + lib


def program(variant, src, out, extra=()):
    subprocess.run(["gcc", "-O1", "-g", "-std=gnu11", *FLAGS[variant], src, "-o", out, "-lpthread", *extra],
                   check=True, timeout=120, capture_output=True)
    return out


def report_problems(stderr):
    """Sanitizer findings in a program's stderr."""
    return [marker for marker in ("ERROR: AddressSanitizer", "runtime error", "WARNING: ThreadSanitizer")
            if marker in stderr]
