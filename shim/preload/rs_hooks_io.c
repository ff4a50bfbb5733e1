/* rs_hooks_io.c - data calls.  On a descriptor we do not track (or one that stayed plain
 * TCP) each hook is one table lookup and the real call.  On an upgraded one the data goes
 * through the ring (shim/rs_produce.c, rs_consume.c) with no system call while the ring
 * has room or data. */
#include "rs_preload.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define RS_HS_WRITE_WAIT_MS 5000      /* a server's write waits this long for the HELLO */
#define RS_BOUNCE 16384               /* writev/sendfile coalescing buffer, per thread */

static __thread uint8_t bounce[RS_BOUNCE];

static inline int tracked(int fd, struct rs_link **lp)
{
    struct rs_link *l = rs_link_of(fd);
    if (__builtin_expect(!l, 1) || rs_in_engine) return 0;
    int s = __atomic_load_n(&l->state, __ATOMIC_ACQUIRE);
    if (s == RS_PLAIN || s == RS_LISTEN) return 0;
    *lp = l;
    return 1;
}

int rs_io_prepare(int fd, struct rs_link *l, int for_write)
{
    int s = __atomic_load_n(&l->state, __ATOMIC_ACQUIRE);
    if (s == RS_CLIENT_HS) {
        if (rs_step(fd, l, for_write || l->nonblock ? 0 : -1)) return l->state;
        if (for_write) {
            if (l->hello_pending) { errno = EAGAIN; return -1; }   /* connect still in progress */
            return RS_CLIENT_HS;                                  /* preamble frame */
        }
        errno = EAGAIN;
        return -1;
    }
    if (s == RS_SERVER_HS) {
        int wait = for_write ? RS_HS_WRITE_WAIT_MS : l->nonblock ? 0 : -1;
        if (rs_step(fd, l, wait)) return l->state;
        if (for_write) {
            l->state = RS_BROKEN;
            l->err = ETIMEDOUT;
            errno = ETIMEDOUT;
            return -1;
        }
        errno = EAGAIN;
        return -1;
    }
    return s;
}

static void end_preamble(struct rs_link *l)
{
    pthread_mutex_lock(&l->lock);
    if (l->state == RS_PRE_RX && !l->conn->rx_pre) {
        rs_conn *c = l->conn;
        l->state = RS_PLAIN;
        l->conn = NULL;
        rs_conn_free(c);
    }
    pthread_mutex_unlock(&l->lock);
}

enum { VIA_READ, VIA_RECV };

/* Receive on a tracked fd.  Returns bytes, or -1 with errno; *plain = 1 if the caller
 * must make the real call instead. */
static ssize_t do_recv(int fd, struct rs_link *l, void *buf, size_t n, int flags, int *plain)
{
    int s = rs_io_prepare(fd, l, 0);
    *plain = 0;
    if (s < 0) return -1;
    if (s == RS_BROKEN) { errno = l->err; return -1; }
    if (s != RS_RING && s != RS_PRE_RX) { *plain = 1; return 0; }
    int nb = l->nonblock || (flags & MSG_DONTWAIT);
    ssize_t r = rs_recv(l->conn, buf, n, flags & (MSG_PEEK | MSG_WAITALL | MSG_DONTWAIT), nb ? 0 : -1);
    if (s == RS_PRE_RX && !l->conn->rx_pre) end_preamble(l);
    else if (__builtin_expect(l->conn->fb, 0)) rs_note_fallback(l);
    if (r < 0) { errno = (int)-r; return -1; }
    if (l->stat && !(flags & MSG_PEEK)) l->stat->rx_bytes += (uint64_t)r;
    return r;
}

/* A client's write before the server's answer: one preamble frame, under the link lock so
 * another thread's SWITCH never lands inside it; waiting for room happens outside the
 * lock, so a reader thread can take the answer meanwhile.  *state is updated if the
 * handshake finished (then nothing was sent). */
static ssize_t send_preamble(int fd, struct rs_link *l, const void *buf, size_t n, int nb, int *state)
{
    for (;;) {
        pthread_mutex_lock(&l->lock);
        int s = l->state;
        ssize_t r = s == RS_CLIENT_HS ? rs_pre_send(fd, buf, n, 1, 0) : 0;
        pthread_mutex_unlock(&l->lock);
        if (s != RS_CLIENT_HS) { *state = s; return 0; }
        if (r != -EAGAIN && r != -EINTR) return r;
        if (nb) return -EAGAIN;
        struct pollfd p = { .fd = fd, .events = POLLOUT | POLLIN };
        rs_real.poll(&p, 1, 50);
        if (rs_step(fd, l, 0)) { *state = l->state; return 0; }
    }
}

static void sigpipe_unless(int flags)
{
    if (!(flags & MSG_NOSIGNAL)) raise(SIGPIPE);
}

static ssize_t do_send(int fd, struct rs_link *l, const void *buf, size_t n, int flags, int *plain)
{
    int s = rs_io_prepare(fd, l, 1);
    *plain = 0;
    if (s < 0) return -1;
    if (s == RS_BROKEN) { errno = l->err; return -1; }
    int nb = l->nonblock || (flags & MSG_DONTWAIT);
    ssize_t r = 0;
    if (s == RS_CLIENT_HS) r = send_preamble(fd, l, buf, n, nb, &s);
    if (s == RS_BROKEN) { errno = l->err; return -1; }
    if (s == RS_RING) {
        r = rs_send(l->conn, buf, n, nb, -1);
        if (__builtin_expect(l->conn->fb, 0)) rs_note_fallback(l);
    }
    else if (s != RS_CLIENT_HS) { *plain = 1; return 0; }
    if (r < 0) {
        if (r == -EPIPE) sigpipe_unless(flags);
        errno = (int)-r;
        return -1;
    }
    if (l->stat) l->stat->tx_bytes += (uint64_t)r;
    return r;
}

RS_EXPORT ssize_t read(int fd, void *buf, size_t n)
{
    struct rs_link *l;
    int plain;
    if (tracked(fd, &l)) { ssize_t r = do_recv(fd, l, buf, n, 0, &plain); if (!plain) return r; }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.read(fd, buf, n);
}

RS_EXPORT ssize_t recv(int fd, void *buf, size_t n, int flags)
{
    struct rs_link *l;
    int plain;
    if (tracked(fd, &l)) { ssize_t r = do_recv(fd, l, buf, n, flags, &plain); if (!plain) return r; }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.recv(fd, buf, n, flags);
}

RS_EXPORT ssize_t recvfrom(int fd, void *buf, size_t n, int flags, struct sockaddr *sa, socklen_t *sl)
{
    struct rs_link *l;
    int plain;
    if (tracked(fd, &l)) {
        ssize_t r = do_recv(fd, l, buf, n, flags, &plain);
        if (!plain) { if (sl) *sl = 0; return r; }     /* connected stream: no address */
    }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.recvfrom(fd, buf, n, flags, sa, sl);
}

/* Scatter reads: the first buffer may wait, the rest take what is already there. */
static ssize_t recv_iov(int fd, struct rs_link *l, const struct iovec *iov, int cnt, int flags, int *plain)
{
    ssize_t total = 0;
    for (int i = 0; i < cnt; i++) {
        if (!iov[i].iov_len) continue;
        /* MSG_WAITALL fills every buffer; otherwise only the first one may wait */
        int fl = total && !(flags & MSG_WAITALL) ? flags | MSG_DONTWAIT : flags;
        ssize_t r = do_recv(fd, l, iov[i].iov_base, iov[i].iov_len, fl, plain);
        if (*plain) return 0;
        if (r < 0) return total ? total : -1;
        total += r;
        if ((size_t)r < iov[i].iov_len || (flags & MSG_PEEK)) break;
    }
    return total;
}

RS_EXPORT ssize_t readv(int fd, const struct iovec *iov, int cnt)
{
    struct rs_link *l;
    int plain;
    if (tracked(fd, &l)) { ssize_t r = recv_iov(fd, l, iov, cnt, 0, &plain); if (!plain) return r; }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.readv(fd, iov, cnt);
}

RS_EXPORT ssize_t recvmsg(int fd, struct msghdr *m, int flags)
{
    struct rs_link *l;
    int plain;
    if (tracked(fd, &l)) {
        ssize_t r = recv_iov(fd, l, m->msg_iov, (int)m->msg_iovlen, flags, &plain);
        if (!plain) {
            m->msg_namelen = 0;
            m->msg_controllen = 0;
            m->msg_flags = 0;
            return r;
        }
    }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.recvmsg(fd, m, flags);
}

RS_EXPORT ssize_t write(int fd, const void *buf, size_t n)
{
    struct rs_link *l;
    int plain;
    if (tracked(fd, &l)) { ssize_t r = do_send(fd, l, buf, n, 0, &plain); if (!plain) return r; }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.write(fd, buf, n);
}

RS_EXPORT ssize_t send(int fd, const void *buf, size_t n, int flags)
{
    struct rs_link *l;
    int plain;
    if (tracked(fd, &l)) { ssize_t r = do_send(fd, l, buf, n, flags, &plain); if (!plain) return r; }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.send(fd, buf, n, flags);
}

RS_EXPORT ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *sa, socklen_t sl)
{
    struct rs_link *l;
    int plain;
    if (tracked(fd, &l)) { ssize_t r = do_send(fd, l, buf, n, flags, &plain); if (!plain) return r; }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.sendto(fd, buf, n, flags, sa, sl);
}

/* Gather writes: small pieces are coalesced into one record (a per-thread buffer), large
 * ones go straight to the ring.  Stops at the first short write. */
static ssize_t send_iov(int fd, struct rs_link *l, const struct iovec *iov, int cnt, int flags, int *plain)
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
        ssize_t r = do_send(fd, l, p, n, flags, plain);
        if (*plain) return 0;
        if (r < 0) return total ? total : -1;
        total += r;
        if ((size_t)r < n) break;
        i += used;
    }
    return total;
}

RS_EXPORT ssize_t writev(int fd, const struct iovec *iov, int cnt)
{
    struct rs_link *l;
    int plain;
    if (tracked(fd, &l)) { ssize_t r = send_iov(fd, l, iov, cnt, 0, &plain); if (!plain) return r; }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.writev(fd, iov, cnt);
}

RS_EXPORT ssize_t sendmsg(int fd, const struct msghdr *m, int flags)
{
    struct rs_link *l;
    int plain;
    if (tracked(fd, &l)) {
        if (m->msg_controllen && __atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == RS_RING) {
            errno = EOPNOTSUPP;                     /* ancillary data has no ring equivalent */
            return -1;
        }
        ssize_t r = send_iov(fd, l, m->msg_iov, (int)m->msg_iovlen, flags, &plain);
        if (!plain) return r;
    }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.sendmsg(fd, m, flags);
}

RS_EXPORT ssize_t sendfile(int out, int in, off_t *off, size_t count)
{
    struct rs_link *l;
    int plain = 1;
    if (tracked(out, &l)) {
        ssize_t total = 0;
        while ((size_t)total < count) {
            size_t want = count - (size_t)total < RS_BOUNCE ? count - (size_t)total : RS_BOUNCE;
            ssize_t got = off ? pread(in, bounce, want, *off) : rs_real.read(in, bounce, want);
            if (got < 0) return total ? total : -1;
            if (got == 0) break;
            ssize_t w = do_send(out, l, bounce, (size_t)got, total ? MSG_DONTWAIT : 0, &plain);
            if (plain) break;
            if (w < 0) {
                if (!off) lseek(in, -got, SEEK_CUR);
                return total ? total : -1;
            }
            if (off) *off += w;
            else if (w < got) lseek(in, w - got, SEEK_CUR);
            total += w;
            if (w < got) break;
        }
        if (!plain) return total;
    }
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    return rs_real.sendfile(out, in, off, count);
}
RS_EXPORT ssize_t sendfile64(int out, int in, off_t *off, size_t count) __attribute__((alias("sendfile")));

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
