"""cffi builder for rdmasock._engine: the Python control plane embedded in preloaded
programs (the C front, shim/preload/, dlopen()s it on first INET stream use).

Nothing of the build machine is compiled in: the front finds the installation at run
time (shim/preload/rs_pyworld.c) and shim/engine/rse_boot.c starts the interpreter from
it.  The engine links libpython without a run path; the front loads the right one first."""
import os
import sysconfig

import cffi

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

API = """
int rse_listen(int fd, int *marker, uintptr_t answer);
void rse_unlisten(int handle, int detach);
int rse_connect_plan(int fd, const void *sa, int salen);
int rse_accept(int lfd, int fd, uintptr_t answer);
int rse_accept_late(int fd);
void rse_drop(int handle, int detach);
void rse_plain(int fd, int reason);
int rse_status(char *why, int whylen);
int rse_step(int handle, int wait_ms, uintptr_t *out);
void rse_release(uintptr_t conn);
void rse_fell_back(int fd, int role, uintptr_t conn);
"""

INIT_PY = r"""
from rdmasock._engine import ffi
try:
    from rdmasock import engine as _engine
    _engine.set_up_preloaded()
    _why = None
except BaseException as _exc:      # reported through rse_status, never on stderr
    _engine = None
    _why = "engine_import_failed: %s: %s" % (type(_exc).__name__, _exc)

def _quiet(exc, val, tb):          # never print into the host program's stderr
    try:
        if _engine is not None:
            _engine.internal_error(exc, val, tb)
    except BaseException:
        pass

@ffi.def_extern(error=0, onerror=_quiet)
def rse_status(why, whylen):
    if _engine is not None:
        return 1
    text = _why.encode("utf-8", "replace")[:max(0, whylen - 1)]
    ffi.memmove(why, text, len(text))
    why[len(text)] = b"\0"
    return 0

@ffi.def_extern(error=0, onerror=_quiet)
def rse_listen(fd, marker, answer):
    return _engine.listen(fd, marker, answer)

@ffi.def_extern(onerror=_quiet)
def rse_unlisten(handle, detach):
    _engine.unlisten(handle, detach)

@ffi.def_extern(error=0, onerror=_quiet)
def rse_connect_plan(fd, sa, salen):
    return _engine.connect_plan(fd, ffi.buffer(sa, salen)[:])

@ffi.def_extern(error=0, onerror=_quiet)
def rse_accept(lfd, fd, answer):
    return _engine.accept(lfd, fd, answer)

@ffi.def_extern(error=0, onerror=_quiet)
def rse_accept_late(fd):
    return _engine.accept_late(fd)

@ffi.def_extern(onerror=_quiet)
def rse_drop(handle, detach):
    _engine.drop(handle, detach)

@ffi.def_extern(onerror=_quiet)
def rse_plain(fd, reason):
    _engine.plain(fd, reason)

@ffi.def_extern(onerror=_quiet)
def rse_release(conn):
    _engine.release(conn)

@ffi.def_extern(onerror=_quiet)
def rse_fell_back(fd, role, conn):
    _engine.fell_back(fd, role, conn)

@ffi.def_extern(error=-71, onerror=_quiet)      # -EPROTO: the connection reports an error
def rse_step(handle, wait_ms, out):
    return _engine.step(handle, wait_ms, out)
"""


def _c_string(text):
    """text as a C string literal."""
    out = []
    for line in text.splitlines(True):
        esc = line.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        out.append('"%s"' % esc)
    return "\n".join(out)


def _source():
    with open(os.path.join(HERE, "_world.py"), encoding="utf-8") as f:
        world = f.read()
    with open(os.path.join(ROOT, "shim", "engine", "rse_boot.c"), encoding="utf-8") as f:
        boot = f.read()
    return "static const char RSE_WORLD_PY[] =\n%s;\n\n%s" % (_c_string(world), boot)


ffibuilder = cffi.FFI()
ffibuilder.embedding_api(API)
ffibuilder.set_source(
    "rdmasock._engine", _source(),
    libraries=["python%s" % sysconfig.get_config_var("VERSION")],     # an embedding library links libpython
    library_dirs=[sysconfig.get_config_var("LIBDIR")],                 # at link time only: no run path
    extra_compile_args=["-O2", "-ffile-prefix-map=%s=." % ROOT],
)
ffibuilder.embedding_init_code(INIT_PY)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
