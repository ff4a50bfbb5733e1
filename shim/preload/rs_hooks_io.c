/* rs_hooks_io.c - data calls.  On a descriptor we do not track (or one that stayed plain
 * TCP) each hook is one table lookup and the real call.  On an upgraded one the data goes
 * through the socket object (shim/rs_sock.c) into the ring, with no system call while the
 * ring has room or data. */
#include "rs_preload.h"
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define RS_BOUNCE 16384               /* writev/sendfile coalescing buffer, per thread */

static __thread uint8_t bounce[RS_BOUNCE];

/* The socket behind fd with a call reference, if its data does not simply go to the
 * kernel (plain TCP and listeners do). */
static inline struct rs_sock *tracked(int fd)
{
    if (rs_in_engine) return NULL;
    rs_adopt_if_due(fd);
    struct rs_sock *s = rs_sock_of(fd);
    if (__builtin_expect(!s, 1)) return NULL;
    int st = rs_sock_state(s);
    if (st == RS_PLAIN || st == RS_LISTEN) { rs_sock_put(s); return NULL; }
    return s;
}

static inline ssize_t result(ssize_t r)
{
    if (r < 0) { errno = (int)-r; return -1; }
    return r;
}

/* Each hook: look the socket up (taking a reference), let rs_sock.c do the call, let go;
 * a socket that is plain TCP (now) gets the real call. */
#define HOOK(call, real)                                                         \
    do {                                                                         \
        struct rs_sock *s_ = tracked(fd);                                        \
        if (s_) {                                                                \
            int plain_;                                                          \
            ssize_t r_ = call;                                                   \
            rs_sock_put(s_);                                                     \
            if (!plain_) return result(r_);                                      \
        }                                                                        \
        if (__builtin_expect(!rs_real.read, 0)) rs_real_init();                  \
        return real;                                                             \
    } while (0)

RS_EXPORT ssize_t read(int fd, void *buf, size_t n)
{
    HOOK(rs_sock_recv(s_, buf, n, 0, &plain_), rs_real.read(fd, buf, n));
}

RS_EXPORT ssize_t recv(int fd, void *buf, size_t n, int flags)
{
    HOOK(rs_sock_recv(s_, buf, n, flags, &plain_), rs_real.recv(fd, buf, n, flags));
}

static ssize_t recv_from(struct rs_sock *s, void *buf, size_t n, int flags, socklen_t *sl, int *plain)
{
    ssize_t r = rs_sock_recv(s, buf, n, flags, plain);
    if (!*plain && sl) *sl = 0;                       /* connected stream: no address */
    return r;
}

RS_EXPORT ssize_t recvfrom(int fd, void *buf, size_t n, int flags, struct sockaddr *sa, socklen_t *sl)
{
    HOOK(recv_from(s_, buf, n, flags, sl, &plain_), rs_real.recvfrom(fd, buf, n, flags, sa, sl));
}

/* The socket became plain TCP in the middle of a call over several buffers (another
 * thread passed it to another process): what the ring already gave or took is this call's
 * result, since the kernel's call would start again from the first buffer (reading over
 * bytes taken from the ring, or sending bytes twice).  The next call goes to the kernel. */
static ssize_t plain_after(ssize_t total, int *plain)
{
    if (!total) return 0;
    *plain = 0;
    return total;
}

/* Scatter reads: the first buffer may wait, the rest take what is already there. */
static ssize_t recv_iov(struct rs_sock *s, const struct iovec *iov, int cnt, int flags, int *plain)
{
    ssize_t total = 0;
    *plain = 0;
    for (int i = 0; i < cnt; i++) {
        if (!iov[i].iov_len) continue;
        /* MSG_WAITALL fills every buffer; otherwise only the first one may wait */
        int fl = total && !(flags & MSG_WAITALL) ? flags | MSG_DONTWAIT : flags;
        ssize_t r = rs_sock_recv(s, iov[i].iov_base, iov[i].iov_len, fl, plain);
        if (*plain) return plain_after(total, plain);
        if (r < 0) return total ? total : r;
        total += r;
        if ((size_t)r < iov[i].iov_len || (flags & MSG_PEEK)) break;
    }
    return total;
}

RS_EXPORT ssize_t readv(int fd, const struct iovec *iov, int cnt)
{
    HOOK(recv_iov(s_, iov, cnt, 0, &plain_), rs_real.readv(fd, iov, cnt));
}


static ssize_t recv_msg(struct rs_sock *s, struct msghdr *m, int flags, int *plain)
{
    if (flags & MSG_ERRQUEUE) { *plain = 1; return 0; }       /* the kernel socket's own */
    ssize_t r = recv_iov(s, m->msg_iov, (int)m->msg_iovlen, flags, plain);
    if (!*plain) {
        m->msg_namelen = 0;
        m->msg_flags = 0;
        int trunc = 0;
        m->msg_controllen = r > 0 && rs_sock_state(s) == RS_RING
                            ? rs_conn_rx_ancillary(s->conn, s->fd, m->msg_control, m->msg_controllen, &trunc) : 0;
        if (trunc) m->msg_flags |= MSG_CTRUNC;
    }
    return r;
}

/* Calls fn for every descriptor a message carries (SCM_RIGHTS). */
static void passed_fds(const struct msghdr *m, void (*fn)(int))
{
    if (!m || !m->msg_control || m->msg_controllen < sizeof(struct cmsghdr)) return;
    for (struct cmsghdr *h = CMSG_FIRSTHDR(m); h; h = CMSG_NXTHDR((struct msghdr *)m, h)) {
        if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS || h->cmsg_len < CMSG_LEN(0)) continue;
        size_t n = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(h) + i * sizeof fd, sizeof fd);
            fn(fd);
        }
    }
}

static ssize_t received(ssize_t r, struct msghdr *m)
{
    int e = errno;
    if (r >= 0 && m && m->msg_controllen && !rs_in_engine) passed_fds(m, rs_adopt_received);
    errno = e;
    return r;
}

/* A socket received from another process (Node's cluster workers get each connection
 * its primary accepted this way) is looked at as one just accepted (rs_adopt_received). */
RS_EXPORT ssize_t recvmsg(int fd, struct msghdr *m, int flags)
{
    HOOK(recv_msg(s_, m, flags, &plain_), received(rs_real.recvmsg(fd, m, flags), m));
}

RS_EXPORT ssize_t write(int fd, const void *buf, size_t n)
{
    HOOK(rs_sock_send(s_, buf, n, 0, &plain_), rs_real.write(fd, buf, n));
}

RS_EXPORT ssize_t send(int fd, const void *buf, size_t n, int flags)
{
    HOOK(rs_sock_send(s_, buf, n, flags, &plain_), rs_real.send(fd, buf, n, flags));
}

RS_EXPORT ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *sa, socklen_t sl)
{
    HOOK(rs_sock_send(s_, buf, n, flags, &plain_), rs_real.sendto(fd, buf, n, flags, sa, sl));
}

/* Gather writes: small pieces are coalesced into one record (a per-thread buffer), large
 * ones go straight to the ring.  Stops at the first short write. */
static ssize_t send_iov(struct rs_sock *s, const struct iovec *iov, int cnt, int flags, int *plain)
{
    ssize_t total = 0;
    int i = 0;
    *plain = 0;
    while (i < cnt) {
        const void *p;
        size_t n;
        int used = 1;
        if (iov[i].iov_len < RS_BOUNCE / 2 && i + 1 < cnt) {
            size_t fill = 0;
            int j = i;
            while (j < cnt && fill + iov[j].iov_len <= RS_BOUNCE) {
                memcpy(bounce + fill, iov[j].iov_base, iov[j].iov_len);
                fill += iov[j].iov_len;
                j++;
            }
            p = bounce; n = fill; used = j - i;
        } else {
            p = iov[i].iov_base; n = iov[i].iov_len;
        }
        if (n == 0) { i += used; continue; }
        /* a blocking socket queues everything, as TCP does; a nonblocking one what fits */
        ssize_t r = rs_sock_send(s, p, n, flags, plain);
        if (*plain) return plain_after(total, plain);
        if (r < 0) return total ? total : r;
        total += r;
        if ((size_t)r < n) break;
        i += used;
    }
    return total;
}

RS_EXPORT ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
    HOOK(send_iov(s_, iov, cnt, 0, &plain_), rs_real.writev(fd, iov, cnt));
}

/* Ancillary data goes to the kernel with none of the bytes: it checks it (and a TCP socket
 * has no use for it, as it would not over TCP); the bytes go to the ring. */
static ssize_t send_msg(struct rs_sock *s, const struct msghdr *m, int flags, int *plain)
{
    *plain = 0;
    for (struct cmsghdr *c = m->msg_controllen ? CMSG_FIRSTHDR(m) : NULL; c; c = CMSG_NXTHDR((struct msghdr *)m, c))
        if (rs_tx_stamps_asked(c->cmsg_level, c->cmsg_type, CMSG_DATA(c), c->cmsg_len - CMSG_LEN(0)))
            return rs_sock_move_tx(s, RS_REASON_TX_TIMESTAMPS, flags, plain);
    if (m->msg_controllen && rs_sock_state(s) == RS_RING) {
        struct msghdr ctl = *m;
        ctl.msg_iov = NULL;
        ctl.msg_iovlen = 0;
        if (rs_real.sendmsg(s->fd, &ctl, flags | MSG_DONTWAIT | MSG_NOSIGNAL) < 0) return -errno;
    }
    return send_iov(s, m->msg_iov, (int)m->msg_iovlen, flags, plain);
}

/* A socket of ours sent to another process goes to TCP first (rs_sock_passing). */
static void passing(const struct msghdr *m)
{
    if (m && m->msg_controllen && !rs_in_engine && rs_tracking()) passed_fds(m, rs_sock_passing);
}

RS_EXPORT ssize_t sendmsg(int fd, const struct msghdr *m, int flags)
{
    passing(m);
    HOOK(send_msg(s_, m, flags, &plain_), rs_real.sendmsg(fd, m, flags));
}

/* sendfile into an upgraded socket copies through the per-thread buffer. */
static ssize_t send_file(struct rs_sock *s, int in, off_t *off, size_t count, int *plain)
{
    ssize_t total = 0;
    *plain = 0;
    while ((size_t)total < count) {
        size_t want = count - (size_t)total < RS_BOUNCE ? count - (size_t)total : RS_BOUNCE;
        ssize_t got = off ? pread(in, bounce, want, *off) : rs_real.read(in, bounce, want);
        if (got < 0) return total ? total : -errno;
        if (got == 0) break;
        ssize_t w = rs_sock_send(s, bounce, (size_t)got, total ? MSG_DONTWAIT : 0, plain);
        if (*plain) {
            if (!off) lseek(in, -got, SEEK_CUR);
            return 0;
        }
        if (w < 0) {
            if (!off) lseek(in, -got, SEEK_CUR);
            return total ? total : w;
        }
        if (off) *off += w;
        else if (w < got) lseek(in, w - got, SEEK_CUR);
        total += w;
        if (w < got) break;
    }
    return total;
}

RS_EXPORT ssize_t sendfile(int out, int in, off_t *off, size_t count)
{
    int fd = out;
    HOOK(send_file(s_, in, off, count, &plain_), rs_real.sendfile(out, in, off, count));
}
RS_EXPORT ssize_t sendfile64(int out, int in, off_t *off, size_t count) __attribute__((alias("sendfile")));

/* The vector forms: each message is one recvmsg/sendmsg, as the kernel does them. */
static int recv_mmsg(struct rs_sock *s, struct mmsghdr *v, unsigned n, int flags, int *plain)
{
    unsigned i = 0;
    *plain = 0;
    for (; i < n; i++) {
        ssize_t r = recv_msg(s, &v[i].msg_hdr, flags, plain);
        if (*plain) return 0;
        if (r < 0) return i ? (int)i : (int)r;
        v[i].msg_len = (unsigned)r;
        if (flags & MSG_WAITFORONE) flags |= MSG_DONTWAIT;
    }
    return (int)i;
}

/* Each message of the vector forms may carry descriptors, as one of sendmsg/recvmsg. */
static int received_each(int r, struct mmsghdr *v)
{
    for (int i = 0; i < r; i++) received(0, &v[i].msg_hdr);
    return r;
}

RS_EXPORT int recvmmsg(int fd, struct mmsghdr *v, unsigned n, int flags, struct timespec *tmo)
{
    HOOK(recv_mmsg(s_, v, n, flags, &plain_), received_each(rs_real.recvmmsg(fd, v, n, flags, tmo), v));
}

static int send_mmsg(struct rs_sock *s, struct mmsghdr *v, unsigned n, int flags, int *plain)
{
    unsigned i = 0;
    *plain = 0;
    for (; i < n; i++) {
        ssize_t r = send_msg(s, &v[i].msg_hdr, flags, plain);
        if (*plain) return 0;
        if (r < 0) return i ? (int)i : (int)r;
        v[i].msg_len = (unsigned)r;
    }
    return (int)i;
}

RS_EXPORT int sendmmsg(int fd, struct mmsghdr *v, unsigned n, int flags)
{
    for (unsigned i = 0; v && i < n; i++) passing(&v[i].msg_hdr);
    HOOK(send_mmsg(s_, v, n, flags, &plain_), rs_real.sendmmsg(fd, v, n, flags));
}

/* preadv2/pwritev2 at offset -1 are readv/writev (RWF_NOWAIT: MSG_DONTWAIT); any other
 * offset on a socket is the kernel's ESPIPE. */
static ssize_t rw_flags(int rwf)
{
    return rwf & RWF_NOWAIT ? MSG_DONTWAIT : 0;
}

RS_EXPORT ssize_t preadv2(int fd, const struct iovec *iov, int cnt, off_t off, int rwf)
{
    if (off != -1) {
        if (!rs_real.read) rs_real_init();
        return rs_real.preadv2(fd, iov, cnt, off, rwf);
    }
    HOOK(recv_iov(s_, iov, cnt, (int)rw_flags(rwf), &plain_), rs_real.preadv2(fd, iov, cnt, off, rwf));
}

RS_EXPORT ssize_t pwritev2(int fd, const struct iovec *iov, int cnt, off_t off, int rwf)
{
    if (off != -1) {
        if (!rs_real.read) rs_real_init();
        return rs_real.pwritev2(fd, iov, cnt, off, rwf);
    }
    HOOK(send_iov(s_, iov, cnt, (int)rw_flags(rwf), &plain_), rs_real.pwritev2(fd, iov, cnt, off, rwf));
}
RS_EXPORT ssize_t preadv64v2(int, const struct iovec *, int, off_t, int) __attribute__((alias("preadv2")));
RS_EXPORT ssize_t pwritev64v2(int, const struct iovec *, int, off_t, int) __attribute__((alias("pwritev2")));

/* splice out of an upgraded socket: carried.  The ring's bytes are peeked, written to the
 * pipe (without blocking, no more than one pipe buffer takes: SPLICE_F_NONBLOCK), and
 * only what the pipe took is consumed. */
static ssize_t splice_from(struct rs_sock *s, int pipe_fd, size_t len, unsigned flags, int *plain)
{
    size_t n = len < RS_BOUNCE ? len : RS_BOUNCE;
    if (flags & SPLICE_F_NONBLOCK) {
        struct pollfd p = { .fd = pipe_fd, .events = POLLOUT };
        if (rs_real.poll(&p, 1, 0) == 0) return -EAGAIN;
        if (n > PIPE_BUF) n = PIPE_BUF;             /* fits the free buffer POLLOUT promised */
    }
    ssize_t r = rs_sock_recv(s, bounce, n, MSG_PEEK, plain);
    if (*plain || r <= 0) return r;
    ssize_t w = rs_real.write(pipe_fd, bounce, (size_t)r);
    if (w <= 0) return w < 0 ? -errno : 0;
    return rs_sock_recv(s, NULL, (size_t)w, MSG_TRUNC | MSG_DONTWAIT, plain);
}

/* splice into an upgraded socket: only the kernel splices into a TCP socket, so the
 * connection moves there first (reason splice) and the kernel's splice follows. */
RS_EXPORT ssize_t splice(int in, loff_t *off_in, int out, loff_t *off_out, size_t len, unsigned flags)
{
    if (!rs_real.read) rs_real_init();
    struct rs_sock *s;
    int plain = 1;
    ssize_t r = 0;
    if ((s = tracked(in))) {
        r = splice_from(s, out, len, flags, &plain);
        rs_sock_put(s);
    } else if ((s = tracked(out))) {
        r = rs_sock_move_tx(s, RS_REASON_SPLICE, flags & SPLICE_F_NONBLOCK ? MSG_DONTWAIT : 0, &plain);
        rs_sock_put(s);
    }
    if (!plain) return result(r);
    return rs_real.splice(in, off_in, out, off_out, len, flags);
}

/* glibc's fortified entry points (-D_FORTIFY_SOURCE) call these instead. */
RS_EXPORT ssize_t __read_chk(int fd, void *buf, size_t n, size_t buflen)
{
    if (n > buflen) abort();
    return read(fd, buf, n);
}
RS_EXPORT ssize_t __recv_chk(int fd, void *buf, size_t n, size_t buflen, int flags)
{
    if (n > buflen) abort();
    return recv(fd, buf, n, flags);
}
RS_EXPORT ssize_t __recvfrom_chk(int fd, void *buf, size_t n, size_t buflen, int flags, struct sockaddr *sa, socklen_t *sl)
{
    if (n > buflen) abort();
    return recvfrom(fd, buf, n, flags, sa, sl);
}
