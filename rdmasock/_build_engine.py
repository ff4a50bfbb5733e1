"""cffi builder for rdmasock._engine: the Python control plane embedded in preloaded
programs (the C front, shim/preload/, dlopen()s it on first INET stream use).

It starts the interpreter itself (isolated, baked paths: the host's PYTHONPATH/HOME
must not matter), refuses a host that is another CPython version, registers fork
handlers, and never lets a Python exception reach the host's stderr."""
import os
import sys
import sysconfig

import cffi

API = """
int rse_listen(int fd);
void rse_unlisten(int fd);
int rse_connect_plan(int fd, const void *sa, int salen);
void rse_hello(int handle);
int rse_accept(int lfd, int fd);
void rse_drop(int handle);
void rse_plain(int fd, int reason);
int rse_ready(void);
int rse_step(int handle, int wait_ms, uintptr_t *out);
void rse_release(uintptr_t conn);
void rse_fell_back(int fd, int role, uintptr_t conn);
"""

BOOT_C = r"""
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>

static PyGILState_STATE rse_fork_gil;
static int rse_fork_held;

/* A C-level fork() in a host whose interpreter we started (os.fork handles itself). */
static void rse_fork_prepare(void)
{
    if (!Py_IsInitialized() || PyGILState_Check()) return;
    rse_fork_gil = PyGILState_Ensure();
    PyOS_BeforeFork();
    rse_fork_held = 1;
}
static void rse_fork_parent(void)
{
    if (!rse_fork_held) return;
    rse_fork_held = 0;
    PyOS_AfterFork_Parent();
    PyGILState_Release(rse_fork_gil);
}
static void rse_fork_child(void)
{
    if (!rse_fork_held) return;
    rse_fork_held = 0;
    PyOS_AfterFork_Child();
    PyGILState_Release(rse_fork_gil);
}

__attribute__((visibility("default"))) int rse_boot(char *why, int whylen)
{
    char want[16];
    snprintf(want, sizeof want, "%d.%d.", PY_MAJOR_VERSION, PY_MINOR_VERSION);
    if (strncmp(Py_GetVersion(), want, strlen(want))) {
        snprintf(why, whylen, "python_version_mismatch");
        return -1;
    }
    if (!Py_IsInitialized()) {
        PyConfig c;
        PyConfig_InitIsolatedConfig(&c);
        c.install_signal_handlers = 0;
        c.configure_c_stdio = 0;
        c.parse_argv = 0;
        c.site_import = 0;
        c.pathconfig_warnings = 0;
        c.buffered_stdio = 1;
        c.module_search_paths_set = 1;
        char *paths = strdup(RSE_PATH), *save = NULL;
        for (char *t = paths ? strtok_r(paths, ":", &save) : NULL; t; t = strtok_r(NULL, ":", &save)) {
            wchar_t *w = Py_DecodeLocale(t, NULL);
            if (w) { PyWideStringList_Append(&c.module_search_paths, w); PyMem_RawFree(w); }
        }
        free(paths);
        PyConfig_SetBytesString(&c, &c.home, RSE_HOME);
        PyConfig_SetBytesString(&c, &c.program_name, RSE_EXE);
        PyStatus st = Py_InitializeFromConfig(&c);
        PyConfig_Clear(&c);
        if (PyStatus_Exception(st)) {
            snprintf(why, whylen, "python_init_failed");
            return -1;
        }
        PyEval_SaveThread();        /* every callback takes the GIL itself */
        pthread_atfork(rse_fork_prepare, rse_fork_parent, rse_fork_child);
    }
    if (cffi_start_python() != 0) {
        snprintf(why, whylen, "engine_import_failed");
        return -1;
    }
    return 0;
}
"""

INIT_PY = r"""
import sys
from rdmasock._engine import ffi
for p in RSE_SYS_PATH:
    if p not in sys.path:
        sys.path.append(p)
try:
    from rdmasock import engine as _engine
except BaseException as _exc:      # reported as reason engine_import_failed, never on stderr
    _engine = None
    _import_error = _exc

def _quiet(exc, val, tb):          # never print into the host program's stderr
    if _engine is not None:
        _engine.internal_error(exc, val, tb)

@ffi.def_extern(error=0, onerror=_quiet)
def rse_ready():
    return 1 if _engine is not None else 0

@ffi.def_extern(error=0, onerror=_quiet)
def rse_listen(fd):
    return _engine.listen(fd)

@ffi.def_extern(onerror=_quiet)
def rse_unlisten(fd):
    _engine.unlisten(fd)

@ffi.def_extern(error=0, onerror=_quiet)
def rse_connect_plan(fd, sa, salen):
    return _engine.connect_plan(fd, ffi.buffer(sa, salen)[:])

@ffi.def_extern(onerror=_quiet)
def rse_hello(handle):
    _engine.hello(handle)

@ffi.def_extern(error=0, onerror=_quiet)
def rse_accept(lfd, fd):
    return _engine.accept(lfd, fd)

@ffi.def_extern(onerror=_quiet)
def rse_drop(handle):
    _engine.drop(handle)

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

# Paths baked in: the project (for an editable install) and the build Python's own.
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = [p for p in sys.path if p and os.path.isdir(p) and "pip" + os.sep + "_vendor" not in p and "pip-build-env" not in p]
if HERE not in PATHS:
    PATHS.insert(0, HERE)

ffibuilder = cffi.FFI()
ffibuilder.embedding_api(API)
ffibuilder.set_source(
    "rdmasock._engine", BOOT_C,
    define_macros=[("RSE_PATH", '"%s"' % ":".join(PATHS)), ("RSE_HOME", '"%s"' % sys.base_prefix),
                   ("RSE_EXE", '"%s"' % sys.executable)],
    libraries=["python%d.%d" % sys.version_info[:2]],      # an embedding library links libpython
    library_dirs=[sysconfig.get_config_var("LIBDIR")],
    extra_link_args=["-Wl,-rpath," + sysconfig.get_config_var("LIBDIR")],
    extra_compile_args=["-O2"],
)
ffibuilder.embedding_init_code(INIT_PY.replace("RSE_SYS_PATH", repr(PATHS)))

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
