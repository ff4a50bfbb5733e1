/* rs_hooks_sock.c - socket set-up and descriptor calls: which sockets are candidates for an
 * upgrade, and keeping the descriptor table true across dup, close, fcntl and fork. */
#include "rs_preload.h"
#include "../rs_answer.h"
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PASS (rs_in_engine || !rs_real.read)

static int is_inet_stream(int fd)
{
    int type = 0;
    socklen_t tl = sizeof type;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (rs_real.getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 || type != SOCK_STREAM) return 0;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) return 0;
    return ss.ss_family == AF_INET || ss.ss_family == AF_INET6;
}

/* A child of vfork() (or of a clone() that shares memory) runs no fork handlers and
 * shares our tables with its parent: what it does to its descriptors before its exec
 * (the dup2 onto stdin of Python's subprocess) must not change them.  It is told apart
 * by its pid, which only a real fork's handler brings up to date. */
static pid_t our_pid;

int rs_memory_shared_child(void) { return (pid_t)rs_syscall(SYS_getpid) != __atomic_load_n(&our_pid, __ATOMIC_RELAXED); }

static void fork_prepare(void) { rs_sock_mark_all_forked(); }
static void fork_parent(void) { rs_sock_after_fork_parent(); }
static void fork_child(void)
{
    __atomic_store_n(&our_pid, (pid_t)rs_syscall(SYS_getpid), __ATOMIC_RELAXED);
    rs_stats_after_fork(); rs_socks_after_fork_child(); rs_stats_forget_parent(); rs_ep_after_fork_child();
}

__attribute__((constructor)) static void hooks_init(void)
{
    rs_real_init();
    __atomic_store_n(&our_pid, (pid_t)rs_syscall(SYS_getpid), __ATOMIC_RELAXED);
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* exit() and _exit(): the kernel closes every descriptor next, without our close hook.
 * Each upgraded socket first ends its stream as close() would (rs_sock_at_exit): left to
 * the kernel, a doorbell byte nobody read makes that close a reset, which throws away what
 * is still in flight to the peer.  Not in a child that shares our memory (vfork).  The
 * call reference taken is never put back: its last put could free the object through the
 * control plane, which may already be finalised. */
static void end_stream_at_exit(int fd, struct rs_sock *s, void *arg)
{
    (void)fd; (void)arg;
    if (rs_sock_try_get(s)) rs_sock_at_exit(s);
}

static void end_streams(void)
{
    if (rs_real.read && rs_tracking() && !rs_memory_shared_child())
        rs_socks_each(end_stream_at_exit, NULL);
}

__attribute__((destructor)) static void hooks_at_exit(void) { end_streams(); }

RS_EXPORT void _exit(int status)
{
    end_streams();
    for (;;) rs_syscall(SYS_exit_group, status);
}

RS_EXPORT void _Exit(int status) __attribute__((alias("_exit")));

/* A socket that stays plain TCP for a reason decided at connect/accept: it gets a stats
 * row, released when it closes. */
static void track_plain(int fd, int role, int reason)
{
    struct rs_sock *s = rs_track(fd, RS_PLAIN, -1, role);
    if (!s) return;
    rs_sock_open_stat(s, rs_stat_open(fd, role, RS_TRANSPORT_TCP, reason));
    rs_sock_put(s);
}

RS_EXPORT int connect(int fd, const struct sockaddr *sa, socklen_t len)
{
    if (!rs_real.read) rs_real_init();
    if (rs_in_engine || !sa || (sa->sa_family != AF_INET && sa->sa_family != AF_INET6) || rs_is_tracked(fd) ||
        !is_inet_stream(fd))
        return rs_real.connect(fd, sa, len);
    int handle = rs_br_connect_plan(fd, sa, len);
    int r = rs_real.connect(fd, sa, len);
    int e = errno;
    if (handle < 0 && (r == 0 || e == EINPROGRESS)) {
        /* Plain TCP, for a reason: remembered (a second connect() on the same socket, as
         * nonblocking clients do to learn the outcome, decides nothing new). */
        track_plain(fd, RS_ROLE_CLIENT, -handle);
        rs_br_plain(fd, -handle);
    }
    if (handle > 0) {
        struct rs_sock *s = r == 0 || e == EINPROGRESS ? rs_track(fd, RS_CLIENT_HS, handle, RS_ROLE_CLIENT) : NULL;
        if (!s) {
            rs_br_drop(handle);
        } else {
            int ep_unknown = !rs_ep_adopt(fd);
            pthread_mutex_lock(&s->lock);             /* a fork's settling may step it already */
            s->ep_unknown = (uint8_t)ep_unknown;
            s->hello_pending = r != 0;
            pthread_mutex_unlock(&s->lock);
            if (r == 0) rs_sock_step(s, 0);         /* the HELLO leaves (rs_sock.c step) */
            rs_sock_put(s);
        }
    }
    errno = e;
    return r;
}

/* The port a socket is bound to, 0 if none yet. */
static int bound_port(int fd)
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) return 0;
    return ss.ss_family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port : ((struct sockaddr_in6 *)&ss)->sin6_port;
}

/* fd listens under `handle` (its name's, if any): a listener of ours from now on. */
static void track_listener(int fd, int handle, struct rs_answer **tpl)
{
    struct rs_sock *s = rs_track(fd, RS_LISTEN, handle, 0);
    if (!s) {
        rs_br_unlisten(handle);
        return;
    }
    pthread_mutex_lock(&s->lock);
    if (*tpl && (*tpl)->name_len) { s->answer = *tpl; *tpl = NULL; }
    pthread_mutex_unlock(&s->lock);
    rs_sock_put(s);
}

/* The rendezvous name is registered before the socket listens: a client that can connect
 * finds it (registered after, a client in between, typically the first one, while the
 * engine loads, went plain).  A socket that listen() itself binds to a port registers
 * after, as it must. */
RS_EXPORT int listen(int fd, int backlog)
{
    if (!rs_real.read) rs_real_init();
    if (PASS || rs_is_tracked(fd) || !is_inet_stream(fd)) return rs_real.listen(fd, backlog);
    int first = bound_port(fd) != 0, handle = 0;
    struct rs_answer *tpl = rs_answer_new();
    if (first) handle = rs_br_listen(fd, tpl);
    int r = rs_real.listen(fd, backlog);
    int e = errno;
    if (r == 0 && !first) handle = rs_br_listen(fd, tpl);
    if (handle > 0 && r == 0) track_listener(fd, handle, &tpl);
    else if (handle > 0) rs_br_unlisten(handle);
    free(tpl);
    errno = e;
    return r;
}

/* The listener of an accept.  One we did not see listen (inherited across exec, as at a
 * server's binary upgrade or socket activation; received with SCM_RIGHTS) may share its
 * port with a named listener, whose clients send their HELLO to it too: the first time
 * it accepts, it is registered as listen() would have (rs_br_listen), or remembered as
 * plain (not TCP, excluded, disabled) so that this is looked at once. */
static pthread_mutex_t adopt_lock = PTHREAD_MUTEX_INITIALIZER;
static struct rs_sock *listener_of(int lfd)
{
    struct rs_sock *ls = rs_sock_of(lfd);
    if (ls) return ls;
    pthread_mutex_lock(&adopt_lock);                /* one registration per listener */
    ls = rs_sock_of(lfd);
    if (!ls) {
        int listening = 0, handle = 0;
        socklen_t l = sizeof listening;
        struct rs_answer *tpl = NULL;
        if (is_inet_stream(lfd) && rs_real.getsockopt(lfd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &l) == 0 &&
            listening && (tpl = rs_answer_new()))
            handle = rs_br_listen(lfd, tpl);
        if (handle > 0) {
            track_listener(lfd, handle, &tpl);
        } else {
            struct rs_sock *p = rs_track(lfd, RS_PLAIN, -1, 0);
            if (p) rs_sock_put(p);
        }
        free(tpl);
        ls = rs_sock_of(lfd);
    }
    pthread_mutex_unlock(&adopt_lock);
    return ls;
}

static int after_accept(int lfd, int fd)
{
    if (fd < 0 || rs_in_engine) return fd;
    int e = errno;
    struct rs_sock *ls = listener_of(lfd);
    errno = e;
    if (!ls) return fd;
    int listening = rs_sock_state(ls) == RS_LISTEN;
    rs_sock_put(ls);
    if (!listening) return fd;
    rs_adopt_accepted(lfd, fd);
    errno = e;
    return fd;
}

/* What the listener's template (rs_answer.c) lets C decide about fd, without the engine:
 * RS_PLAN_HANDSHAKE (*a filled), RS_PLAN_PLAIN or RS_PLAN_ASK. */
static int plan_from_listener(int lfd, int fd, struct rs_answer *a)
{
    struct rs_sock *ls = lfd >= 0 ? rs_sock_of(lfd) : NULL;
    if (!ls) return RS_PLAN_ASK;
    struct rs_answer tpl;
    pthread_mutex_lock(&ls->lock);
    int have = ls->state == RS_LISTEN && ls->answer;
    if (have) tpl = *ls->answer;
    pthread_mutex_unlock(&ls->lock);
    rs_sock_put(ls);
    int plan = have ? rs_answer_plan(&tpl, fd, a) : RS_PLAN_ASK;
    if (plan == RS_PLAN_PLAIN && tpl.log_level >= 2) rs_log_connection(fd, "server", "transport=tcp reason=peer_not_rdmasock");
    return plan;
}

/* fd was accepted by a listener of ours (lfd; -1: by the program this one was exec'd
 * from, rs_hooks_exec.c): a HELLO may follow. */
void rs_adopt_accepted(int lfd, int fd)
{
    rs_ep_fd_fresh(fd);
    rs_forget_reused(fd);                            /* closed where we did not see it */
    struct rs_answer *answer = rs_answer_new();
    int plan = answer ? plan_from_listener(lfd, fd, answer) : RS_PLAN_ASK;
    int handle = plan == RS_PLAN_ASK ? rs_br_accept(lfd, fd, answer) : plan == RS_PLAN_PLAIN ? -RS_REASON_PEER_NOT_RDMASOCK : 0;
    if (handle > 0 || plan == RS_PLAN_HANDSHAKE) {
        struct rs_sock *s = rs_track(fd, RS_SERVER_HS, handle, RS_ROLE_SERVER);
        if (s) {
            pthread_mutex_lock(&s->lock);
            if (answer && answer->name_len) { s->answer = answer; answer = NULL; }
            pthread_mutex_unlock(&s->lock);
            rs_sock_put(s);
        } else if (handle > 0) {
            rs_br_drop(handle);
        }
    } else if (handle < 0) {
        track_plain(fd, RS_ROLE_SERVER, -handle);
    }
    if (answer && answer->link_fd >= 0) rs_syscall(SYS_close, answer->link_fd);
    free(answer);
}

RS_EXPORT int accept(int lfd, struct sockaddr *sa, socklen_t *len)
{
    if (!rs_real.read) rs_real_init();
    return after_accept(lfd, rs_real.accept(lfd, sa, len));
}

RS_EXPORT int accept4(int lfd, struct sockaddr *sa, socklen_t *len, int flags)
{
    if (!rs_real.read) rs_real_init();
    return after_accept(lfd, rs_real.accept4(lfd, sa, len, flags));
}

/* fd is about to be closed: the application's hold of its socket ends (the last one
 * writes the FIN record while the number is still the socket), and epoll bookkeeping
 * forgets the number.  Not in a child that shares our memory (vfork): it would change
 * the parent's state. */
static void before_close(int fd)
{
    int tracked = rs_is_tracked(fd);
    if ((tracked || rs_ep_is_set(fd)) && rs_memory_shared_child()) return;
    if (tracked) rs_untrack(fd);
    if (tracked || rs_ep_is_set(fd)) rs_ep_forget(fd);
    rs_ep_fd_fresh(fd);
}

RS_EXPORT int close(int fd)
{
    if (!rs_real.read) rs_real_init();
    before_close(fd);
    return rs_real.close(fd);
}

/* close_range(2): before_close for every number in the range we know of.  With
 * CLOSE_RANGE_CLOEXEC nothing closes now (exec does, rs_hooks_exec.c); CLOSE_RANGE_UNSHARE
 * is taken as a close (a child about to exec is its use). */
static int before_close_range(unsigned first, unsigned last, int flags)
{
    if (first > last || (flags & ~(CLOSE_RANGE_CLOEXEC | CLOSE_RANGE_UNSHARE))) return -EINVAL;
    if (!(flags & CLOSE_RANGE_CLOEXEC) && !rs_memory_shared_child()) {
        rs_untrack_range(first, last);
        rs_ep_forget_range(first, last);
        rs_ep_fresh_range(first, last);
    }
    return 0;
}

RS_EXPORT int close_range(unsigned first, unsigned last, int flags)
{
    if (!rs_real.read) rs_real_init();
    int e = before_close_range(first, last, flags);
    if (e) { errno = -e; return -1; }
    return (int)rs_syscall(SYS_close_range, first, last, flags);
}

RS_EXPORT void closefrom(int lowfd)
{
    if (!rs_real.read) rs_real_init();
    if (lowfd < 0) lowfd = 0;
    before_close_range((unsigned)lowfd, ~0u, 0);
    if (rs_real.closefrom) rs_real.closefrom(lowfd);
    else rs_syscall(SYS_close_range, (unsigned)lowfd, ~0u, 0);
}

/* syscall(2) with a number that changes the descriptor table goes where the libc call
 * would (libuv closes every descriptor with syscall(SYS_close, fd)); the rest to the
 * kernel.  Only these: the others' libc functions differ from their system calls in
 * arguments and restart rules. */
__attribute__((no_sanitize_address))      /* like libc's, it takes six arguments whatever was passed */
RS_EXPORT long syscall(long n, ...)
{
    va_list ap;
    va_start(ap, n);
    long a = va_arg(ap, long), b = va_arg(ap, long), c = va_arg(ap, long);
    long d = va_arg(ap, long), e = va_arg(ap, long), f = va_arg(ap, long);
    va_end(ap);
    if (!rs_real.read) rs_real_init();
    switch (n) {
    case SYS_close:
        before_close((int)a);
        break;
    case SYS_close_range: {
        int err = before_close_range((unsigned)a, (unsigned)b, (int)c);
        if (err) { errno = -err; return -1; }
        break;
    }
    case SYS_dup:
        return dup((int)a);
#ifdef SYS_dup2
    case SYS_dup2:
        return dup2((int)a, (int)b);
#endif
    case SYS_dup3:
        return dup3((int)a, (int)b, (int)c);
    }
    return rs_syscall6(n, a, b, c, d, e, f);
}

/* fd goes to another process in a message (SCM_RIGHTS).  The receiver knows only the
 * kernel socket (its rdmasock, if any, has no ring for it), so an upgraded connection
 * goes on over TCP first, both ways, as before an exec, and a client handshake under way
 * is finished first so that there is something to move.  The socket is then `passed`:
 * the receiver may hold it after our close, which therefore ends nothing.  A socket still
 * in its server handshake (accepted, HELLO unread: Node's cluster primary hands each
 * accepted connection to a worker) is left for the receiver to answer. */
void rs_sock_passing(int fd)
{
    struct rs_sock *s = rs_sock_of(fd);
    if (!s) return;
    rs_sock_finish_client(s, rs_settle_deadline());
    if (rs_sock_state(s) == RS_RING && !RS_GET(s->conn->fb)) {
        int r = rs_sock_to_kernel(s, RS_REASON_PASSED, RS_PASS_WAIT_MS);
        char text[256];
        snprintf(text, sizeof text, "fd=%d transport=tcp reason=passed%s", fd,
                 r == -EAGAIN ? " (the peer did not move its direction to TCP in time: the receiver may read its doorbells)"
                 : r == -EBADE ? " (bytes had arrived that the program never read: the receiver does not get them)"
                 : r < 0 ? " (the move failed)" : "");
        rs_log_connection(fd, s->role == RS_ROLE_SERVER ? "server" : "client", text);
    }
    __atomic_store_n(&s->passed, 1, __ATOMIC_RELEASE);
    rs_sock_put(s);
}

/* fd came in a message (SCM_RIGHTS): a connected TCP socket is taken as just accepted,
 * since a client's HELLO may be waiting on it (a socket another process accepted and
 * passed on); the rendezvous decides, as after accept.  The number is new: whatever we
 * had at it was closed where we did not see it. */
void rs_adopt_received(int fd)
{
    int listening = 0;
    socklen_t l = sizeof listening;
    struct sockaddr_storage peer;
    socklen_t pl = sizeof peer;
    rs_forget_reused(fd);
    rs_ep_fd_fresh(fd);
    if (!is_inet_stream(fd)) return;
    if (rs_real.getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &l) < 0 || listening) return;
    if (getpeername(fd, (struct sockaddr *)&peer, &pl) < 0) return;
    rs_adopt_accepted(-1, fd);
}

RS_EXPORT int shutdown(int fd, int how)
{
    if (!rs_real.read) rs_real_init();
    struct rs_sock *s = rs_in_engine ? NULL : rs_sock_of(fd);
    if (!s) return rs_real.shutdown(fd, how);
    int plain, r = rs_sock_shutdown(s, how, &plain);
    rs_sock_put(s);
    if (plain) return rs_real.shutdown(fd, how);
    if (r < 0) { errno = -r; return -1; }
    return 0;
}

/* newfd now refers to oldfd's open file: it shares oldfd's socket, if any. */
static int share(int oldfd, int newfd)
{
    if (newfd >= 0 && rs_memory_shared_child()) return newfd;
    if (newfd >= 0) {
        rs_ep_fd_fresh(newfd);                  /* a new file behind that number */
        if (rs_is_tracked(oldfd)) rs_share(oldfd, newfd);
        else rs_forget_reused(newfd);           /* closed where we did not see it */
    }
    return newfd;
}

RS_EXPORT int dup(int fd)
{
    if (!rs_real.read) rs_real_init();
    return share(fd, rs_real.dup(fd));
}

/* dup2/dup3 onto a tracked descriptor end its hold first, as close would (so its FIN goes
 * out while the number is still the old socket). */
RS_EXPORT int dup2(int oldfd, int newfd)
{
    if (!rs_real.read) rs_real_init();
    if (oldfd != newfd && rs_is_tracked(newfd) && rs_real.fcntl(oldfd, F_GETFD) >= 0 && !rs_memory_shared_child())
        rs_untrack(newfd);
    int r = rs_real.dup2(oldfd, newfd);
    return oldfd == newfd ? r : share(oldfd, r);
}

RS_EXPORT int dup3(int oldfd, int newfd, int flags)
{
    if (!rs_real.read) rs_real_init();
    if (oldfd != newfd && rs_is_tracked(newfd) && rs_real.fcntl(oldfd, F_GETFD) >= 0 && !rs_memory_shared_child())
        rs_untrack(newfd);
    return share(oldfd, rs_real.dup3(oldfd, newfd, flags));
}

RS_EXPORT int fcntl(int fd, int cmd, ...)
{
    if (!rs_real.read) rs_real_init();
    va_list ap;
    va_start(ap, cmd);
    long arg = va_arg(ap, long);              /* every command we pass takes an int or a pointer */
    va_end(ap);
    int r = rs_real.fcntl(fd, cmd, arg);
    if (r < 0 || !rs_is_tracked(fd)) return r;
    if (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC) return share(fd, r);
    if (cmd == F_SETFL) {
        struct rs_sock *s = rs_sock_of(fd);
        if (s) { rs_sock_flags_seen(s, (int)arg); rs_sock_put(s); }
    }
    return r;
}

RS_EXPORT int fcntl64(int fd, int cmd, ...) __attribute__((alias("fcntl")));

RS_EXPORT int ioctl(int fd, unsigned long req, ...)
{
    if (!rs_real.read) rs_real_init();
    va_list ap;
    va_start(ap, req);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    struct rs_sock *s = rs_in_engine ? NULL : rs_sock_of(fd);
    if (!s) return rs_real.ioctl(fd, req, arg);
    int r;
    if (req == FIONREAD && rs_sock_in_handshake(s)) rs_sock_step(s, 0);   /* handshake bytes are not data */
    int plain = 1;
    if (req == FIONREAD && rs_sock_state(s) == RS_RING) {
        *(int *)arg = (int)rs_rx_available(s->conn);
        r = 0;
    } else if (req == SIOCATMARK && (r = rs_sock_at_mark(s, &plain), !plain)) {
        *(int *)arg = 0;
    } else {
        r = rs_real.ioctl(fd, req, arg);
        if (r == 0 && req == FIONBIO) s->nonblock = *(int *)arg != 0;
    }
    rs_sock_put(s);
    return r;
}

RS_EXPORT int getsockopt(int fd, int level, int name, void *val, socklen_t *len)
{
    if (!rs_real.read) rs_real_init();
    struct rs_sock *s = rs_in_engine ? NULL : rs_sock_of(fd);
    if (!s) return rs_real.getsockopt(fd, level, name, val, len);
    int r;
    if (rs_sock_state(s) == RS_RING && level == IPPROTO_TCP && (name == TCP_NODELAY || name == TCP_CORK) && val && len &&
        *len >= sizeof(int)) {
        *(int *)val = name == TCP_NODELAY ? s->app_nodelay : s->app_cork;
        *len = sizeof(int);
        r = 0;
    } else {
        r = rs_real.getsockopt(fd, level, name, val, len);
        if (r == 0 && level == IPPROTO_TCP && name == TCP_INFO && val && len) rs_sock_tcp_info(s, val, *len);
        if (r == 0 && level == SOL_SOCKET && name == SO_ERROR && val) *(int *)val = rs_sock_so_error(s, *(int *)val);
        /* A nonblocking connect is finished by reading SO_ERROR: the HELLO leaves now. */
        if (r == 0 && level == SOL_SOCKET && name == SO_ERROR && rs_sock_state(s) == RS_CLIENT_HS &&
            s->hello_pending && val && *(int *)val == 0)
            rs_sock_step(s, 0);
    }
    rs_sock_put(s);
    return r;
}

RS_EXPORT int setsockopt(int fd, int level, int name, const void *val, socklen_t len)
{
    if (!rs_real.read) rs_real_init();
    struct rs_sock *s = rs_in_engine ? NULL : rs_sock_of(fd);
    if (!s) return rs_real.setsockopt(fd, level, name, val, len);
    int r = 0;
    if (rs_sock_state(s) == RS_RING && level == IPPROTO_TCP && (name == TCP_NODELAY || name == TCP_CORK) && val &&
        len >= sizeof(int)) {
        /* the doorbell socket keeps Nagle and the cork off */
        if (name == TCP_NODELAY) s->app_nodelay = *(const int *)val != 0;
        else s->app_cork = *(const int *)val != 0;
    } else {
        if (rs_tx_stamps_asked(level, name, val, len)) rs_sock_move_tx(s, RS_REASON_TX_TIMESTAMPS, 0, &(int){ 0 });
        r = rs_real.setsockopt(fd, level, name, val, len);
        if (r == 0) rs_sock_setopt_seen(s, level, name, val, len);
    }
    rs_sock_put(s);
    return r;
}
