/* rs_bridge.c - loads the Python engine (control plane) on first need and calls it.
 *
 * The engine is a separate library (rdmasock/_engine*.so, built by cffi) so a process
 * that never uses an INET stream socket never loads libpython.  Every call into it runs
 * with rs_in_engine set: the engine's own socket calls then pass straight through our
 * hooks, and errno is preserved for the application.
 */
#include "rs_preload.h"
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/syscall.h>
#include <unistd.h>

__thread int rs_in_engine;

static struct {
    int (*boot)(const char *exe, const char *root, char *why, int whylen);
    int (*status)(char *why, int whylen);
    int (*listen)(int, int *, uintptr_t);   /* a listener's handle, its rendezvous name's descriptor, and
                                             * the template of its accepted sockets (struct rs_answer) */
    void (*unlisten)(int, int);
    int (*connect_plan)(int, const void *, int);
    int (*accept)(int, int, uintptr_t);  /* and how the HELLO may be answered in C (struct rs_answer) */
    int (*accept_late)(int);             /* on a duplicate the engine owns */
    void (*drop)(int, int);              /* a handshake nobody finishes; 1: its descriptor is closed already */
    void (*plain)(int, int);
    int (*step)(int, int, uintptr_t *);  /* out[0] conn, out[1] reason code */
    void (*release)(uintptr_t);          /* before rs_conn_free of an rdma connection */
    void (*fell_back)(int, int, uintptr_t);   /* an rdma connection went on over TCP (log) */
    int (*fork_settle)(void);            /* 0: this thread may enter (rse_boot.c) */
    int (*fork_pending)(void);           /* 1: a fork's child that has not entered yet */
} eng;
static int eng_state;            /* 0 not tried, 1 ready, -1 unusable */
static pthread_mutex_t eng_lock = PTHREAD_MUTEX_INITIALIZER;
static struct rs_pyworld world;  /* large: not on a hooked call's stack */

/* A line straight to the log file the user asked for (never stdout/stderr), where the
 * engine cannot write it: it is unusable, the caller may not enter it (a vfork child), or
 * the work was done without it (rs_answer.c).  The time is local, as the engine writes it. */
static char log_path[PATH_MAX];
static int log_path_kept;

/* The engine reads its configuration once, when it loads; so does this file: a program
 * may clear its environment later (nginx's workers), and both write to the same log. */
static void keep_log_path(void)
{
    snprintf(log_path, sizeof log_path, "%s", rs_config_get(RS_CFG_LOG_FILE));
    __atomic_store_n(&log_path_kept, 1, __ATOMIC_RELEASE);
}

void rs_log_direct(const char *text)
{
    const char *path = __atomic_load_n(&log_path_kept, __ATOMIC_ACQUIRE) ? log_path : rs_config_get(RS_CFG_LOG_FILE);
    if (!*path) return;
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY, 0600);
    if (fd < 0) return;
    char line[4096];
    time_t t = time(NULL);
    struct tm tm;
    localtime_r(&t, &tm);
    int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d pid=%d %s\n",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, (int)getpid(), text);
    if (n >= (int)sizeof line) { line[sizeof line - 2] = '\n'; n = (int)sizeof line - 1; }
    if (n > 0) { ssize_t w = rs_real.write(fd, line, (size_t)n); (void)w; }
    rs_real.close(fd);
}

static void log_unusable(const char *why)
{
    char text[3072];
    snprintf(text, sizeof text, "engine=unavailable transport=tcp reason=%s", why);
    rs_log_direct(text);
}

static int env_true(int key)
{
    const char *v = rs_config_get(key);
    return !strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes") || !strcasecmp(v, "on");
}

/* Under eng_lock.  1 when the engine is usable. */
static int engine_load(void)
{
    static char why[2048];
    if (env_true(RS_CFG_DISABLE)) return 0;                 /* never start Python */
    /* A Python host of another minor version cannot share its interpreter with ours. */
    const char *(*host_version)(void) = (const char *(*)(void))dlsym(RTLD_DEFAULT, "Py_GetVersion");
    if (host_version && strncmp(host_version(), RS_PY_VERSION ".", strlen(RS_PY_VERSION) + 1)) {
        snprintf(why, sizeof why, "python_version_mismatch: the program runs Python %.16s, rdmasock was built for %s",
                 host_version(), RS_PY_VERSION);
        log_unusable(why);
        return 0;
    }
    if (rs_pyworld_find(&world, why, sizeof why)) { log_unusable(why); return 0; }
    /* A host that is not Python gets the installation's libpython, found at run time. */
    if (!host_version && !dlopen(world.libpython, RTLD_NOW | RTLD_GLOBAL)) {
        snprintf(why, sizeof why, "engine_not_loadable: %.1000s (the interpreter %.900s needs it)", dlerror(), world.exe);
        log_unusable(why);
        return 0;
    }
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/%s", world.pkgdir, RS_ENGINE_FILE);
    void *h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        snprintf(why, sizeof why, "engine_not_loadable: %s", dlerror());
        log_unusable(why);
        return 0;
    }
#define SYM(field, name) *(void **)&eng.field = dlsym(h, name)
    SYM(boot, "rse_boot"); SYM(status, "rse_status"); SYM(listen, "rse_listen"); SYM(unlisten, "rse_unlisten");
    SYM(connect_plan, "rse_connect_plan"); SYM(accept, "rse_accept");
    SYM(accept_late, "rse_accept_late");
    SYM(drop, "rse_drop"); SYM(step, "rse_step"); SYM(plain, "rse_plain");
    SYM(release, "rse_release"); SYM(fell_back, "rse_fell_back"); SYM(fork_settle, "rse_fork_settle");
    SYM(fork_pending, "rse_fork_pending");
    if (!eng.boot || !eng.status || !eng.listen || !eng.unlisten || !eng.connect_plan || !eng.accept ||
        !eng.accept_late ||
        !eng.drop || !eng.step || !eng.plain || !eng.release || !eng.fell_back || !eng.fork_settle ||
        !eng.fork_pending) {
        snprintf(why, sizeof why, "engine_incomplete: %.1900s lacks an rse_* entry point (a mismatched build)", path);
        log_unusable(why);
        return 0;
    }
    if (eng.boot(world.exe, world.root, why, sizeof why) != 0) { log_unusable(why); return 0; }
    if (!eng.status(why, sizeof why)) { log_unusable(why); return 0; }
    return 1;
}

static void *engine_load_thread(void *arg)
{
    rs_in_engine = 1;
    *(int *)arg = engine_load();
    return NULL;
}

/* Under eng_lock.  In a program that is not Python, the engine starts in a thread of its
 * own: glibc gives that thread its own malloc arena, so the interpreter's long-lived
 * objects stay out of the program's heap.  A forking server's children then allocate
 * among their own heap pages, not into free chunks between the interpreter's, which
 * would copy those shared pages into each child (PostgreSQL backends: ~0.4 MiB each). */
static int engine_load_apart(void)
{
    if (dlsym(RTLD_DEFAULT, "Py_GetVersion")) return engine_load();   /* a Python host: its GIL, its thread */
    pthread_t t;
    int ok = 0;
    if (pthread_create(&t, NULL, engine_load_thread, &ok) != 0) return engine_load();
    pthread_join(t, NULL);
    return ok;
}

static int host_holds_gil(void)
{
    int (*initialized)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "Py_IsInitialized");
    int (*holds)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
    return initialized && holds && initialized() && holds();
}

/* Listeners' rendezvous names (handle -> descriptor).  Every forked child closes the
 * listeners it inherited (a PostgreSQL postmaster's children do at once): one that has not
 * entered the engine (rse_fork_settle) closes its copy of the name here, without Python,
 * and the engine only forgets the handle if the child enters it later.  Where an entry
 * does not fit, the child enters the engine for that close, as before. */
#define MAX_NAMES 64
static struct { int handle, fd, closed; } names[MAX_NAMES];
static pthread_mutex_t names_lock = PTHREAD_MUTEX_INITIALIZER;
static int names_closed;            /* entries closed by a child, for the engine to forget */

static void name_note(int handle, int fd)
{
    pthread_mutex_lock(&names_lock);
    for (int i = 0; i < MAX_NAMES; i++)
        if (!names[i].handle) { names[i].handle = handle; names[i].fd = fd; names[i].closed = 0; break; }
    pthread_mutex_unlock(&names_lock);
}

/* 1 if the name of `handle` was closed here (a child that has not entered the engine). */
static int name_close_in_child(int handle)
{
    int done = 0;
    pthread_mutex_lock(&names_lock);
    for (int i = 0; i < MAX_NAMES && !done; i++)
        if (names[i].handle == handle && !names[i].closed) {
            rs_syscall(SYS_close, names[i].fd);
            names[i].closed = 1;
            __atomic_store_n(&names_closed, 1, __ATOMIC_RELEASE);
            done = 1;
        }
    pthread_mutex_unlock(&names_lock);
    return done;
}

static void name_forget(int handle)
{
    pthread_mutex_lock(&names_lock);
    for (int i = 0; i < MAX_NAMES; i++)
        if (names[i].handle == handle) names[i].handle = 0;
    pthread_mutex_unlock(&names_lock);
}

/* Handshakes answered in C (rs_answer.c): their descriptors are closed already, and the
 * engine forgets them at its next entry, so a forked child that never enters it never
 * has to.  Where an entry does not fit, the engine forgets it at once. */
#define MAX_ANSWERED 64
static int answered[MAX_ANSWERED];
static pthread_mutex_t answered_lock = PTHREAD_MUTEX_INITIALIZER;
static int answered_any;

static int answered_note(int handle)
{
    int done = 0;
    pthread_mutex_lock(&answered_lock);
    for (int i = 0; i < MAX_ANSWERED && !done; i++)
        if (!answered[i]) { answered[i] = handle; done = 1; }
    if (done) __atomic_store_n(&answered_any, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&answered_lock);
    return done;
}

/* The engine may be entered from this thread (rse_boot.c: rse_fork_settle).  Names a child
 * closed before, and handshakes answered in C, are forgotten by the engine now (their
 * descriptors are closed already). */
static int fork_settled(void)
{
    int e = errno, was = rs_in_engine;
    rs_in_engine = 1;
    int r = eng.fork_settle();
    if (r == 0 && __atomic_load_n(&names_closed, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&names_lock);
        __atomic_store_n(&names_closed, 0, __ATOMIC_RELAXED);
        for (int i = 0; i < MAX_NAMES; i++)
            if (names[i].handle && names[i].closed) { eng.unlisten(names[i].handle, 1); names[i].handle = 0; }
        pthread_mutex_unlock(&names_lock);
    }
    if (r == 0 && __atomic_load_n(&answered_any, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&answered_lock);
        __atomic_store_n(&answered_any, 0, __ATOMIC_RELAXED);
        for (int i = 0; i < MAX_ANSWERED; i++)
            if (answered[i]) { eng.drop(answered[i], 1); answered[i] = 0; }
        pthread_mutex_unlock(&answered_lock);
    }
    rs_in_engine = was;
    errno = e;
    return r == 0;
}

int rs_engine_ready(void)
{
    int s = __atomic_load_n(&eng_state, __ATOMIC_ACQUIRE);
    if (s) return s > 0 && fork_settled();
    if (rs_in_engine) return 0;
    int e = errno;
    rs_in_engine = 1;
    if (pthread_mutex_trylock(&eng_lock)) {
        /* Another thread is loading the engine.  In a Python host that load needs the
         * GIL: a caller holding it (a C extension that does not release it around the
         * call) gets plain TCP for this socket rather than a deadlock. */
        if (host_holds_gil()) { rs_in_engine = 0; errno = e; return 0; }
        pthread_mutex_lock(&eng_lock);
    }
    /* Other threads read eng_state without the lock: it changes once, from 0 to the
     * outcome (a thread that sees 0 waits here for the load to end). */
    if (!eng_state) {
        keep_log_path();
        __atomic_store_n(&eng_state, engine_load_apart() ? 1 : -1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&eng_lock);
    rs_in_engine = 0;
    errno = e;
    return eng_state > 0 && fork_settled();
}

int rs_engine_loaded(void) { return __atomic_load_n(&eng_state, __ATOMIC_ACQUIRE) > 0 && fork_settled(); }

/* A forked child's deferred after-fork work (rse_fork_settle) is done by the thread that
 * forked, before it starts another: after that, any thread may enter the engine. */
RS_EXPORT int pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*fn)(void *), void *arg)
{
    static int (*real)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "pthread_create");
    if (!real) return EAGAIN;
    if (!rs_in_engine) rs_engine_loaded();
    return real(t, attr, fn, arg);
}

#define CALL(expr) do { int e_ = errno; rs_in_engine = 1; expr; rs_in_engine = 0; errno = e_; } while (0)

int rs_br_listen(int fd, struct rs_answer *tpl)
{
    int r = 0, name = -1;
    if (rs_engine_ready()) CALL(r = eng.listen(fd, &name, (uintptr_t)tpl));
    if (r > 0 && name >= 0) name_note(r, name);
    return r;
}
int rs_br_connect_plan(int fd, const struct sockaddr *sa, socklen_t len)
{
    int r = 0;
    if (rs_engine_ready()) CALL(r = eng.connect_plan(fd, sa, (int)len));
    return r;
}
int rs_br_accept(int lfd, int fd, struct rs_answer *answer)
{
    int r = 0;
    if (rs_engine_ready()) CALL(r = eng.accept(lfd, fd, (uintptr_t)answer));
    return r;
}
void rs_br_drop(int handle) { if (rs_engine_loaded()) CALL(eng.drop(handle, 0)); }
void rs_br_plain(int fd, int reason) { if (rs_engine_loaded()) CALL(eng.plain(fd, reason)); }

/* ---- what the socket object (shim/rs_sock.c) asks of this host ---------------------- */

static int host_step(int handle, int wait_ms, uintptr_t *out)
{
    if (!rs_engine_loaded()) return RS_STEP_TCP;
    int r;
    CALL(r = eng.step(handle, wait_ms, out));
    return r;
}
void rs_br_unlisten(int handle)
{
    if (__atomic_load_n(&eng_state, __ATOMIC_ACQUIRE) <= 0) return;
    if (eng.fork_pending() && name_close_in_child(handle)) return;
    name_forget(handle);
    if (rs_engine_loaded()) CALL(eng.unlisten(handle, 0));
}
static void host_release(rs_conn *c) { if (rs_engine_loaded()) CALL(eng.release((uintptr_t)c)); }
static void host_fell_back(int fd, int role, rs_conn *c)
{
    if (rs_engine_loaded()) CALL(eng.fell_back(fd, role, (uintptr_t)c));
}

/* "ip:port" or "[ip6]:port", as the engine writes addresses; "-" if unknown. */
static void addr_text(const struct sockaddr_storage *sa, socklen_t len, char *out, size_t n)
{
    char host[NI_MAXHOST], port[NI_MAXSERV];
    if (getnameinfo((const struct sockaddr *)sa, len, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV)) { snprintf(out, n, "-"); return; }
    snprintf(out, n, sa->ss_family == AF_INET6 ? "[%s]:%s" : "%s:%s", host, port);
}

void rs_log_connection(int fd, const char *role, const char *what)
{
    struct sockaddr_storage l, p;
    socklen_t ll = sizeof l, pl = sizeof p;
    char local[NI_MAXHOST + 16] = "-", peer[NI_MAXHOST + 16] = "-", text[2 * NI_MAXHOST + 256];
    if (rs_syscall(SYS_getsockname, fd, &l, &ll) == 0) addr_text(&l, ll, local, sizeof local);
    if (rs_syscall(SYS_getpeername, fd, &p, &pl) == 0) addr_text(&p, pl, peer, sizeof peer);
    snprintf(text, sizeof text, "%s%s%slocal=%s peer=%s %s", role ? "role=" : "", role ? role : "", role ? " " : "", local, peer, what);
    rs_log_direct(text);
}

static void host_answer_done(int handle, int fd, const struct rs_answer *a)
{
    if (a->engine_fd >= 0) rs_syscall(SYS_close, a->engine_fd);
    if (fd >= 0 && a->log_level >= 2)      /* info: the line engine.py writes for each connection */
        rs_log_connection(fd, "server", "transport=shm");
    if (fd >= 0 && a->bells_err && a->log_level >= 3) {      /* debug, as upgrade.py says it */
        char text[256];
        snprintf(text, sizeof text, "event bells not %s (doorbell bytes instead): %s", a->bells_kept ? "kept" : "made",
                 strerror(-a->bells_err));
        rs_log_direct(text);
    }
    if (handle > 0 && !answered_note(handle) && rs_engine_loaded()) CALL(eng.drop(handle, 1));
}

/* The engine works on a duplicate of its own, made here, past the hooks: the caller holds
 * the socket's lock, which the dup hook's bookkeeping would take. */
static int host_accept_late(int fd)
{
    if (!rs_engine_ready()) return 0;
    int dup = (int)rs_syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) return 0;
    int r = 0;
    CALL(r = eng.accept_late(dup));
    return r;
}

static const struct rs_host_ops preload_host = {
    .step = host_step, .drop = rs_br_drop, .unlisten = rs_br_unlisten, .release = host_release,
    .fell_back = host_fell_back, .answer_done = host_answer_done, .accept_late = host_accept_late, .stat_open = rs_stat_open, .stat_close = rs_stat_close,
    .stat_copy = rs_stat_copy, .stat_inherit = rs_stat_inherit,
};

/* A thread that held the lock of the names (or of the answered handshakes) at the fork
 * does not exist in the child. */
static void names_after_fork(void)
{
    pthread_mutex_init(&names_lock, NULL);
    pthread_mutex_init(&answered_lock, NULL);
}

/* A connection's error, as the program sees it (errno) and why (rs_conn_set_error): a
 * line at every log level but off.  A corrupt frame or a garbage preamble would otherwise
 * show only as EPROTO in the program, if it reports it at all. */
static void log_failure(const rs_conn *c)
{
    if (!strcasecmp(rs_config_get(RS_CFG_LOG_LEVEL), "off")) return;
    const char *name = strerrorname_np(c->err);
    char what[RS_ERRMSG_LEN + 64];
    snprintf(what, sizeof what, "error=%s %s", name ? name : "?", c->errmsg);
    rs_log_connection(c->fd, NULL, what);
}

__attribute__((constructor)) static void bridge_init(void)
{
    rs_host = &preload_host;
    rs_conn_failed = log_failure;
    pthread_atfork(NULL, NULL, names_after_fork);
}
