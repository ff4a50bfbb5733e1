/* rs_hooks_exec.c - exec: the new program inherits the descriptors but none of our state.
 *
 * Two kinds of socket need care when a descriptor of theirs stays open across the exec
 * (no FD_CLOEXEC; after a fork, only as stdin/stdout/stderr: note_inherited), as in an
 * inetd-style server (git daemon runs `git daemon --serve` on each accepted socket as its
 * stdin and stdout, which runs upload-pack on it the same way; xinetd):
 *  - accepted, with the client's HELLO still unread: the new program is told which
 *    descriptors those are (RDMASOCK_EXEC_ACCEPTED, groups of descriptors of one socket:
 *    "0+1,5") and treats them as just accepted, so it answers the HELLO and the
 *    connection is upgraded there;
 *  - upgraded: the new program reads and writes the kernel socket, so the connection goes
 *    on over TCP first, both directions (rs_sock_to_kernel, reason exec).
 * A client's handshake still under way is finished first (as before a fork), and the
 * connection then moved like any upgraded one.  Apart from that, no engine call and no
 * allocation here: the caller may be a vfork child.  posix_spawn is
 * not covered (glibc runs the new program without going through these symbols); see
 * README, Limitations. */
#include "rs_preload.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define RS_EXEC_WAIT_MS 2000           /* for the peer to follow: it is usually blocked reading */
#define RS_EXEC_ACCEPTED "RDMASOCK_EXEC_ACCEPTED"
#define RS_EXEC_MAX 64                 /* inherited sockets looked after per exec */

extern char **environ;

struct inherited {
    int n;
    int fd[RS_EXEC_MAX];
    struct rs_sock *sock[RS_EXEC_MAX];
    int stdio_sock[3];                  /* 0-2 is a socket we do not track (a vfork child's dup2) */
    struct stat stdio[3];
};

static void add(struct inherited *in, int fd, struct rs_sock *s)
{
    for (int i = 0; i < in->n; i++)
        if (in->fd[i] == fd) return;
    if (in->n == RS_EXEC_MAX) return;
    in->fd[in->n] = fd;
    in->sock[in->n++] = s;
}

static int inherited_fd(int fd)
{
    int fl = rs_real.fcntl(fd, F_GETFD);
    return fl >= 0 && !(fl & FD_CLOEXEC);
}

/* A socket another process may hold too (a fork happened since it was made) is handed
 * over only as the new program's stdin, stdout or stderr, the way a connection is given
 * to a program (inetd, git daemon); elsewhere it is taken to be inherited by accident,
 * as by a helper the parent runs while it goes on using the connection itself. */
static void note_inherited(int fd, struct rs_sock *s, void *arg)
{
    struct inherited *in = arg;
    if ((fd <= 2 || !__atomic_load_n(&s->forked, __ATOMIC_RELAXED)) && inherited_fd(fd)) add(in, fd, s);
    for (int k = 0; k < 3; k++)
        if (in->stdio_sock[k] && s->ino && (uint64_t)in->stdio[k].st_ino == s->ino) add(in, k, s);
}

/* The connection's own descriptor number may be closed here while the socket lives on
 * as `fd` (a child that closed what it does not pass on, as Python's subprocess does):
 * the number is given back, close-on-exec, for the move's calls. */
static int own_number(int fd, struct rs_sock *s)
{
    int cfd = rs_fd_peek(s->conn);
    struct stat st;
    if (fstat(cfd, &st) == 0) return (uint64_t)st.st_ino == s->ino ? 0 : -1;
    return rs_real.dup3(fd, cfd, O_CLOEXEC) == cfd ? 0 : -1;
}

static void move_to_tcp(int fd, struct rs_sock *s)
{
    int r = own_number(fd, s) < 0 ? -EBADF : rs_sock_to_kernel(s, RS_REASON_EXEC, RS_EXEC_WAIT_MS);
    char text[320];
    snprintf(text, sizeof text, "fd=%d transport=tcp reason=exec%s", fd,
             r == -EAGAIN ? " (the peer did not move its direction to TCP in time: the new program may read its doorbells)"
             : r == -EBADE ? " (bytes had arrived that the program never read: the new program does not get them)"
             : r == -EBADF ? " (its descriptor number is another file here: not moved)"
             : r < 0 ? " (the move failed)" : "");
    rs_log_connection(fd, s->role == RS_ROLE_SERVER ? "server" : "client", text);
}

/* Moves upgraded sockets to TCP and writes "NAME=0+1,5" (accepted sockets) into out;
 * out[0] stays 0 if there are none. */
static void before_exec(char *out, size_t outlen)
{
    out[0] = 0;
    if (!rs_real.read) rs_real_init();
    if (!rs_tracking() || rs_in_engine) return;
    struct inherited in = { 0 };
    for (int k = 0; k < 3; k++)
        in.stdio_sock[k] = !rs_is_tracked(k) && inherited_fd(k) && fstat(k, &in.stdio[k]) == 0 && S_ISSOCK(in.stdio[k].st_mode);
    rs_socks_each(note_inherited, &in);
    size_t len = 0;
    for (int i = 0; i < in.n; i++) {
        struct rs_sock *s = in.sock[i];         /* pooled: a stale pointer is safe to try */
        if (!rs_sock_try_get(s)) continue;
        int first = 1;                      /* the first inherited descriptor of its socket */
        for (int j = 0; j < i; j++) first &= in.sock[j] != in.sock[i];
        /* A client handshake under way is finished first, as before a fork: its answer
         * would reach the new program as data.  Not in a vfork child, whose engine is the
         * suspended parent's. */
        if (first && rs_sock_state(s) == RS_CLIENT_HS && !rs_memory_shared_child()) {
            rs_sock_finish_client(s, rs_settle_deadline());
            if (rs_sock_state(s) == RS_CLIENT_HS)
                rs_log_connection(in.fd[i], "client", "reason=exec (the server did not answer in time: the new program "
                                                      "may read its answer)");
        }
        int st = rs_sock_state(s);
        if (st == RS_RING && first && !RS_GET(s->conn->fb)) move_to_tcp(in.fd[i], s);   /* once: execvp tries paths */
        if (st == RS_SERVER_HS && first)           /* the socket's group: all its numbers */
            for (int j = i; j < in.n && len + 16 < outlen; j++)
                if (in.sock[j] == s)
                    len += (size_t)snprintf(out + len, outlen - len, "%s%d",
                                            j > i ? "+" : len ? "," : RS_EXEC_ACCEPTED "=", in.fd[j]);
        rs_sock_put(s);
    }
}

/* env without any RDMASOCK_EXEC_ACCEPTED of its own, with `add` (if set), into `to`
 * (room for every entry of env plus two). */
static char *const *with_accepted(char *const *env, const char *add, char **to)
{
    size_t n = 0, k = strlen(RS_EXEC_ACCEPTED);
    for (size_t i = 0; env && env[i]; i++)
        if (strncmp(env[i], RS_EXEC_ACCEPTED "=", k + 1)) to[n++] = env[i];
    if (add[0]) to[n++] = (char *)add;
    to[n] = NULL;
    return to;
}

static size_t env_count(char *const *env)
{
    size_t n = 0;
    while (env && env[n]) n++;
    return n;
}

/* Each hook: the work above, then the real call with the environment it implies. */
#define PREPARE(env)                                  \
    char add_[RS_EXEC_MAX * 8 + 32];                  \
    before_exec(add_, sizeof add_);                   \
    char *to_[env_count(env) + 2];                    \
    char *const *env_ = with_accepted(env, add_, to_);

RS_EXPORT int execve(const char *path, char *const argv[], char *const envp[])
{
    PREPARE(envp);
    return rs_real.execve(path, argv, env_);
}

RS_EXPORT int execveat(int dirfd, const char *path, char *const argv[], char *const envp[], int flags)
{
    if (!rs_real.read) rs_real_init();
    if (!rs_real.execveat) { errno = ENOSYS; return -1; }
    PREPARE(envp);
    return rs_real.execveat(dirfd, path, argv, env_, flags);
}

RS_EXPORT int fexecve(int fd, char *const argv[], char *const envp[])
{
    PREPARE(envp);
    return rs_real.fexecve(fd, argv, env_);
}

RS_EXPORT int execv(const char *path, char *const argv[])
{
    PREPARE(environ);
    return rs_real.execve(path, argv, env_);
}

RS_EXPORT int execvp(const char *file, char *const argv[])
{
    PREPARE(environ);
    return rs_real.execvpe(file, argv, env_);
}

RS_EXPORT int execvpe(const char *file, char *const argv[], char *const envp[])
{
    PREPARE(envp);
    return rs_real.execvpe(file, argv, env_);
}

/* execl, execlp, execle: their argument lists as an argv on the stack, as glibc does. */
#define ARGV_FROM_LIST(first, ap, argv)                                       \
    size_t argc_ = 1;                                                         \
    va_start(ap, first);                                                      \
    while (va_arg(ap, const char *)) argc_++;                                 \
    va_end(ap);                                                               \
    const char *argv[argc_ + 1];                                              \
    argv[0] = first;                                                          \
    va_start(ap, first);                                                      \
    for (size_t i_ = 1; i_ <= argc_; i_++) argv[i_] = va_arg(ap, const char *);

RS_EXPORT int execl(const char *path, const char *arg, ...)
{
    va_list ap;
    ARGV_FROM_LIST(arg, ap, argv);
    va_end(ap);
    return execv(path, (char *const *)argv);
}

RS_EXPORT int execlp(const char *file, const char *arg, ...)
{
    va_list ap;
    ARGV_FROM_LIST(arg, ap, argv);
    va_end(ap);
    return execvp(file, (char *const *)argv);
}

RS_EXPORT int execle(const char *path, const char *arg, ...)
{
    va_list ap;
    ARGV_FROM_LIST(arg, ap, argv);
    char *const *envp = va_arg(ap, char *const *);
    va_end(ap);
    return execve(path, (char *const *)argv, envp);
}

/* ---- the new program's side ------------------------------------------------------- */

/* Sockets the program we were exec'd from accepted, with a HELLO still to answer: each is
 * treated as accepted here when the program first reads, writes or waits on it, when the
 * engine may start (not in a constructor, nor while a Python host initialises: its own
 * interpreter does not exist yet).  The variable goes, so that our children do not see it. */
static struct accepted_group {
    int n, fd[8];
    dev_t dev;
    ino_t ino;                          /* the socket's identity, against reused numbers */
} groups[RS_EXEC_MAX];
static int ngroups;
static pthread_mutex_t groups_lock = PTHREAD_MUTEX_INITIALIZER;
int rs_adopt_due;

__attribute__((constructor)) static void note_accepted(void)
{
    const char *v = getenv(RS_EXEC_ACCEPTED);
    if (!v) return;
    char list[RS_EXEC_MAX * 8 + 32], *save = NULL;
    snprintf(list, sizeof list, "%s", v);
    unsetenv(RS_EXEC_ACCEPTED);
    for (char *g = strtok_r(list, ",", &save); g && ngroups < RS_EXEC_MAX; g = strtok_r(NULL, ",", &save)) {
        struct accepted_group *a = &groups[ngroups];
        struct stat st;
        a->n = 0;
        for (char *p = g, *end; *p && a->n < 8; p = *end == '+' ? end + 1 : end) {
            long fd = strtol(p, &end, 10);
            if (end == p || fd < 0 || fd > INT_MAX) break;
            a->fd[a->n++] = (int)fd;
        }
        if (a->n && fstat(a->fd[0], &st) == 0 && S_ISSOCK(st.st_mode)) {
            a->dev = st.st_dev;
            a->ino = st.st_ino;
            ngroups++;
        }
    }
    if (ngroups) __atomic_store_n(&rs_adopt_due, 1, __ATOMIC_RELEASE);
}

static int is_member(int fd, const struct accepted_group *a)
{
    struct stat st;
    return fstat(fd, &st) == 0 && st.st_dev == a->dev && st.st_ino == a->ino;
}

void rs_adopt_inherited(int fd)
{
    struct accepted_group a = { 0 };
    pthread_mutex_lock(&groups_lock);
    for (int i = 0; i < ngroups && !a.n; i++)
        for (int j = 0; j < groups[i].n; j++)
            if (groups[i].fd[j] == fd) {
                a = groups[i];
                groups[i] = groups[--ngroups];
                break;
            }
    if (!ngroups) __atomic_store_n(&rs_adopt_due, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&groups_lock);
    if (!a.n || !is_member(a.fd[0], &a)) return;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getpeername(a.fd[0], (struct sockaddr *)&ss, &sl) < 0 || (ss.ss_family != AF_INET && ss.ss_family != AF_INET6))
        return;
    rs_adopt_accepted(-1, a.fd[0]);
    for (int j = 1; j < a.n; j++)
        if (a.fd[j] != a.fd[0] && is_member(a.fd[j], &a)) rs_share(a.fd[0], a.fd[j]);
}
