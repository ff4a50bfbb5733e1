/* rse_boot.c - starts the embedded interpreter of rdmasock._engine (compiled into it by
 * rdmasock/_build_engine.py; RSE_WORLD_PY is rdmasock/_world.py as a C string).
 *
 * The front (shim/preload/rs_bridge.c) has found the installation the package belongs to
 * (rs_pyworld.c) and passes its interpreter `exe` and the package's directory `root`.
 * Rules: the host's PYTHON* variables, argv, signals and C stdio are not ours to touch;
 * nothing is ever printed to the host's stdout/stderr; every failure becomes one reason
 * string for the log.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>

static PyGILState_STATE rse_fork_gil;
static int rse_fork_held;
static int rse_own;                  /* we started the interpreter: no Python of the host's runs */
static int rse_child_due;            /* this is a fork's child, and Python's after-fork work waits */
static pthread_t rse_child_thread;   /* ... for the thread that forked, which holds the GIL */
static PyObject *rse_gc_freeze, *rse_gc_unfreeze;   /* gc.freeze, gc.unfreeze where rse_own */

/* Where the interpreter is ours, its objects are frozen across a fork (gc.freeze): the
 * child's collector never walks them, so a collection in a forked child (a PostgreSQL
 * backend's handshake) writes no header of an object it shares with its parent.  The
 * parent thaws them at once, so its own garbage is still collected. */
static void rse_gc_call(PyObject *fn)
{
    if (!fn) return;
    PyObject *r = PyObject_CallNoArgs(fn);
    if (r) Py_DECREF(r);
    else PyErr_Clear();
}

/* A C-level fork() in a host whose interpreter we started (os.fork handles itself). */
static void rse_fork_prepare(void)
{
    if (!Py_IsInitialized() || PyGILState_Check()) return;
    rse_fork_gil = PyGILState_Ensure();
    if (rse_own) rse_gc_call(rse_gc_freeze);
    PyOS_BeforeFork();
    rse_fork_held = 1;
}
static void rse_fork_parent(void)
{
    if (!rse_fork_held) return;
    rse_fork_held = 0;
    PyOS_AfterFork_Parent();
    if (rse_own) rse_gc_call(rse_gc_unfreeze);
    PyGILState_Release(rse_fork_gil);
}
/* Python's after-fork work (its own state, then the modules' callbacks: threading's and
 * others) writes pages of the interpreter that the child would otherwise keep sharing
 * with its parent, about 0.6 MiB.  Where no Python but ours runs, it waits for the
 * child's first use of the engine (rse_fork_settle), so a child that never upgrades a
 * socket (PostgreSQL's background processes, a shell's commands) never copies them. */
static void rse_fork_child(void)
{
    if (!rse_fork_held) return;
    rse_fork_held = 0;
    if (rse_own) {
        rse_child_thread = pthread_self();
        __atomic_store_n(&rse_child_due, 1, __ATOMIC_RELEASE);
        return;
    }
    PyOS_AfterFork_Child();
    PyGILState_Release(rse_fork_gil);
}

/* Called before every entry into the engine, and before the process starts a thread:
 * 0 when this thread may enter.  In a child whose after-fork work is still due, only the
 * thread that forked can do it (it holds the GIL, and Python's state says it is the one
 * thread left); any other thread gets -1 and its socket stays on TCP.  The front does it
 * before its own process starts a second thread, so that is rare. */
__attribute__((visibility("default"))) int rse_fork_pending(void)
{
    return __atomic_load_n(&rse_child_due, __ATOMIC_ACQUIRE);
}

__attribute__((visibility("default"))) int rse_fork_settle(void)
{
    if (!__atomic_load_n(&rse_child_due, __ATOMIC_ACQUIRE)) return 0;
    if (!pthread_equal(pthread_self(), rse_child_thread)) return -1;
    PyOS_AfterFork_Child();
    PyGILState_Release(rse_fork_gil);
    __atomic_store_n(&rse_child_due, 0, __ATOMIC_RELEASE);
    return 0;
}

/* The pending exception as one line ("Type: message"), cleared. */
static void exc_text(char *out, int outlen)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    PyObject *s = v ? PyObject_Str(v) : NULL;
    const char *msg = s ? PyUnicode_AsUTF8(s) : NULL;
    const char *name = t ? ((PyTypeObject *)t)->tp_name : "error";
    snprintf(out, outlen, "%s: %s", name, msg ? msg : "?");
    for (char *p = out; *p; p++)
        if (*p == '\n' || *p == '\r') *p = ' ';
    Py_XDECREF(s);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
    PyErr_Clear();
}

static int start_interpreter(const char *exe, char *why, int whylen)
{
    PyConfig c;
    PyConfig_InitIsolatedConfig(&c);
    c.isolated = 0;                 /* isolated would forbid the user site of a --user install */
    c.use_environment = 0;          /* the host's PYTHONPATH/PYTHONHOME are not ours */
    c.user_site_directory = 0;
    c.safe_path = 1;
    c.site_import = 0;              /* _world.enter() runs site with stdio silenced first */
    c.install_signal_handlers = 0;
    c.configure_c_stdio = 0;
    c.parse_argv = 0;
    c.pathconfig_warnings = 0;
    c.write_bytecode = 0;           /* never write into an installation that is not ours */
    c.buffered_stdio = 1;
    /* Python works out its prefix, a venv and the standard library from its executable. */
    PyStatus st = PyConfig_SetBytesString(&c, &c.executable, exe);
    if (!PyStatus_Exception(st)) st = PyConfig_SetBytesString(&c, &c.program_name, exe);
    if (!PyStatus_Exception(st)) st = Py_InitializeFromConfig(&c);
    PyConfig_Clear(&c);
    if (PyStatus_Exception(st)) {
        snprintf(why, whylen, "python_init_failed: %s (executable %s)", st.err_msg ? st.err_msg : "?", exe);
        return -1;
    }
    PyEval_SaveThread();            /* every callback takes the GIL itself */
    pthread_atfork(rse_fork_prepare, rse_fork_parent, rse_fork_child);
    return 0;
}

/* Runs rdmasock/_world.py's enter(exe, root, own).  Caller holds the GIL. */
static int enter_world(const char *exe, const char *root, int own, char *why, int whylen)
{
    PyObject *globals = PyDict_New(), *name = PyUnicode_FromString("rdmasock._world"), *r = NULL;
    if (globals && name && PyDict_SetItemString(globals, "__builtins__", PyEval_GetBuiltins()) == 0 &&
        PyDict_SetItemString(globals, "__name__", name) == 0)
        r = PyRun_String(RSE_WORLD_PY, Py_file_input, globals, globals);
    Py_XDECREF(name);
    if (r) {
        Py_DECREF(r);
        PyObject *enter = PyDict_GetItemString(globals, "enter");
        r = enter ? PyObject_CallFunction(enter, "ssi", exe, root, own) : NULL;
    }
    Py_XDECREF(globals);
    if (r) { Py_DECREF(r); return 0; }
    char text[1536];
    exc_text(text, sizeof text);
    snprintf(why, whylen, "engine_import_failed: %s", text);
    return -1;
}

/* sys.stderr swapped for a capture while cffi sets the engine up: its failure report would
 * go to the host's stderr otherwise.  Caller holds the GIL. */
static PyObject *swap_stderr(PyObject *to)
{
    PyObject *old = PySys_GetObject("stderr");
    Py_XINCREF(old);
    PySys_SetObject("stderr", to);
    return old;
}

/* cffi's start-up (cffi_start_python) takes a spin lock made of PyCapsule_Type's
 * tp_version_tag on Pythons 3.8 to 3.11: it waits for the tag to be 0.  The tag stays 0
 * only until something looks up an attribute of a capsule through the method cache
 * (mock, inspect, dir() over a module with a C API capsule: asyncio's own tests do), and
 * then cffi spins forever, at the program's first socket.  So the tag is cleared for
 * cffi's start-up, with the GIL held, and put back after: meanwhile a lookup only misses
 * the method cache.  Compare-and-swap, both ways: another cffi module starting at the same
 * time holds the lock with its own value, which must not be overwritten. */
#if PY_VERSION_HEX >= 0x03080000 && PY_VERSION_HEX < 0x030C0000
static unsigned int capsule_tag_clear(void)
{
    unsigned int tag = __atomic_load_n(&PyCapsule_Type.tp_version_tag, __ATOMIC_ACQUIRE);
    if (tag == 0 || tag == (unsigned int)-42) return 0;           /* -42: cffi's own lock value */
    return __atomic_compare_exchange_n(&PyCapsule_Type.tp_version_tag, &tag, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)
               ? tag : 0;
}
static void capsule_tag_restore(unsigned int tag)
{
    unsigned int zero = 0;
    if (tag) __atomic_compare_exchange_n(&PyCapsule_Type.tp_version_tag, &zero, tag, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
}
#else
static unsigned int capsule_tag_clear(void) { return 0; }
static void capsule_tag_restore(unsigned int tag) { (void)tag; }
#endif

__attribute__((visibility("default"))) int rse_boot(const char *exe, const char *root, char *why, int whylen)
{
    char want[16];
    snprintf(want, sizeof want, "%d.%d.", PY_MAJOR_VERSION, PY_MINOR_VERSION);
    if (strncmp(Py_GetVersion(), want, strlen(want))) {
        snprintf(why, whylen, "python_version_mismatch: the program runs Python %.16s, rdmasock was built for %d.%d",
                 Py_GetVersion(), PY_MAJOR_VERSION, PY_MINOR_VERSION);
        return -1;
    }
    int own = !Py_IsInitialized();
    if (own && start_interpreter(exe, why, whylen) < 0) return -1;
    rse_own = own;

    PyGILState_STATE g = PyGILState_Ensure();
    int rc = enter_world(exe, root, own, why, whylen);
    if (rc == 0 && own) {
        PyObject *gc = PyImport_ImportModule("gc");
        rse_gc_freeze = gc ? PyObject_GetAttrString(gc, "freeze") : NULL;
        rse_gc_unfreeze = gc ? PyObject_GetAttrString(gc, "unfreeze") : NULL;
        Py_XDECREF(gc);
        if (!rse_gc_freeze || !rse_gc_unfreeze) {
            Py_CLEAR(rse_gc_freeze);
            Py_CLEAR(rse_gc_unfreeze);
            PyErr_Clear();
        }
    }
    PyObject *io = rc == 0 ? PyImport_ImportModule("io") : NULL;
    PyObject *capture = io ? PyObject_CallMethod(io, "StringIO", NULL) : NULL;
    Py_XDECREF(io);
    PyObject *saved = NULL;
    if (rc == 0 && !capture) {
        exc_text(why, whylen);
        rc = -1;
    }
    if (rc == 0) saved = swap_stderr(capture);
    unsigned int capsule_tag = rc == 0 ? capsule_tag_clear() : 0;
    PyGILState_Release(g);
    if (rc < 0) return -1;

    int started = cffi_start_python();

    g = PyGILState_Ensure();
    capsule_tag_restore(capsule_tag);
    swap_stderr(saved);
    Py_XDECREF(saved);
    if (started != 0) {
        PyObject *text = PyObject_CallMethod(capture, "getvalue", NULL);
        const char *t = text ? PyUnicode_AsUTF8(text) : NULL;
        /* cffi's report ends "...\nError: message\n\nFrom: ...": keep the error line. */
        char line[1024] = "?";
        if (t) {
            const char *end = strstr(t, "\n\nFrom:");
            const char *stop = end ? end : t + strlen(t);
            const char *start = stop;
            while (start > t && start[-1] != '\n') start--;
            snprintf(line, sizeof line, "%.*s", (int)(stop - start), start);
        }
        snprintf(why, whylen, "engine_import_failed: %s", line);
        Py_XDECREF(text);
        PyErr_Clear();
    }
    Py_XDECREF(capture);
    PyGILState_Release(g);
    return started != 0 ? -1 : 0;
}
