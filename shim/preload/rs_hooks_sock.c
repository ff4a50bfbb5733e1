/* rs_hooks_sock.c - socket set-up and descriptor calls: who is a candidate for an
 * upgrade, and keeping the fd table true across dup, close, fcntl and fork. */
#include "rs_preload.h"
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <sys/ioctl.h>
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

static void fork_prepare(void) { rs_links_mark_forked(); }
static void fork_child(void) { rs_stats_after_fork(); }

__attribute__((constructor)) static void hooks_init(void)
{
    rs_real_init();
    pthread_atfork(fork_prepare, NULL, fork_child);
}

RS_EXPORT int connect(int fd, const struct sockaddr *sa, socklen_t len)
{
    if (!rs_real.read) rs_real_init();
    if (rs_in_engine || !sa || (sa->sa_family != AF_INET && sa->sa_family != AF_INET6) || rs_link_of(fd) ||
        !is_inet_stream(fd))
        return rs_real.connect(fd, sa, len);
    int handle = rs_br_connect_plan(fd, sa, len);
    int r = rs_real.connect(fd, sa, len);
    int e = errno;
    if (handle < 0 && (r == 0 || e == EINPROGRESS)) {
        /* Plain TCP, for a reason: remembered (a second connect() on the same socket, as
         * nonblocking clients do to learn the outcome, decides nothing new). */
        struct rs_link *l = rs_link_new(fd, RS_PLAIN);
        if (l) l->stat = rs_stat_open(fd, 1, 0, -handle);
        rs_br_plain(fd, -handle);
        errno = e;
    }
    if (handle <= 0) return r;
    if (r == 0 || e == EINPROGRESS) {
        struct rs_link *l = rs_link_new(fd, RS_CLIENT_HS);
        if (!l) { rs_br_drop(handle); errno = e; return r; }
        l->handle = handle;
        l->ep_unknown = !rs_ep_adopt(fd);
        l->hello_pending = r != 0;
        if (r == 0) rs_br_hello(handle);
    } else {
        rs_br_drop(handle);
    }
    errno = e;
    return r;
}

RS_EXPORT int listen(int fd, int backlog)
{
    if (!rs_real.read) rs_real_init();
    int r = rs_real.listen(fd, backlog);
    if (r != 0 || PASS || rs_link_of(fd) || !is_inet_stream(fd)) return r;
    int e = errno;
    if (rs_br_listen(fd) > 0) {
        struct rs_link *l = rs_link_new(fd, RS_LISTEN);
        if (l) l->handle = fd;
        else rs_br_unlisten(fd);
    }
    errno = e;
    return 0;
}

static int after_accept(int lfd, int fd)
{
    struct rs_link *ll = rs_link_of(lfd);
    if (fd < 0 || !ll || ll->state != RS_LISTEN || rs_in_engine) return fd;
    int e = errno;
    rs_ep_fd_fresh(fd);
    int handle = rs_br_accept(lfd, fd);
    if (handle > 0) {
        struct rs_link *l = rs_link_new(fd, RS_SERVER_HS);
        if (l) l->handle = handle;
        else rs_br_drop(handle);
    } else {
        struct rs_link *stale = rs_link_detach(fd);       /* a reused number: forget it */
        if (stale) rs_link_free(stale, -1);
        if (handle < 0) {
            struct rs_link *l = rs_link_new(fd, RS_PLAIN);
            if (l) l->stat = rs_stat_open(fd, 2, 0, -handle);
        }
    }
    errno = e;
    return fd;
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

RS_EXPORT int close(int fd)
{
    if (!rs_real.read) rs_real_init();
    if (rs_link_of(fd)) {
        struct rs_link *l = rs_link_detach(fd);
        if (l) rs_link_free(l, fd);             /* FIN goes out while the fd is still open */
        rs_ep_forget(fd);
    } else if (rs_ep_is_set(fd)) {
        rs_ep_forget(fd);
    }
    rs_ep_fd_fresh(fd);
    return rs_real.close(fd);
}

RS_EXPORT int shutdown(int fd, int how)
{
    if (!rs_real.read) rs_real_init();
    struct rs_link *l = rs_link_of(fd);
    if (!l || rs_in_engine) return rs_real.shutdown(fd, how);
    if (l->state == RS_CLIENT_HS || l->state == RS_SERVER_HS) {
        /* The half-close must travel the way the data will: wait (bounded) for the answer. */
        if (!rs_step(fd, l, 5000)) { rs_br_drop(l->handle); l->state = RS_PLAIN; }
    }
    if (l->state != RS_RING) return rs_real.shutdown(fd, how);
    if (how != SHUT_RD && how != SHUT_WR && how != SHUT_RDWR) { errno = EINVAL; return -1; }
    if (how != SHUT_WR) l->conn->shut_rd = 1;
    if (how != SHUT_RD) rs_send_fin(l->conn);
    return 0;
}

static int share(int oldfd, int newfd)
{
    if (newfd >= 0) {
        rs_ep_fd_fresh(newfd);                 /* a new file behind that number */
        struct rs_link *l = rs_link_of(oldfd);
        if (l) rs_link_share(newfd, l);
    }
    return newfd;
}

/* dup2/dup3 onto a descriptor we track: its state ends first (as close would). */
static void forget(int fd)
{
    struct rs_link *l = rs_link_detach(fd);
    if (l) rs_link_free(l, fd);
}

RS_EXPORT int dup(int fd)
{
    if (!rs_real.read) rs_real_init();
    return share(fd, rs_real.dup(fd));
}

RS_EXPORT int dup2(int oldfd, int newfd)
{
    if (!rs_real.read) rs_real_init();
    if (oldfd != newfd && rs_link_of(newfd) && fcntl(oldfd, F_GETFD) >= 0) forget(newfd);
    int r = rs_real.dup2(oldfd, newfd);
    return oldfd == newfd ? r : share(oldfd, r);
}

RS_EXPORT int dup3(int oldfd, int newfd, int flags)
{
    if (!rs_real.read) rs_real_init();
    if (oldfd != newfd && rs_link_of(newfd) && fcntl(oldfd, F_GETFD) >= 0) forget(newfd);
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
    if (r < 0) return r;
    struct rs_link *l = rs_link_of(fd);
    if (!l) return r;
    if (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC) return share(fd, r);
    if (cmd == F_SETFL) l->nonblock = (arg & O_NONBLOCK) != 0;
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
    struct rs_link *l = rs_link_of(fd);
    if (l && !rs_in_engine) {
        if (req == FIONREAD && (l->state == RS_CLIENT_HS || l->state == RS_SERVER_HS))
            rs_step(fd, l, 0);                  /* handshake bytes are not the application's */
        if (req == FIONREAD && l->state == RS_RING) {
            *(int *)arg = (int)rs_rx_available(l->conn);
            return 0;
        }
        if (req == FIONBIO) {
            int r = rs_real.ioctl(fd, req, arg);
            if (r == 0) l->nonblock = *(int *)arg != 0;
            return r;
        }
    }
    return rs_real.ioctl(fd, req, arg);
}

RS_EXPORT int getsockopt(int fd, int level, int name, void *val, socklen_t *len)
{
    if (!rs_real.read) rs_real_init();
    struct rs_link *l = rs_link_of(fd);
    if (!l || rs_in_engine) return rs_real.getsockopt(fd, level, name, val, len);
    if (l->state == RS_RING && level == IPPROTO_TCP && name == TCP_NODELAY && val && len && *len >= sizeof(int)) {
        *(int *)val = l->app_nodelay;
        *len = sizeof(int);
        return 0;
    }
    int r = rs_real.getsockopt(fd, level, name, val, len);
    /* A nonblocking connect is finished by reading SO_ERROR: the HELLO leaves now. */
    if (r == 0 && level == SOL_SOCKET && name == SO_ERROR && l->state == RS_CLIENT_HS && l->hello_pending &&
        val && *(int *)val == 0)
        rs_step(fd, l, 0);
    return r;
}

RS_EXPORT int setsockopt(int fd, int level, int name, const void *val, socklen_t len)
{
    if (!rs_real.read) rs_real_init();
    struct rs_link *l = rs_link_of(fd);
    if (l && !rs_in_engine && l->state == RS_RING && level == IPPROTO_TCP && name == TCP_NODELAY &&
        val && len >= sizeof(int)) {
        l->app_nodelay = *(const int *)val != 0;   /* the doorbell socket keeps Nagle off */
        return 0;
    }
    return rs_real.setsockopt(fd, level, name, val, len);
}
