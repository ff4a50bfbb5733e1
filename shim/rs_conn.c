/* rs_conn.c - what every connection has, whatever its transport: its socket, its
 * sticky error, its allocation and its end. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "rs_conn.h"
#include "rs_sys.h"

/* The socket moves to another descriptor (the application closed the number we used):
 * from now on calls use newfd, and this returns once no short call still uses the old
 * one, so the caller may close it. */
void rs_conn_move_fd(rs_conn *c, int newfd)
{
    __atomic_store_n(&c->fd, newfd, __ATOMIC_SEQ_CST);
    for (unsigned i = 0; __atomic_load_n(&c->fd_users, __ATOMIC_SEQ_CST); i++)
        if (i > 64) sched_yield();                  /* a non-blocking call: microseconds */
}

/* In a child after fork, threads that held the connection's locks do not exist. */
void rs_conn_after_fork_child(rs_conn *c)
{
    c->fd_users = 0;
    c->rx.lock.v = c->tx.lock.v = 0;
    c->rx.quiet_sleepers = 0;                   /* the threads asleep in receives are the parent's */
    c->ops->after_fork_child(c);
}

long rs_c_send(rs_conn *c, const void *b, size_t n, int flags)
{
    long r = rs_sys_send(rs_fd_enter(c), b, n, flags | MSG_DONTWAIT);
    rs_fd_leave(c);
    return r;
}

long rs_c_recv(rs_conn *c, void *b, size_t n, int flags)
{
    long r = rs_sys_recv(rs_fd_enter(c), b, n, flags | MSG_DONTWAIT);
    rs_fd_leave(c);
    return r;
}

/* poll(2) on the connection's socket.  Returns the poll result; a wait cut short because
 * the socket moved to another descriptor returns 0 with *revents 0 (look again). */
int rs_c_poll(rs_conn *c, short events, int timeout_ms, short *revents)
{
    int fd = rs_fd_peek(c);
    struct pollfd p = { .fd = fd, .events = events };
    int r = rs_sys_poll(&p, 1, timeout_ms);
    if (rs_fd_peek(c) != fd) { *revents = 0; return 0; }
    *revents = r > 0 ? p.revents : 0;
    return r;
}

int rs_c_sockerr(rs_conn *c)
{
    int e = rs_sys_sockerr(rs_fd_enter(c));
    rs_fd_leave(c);
    return e;
}

/* A zeroed connection, aligned for the cache-line-aligned locks in it. */
rs_conn *rs_conn_alloc(void)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, sizeof(rs_conn))) return NULL;
    memset(p, 0, sizeof(rs_conn));
    ((rs_conn *)p)->rx.flags_unseen = 1;       /* until a front-end that sees fcntl says otherwise */
    ((rs_conn *)p)->ops = &rs_transport_tcp;   /* until a ring transport attaches */
    ((rs_conn *)p)->rx.bell_fd = ((rs_conn *)p)->tx.bell_fd = -1;    /* no event bells (rs_bells.c) */
    return p;
}

/* Sizes of both rings.  With `windowed` (rings whose pages are committed as they are
 * touched: shm), the producer starts with a small window and the consumer returns credit
 * at a quarter of it; both grow with the traffic (rs_produce.c).  Registered rdma rings
 * are pinned whole, so a window would save nothing there. */
void rs_conn_set_ring(rs_conn *c, uint32_t ring_size, int windowed)
{
    c->ring_size = ring_size;
    c->mask = ring_size - 1;
    c->max_payload = rs_max_payload(ring_size);
    c->tx.window = !windowed || ring_size < RS_WINDOW_MIN ? ring_size : RS_WINDOW_MIN;
    c->tx.window_max = ring_size;
    c->rx.credit_lag = c->tx.window / 4;      /* the peer's window starts as ours, until its WRAPs show it */
}

void rs_conn_free(rs_conn *c)
{
    if (!c) return;
    rs_hold_unlist(c);
    c->ops->free(c);
    rs_hold_free(c);
    if (c->map_base) rs_ring_unmap(c->map_base, c->map_len);
    free(c);
}

/* One line of the connection's state, read without its locks (a snapshot of moving
 * values), for whoever wonders why a call on it waits: both directions' positions, what
 * is held, the control words, then the transport's own.  Returns the length written. */
int rs_conn_describe(rs_conn *c, char *buf, size_t n)
{
    int k = snprintf(buf, n, "%s ring=%u; tx: pos=%llu credit=%llu bytes=%llu window=%u waiting=%u fin=%u; "
                     "rx: pos=%llu published=%llu bytes=%llu in_record=%u held=%llu want_bell=%u fin=%u pre=%u; "
                     "fallback=%u err=%d tcp_eof=%u switch_due=%u",
                     c->ops->name, c->ring_size, RS_SEEN(c->tx.pos), RS_SEEN(c->tx.head_seen), RS_SEEN(c->tx.bytes),
                     c->tx.window, c->tx.ctl ? (unsigned)RS_SEEN(c->tx.ctl->tx_waiting) : 0, c->tx.fin_sent,
                     RS_SEEN(c->rx.pos), RS_SEEN(c->rx.head_pub), RS_SEEN(c->rx.bytes), (unsigned)RS_SEEN(c->rx.cur_len),
                     RS_SEEN(c->rx.hold_len), c->rx.ctl ? (unsigned)RS_SEEN(c->rx.ctl->want_bell) : 0, c->rx.fin_seen,
                     c->rx.pre.active, RS_GET(c->fb), RS_GET(c->err), RS_GET(c->tcp_eof), RS_GET(c->switch_due));
    if (k < 0 || (size_t)k >= n) return k < 0 ? 0 : (int)n - 1;
    if (c->ops->describe) k += c->ops->describe(c, buf + k, n - (size_t)k);
    return k;
}

long rs_conn_app_flags(rs_conn *c)
{
    if (!c->rx.flags_unseen) return -1;
    long fl = rs_syscall(SYS_fcntl, rs_fd_peek(c), F_GETFL);
    return fl < 0 ? -1 : fl;
}

int rs_conn_app_nonblocking(rs_conn *c)
{
    long fl = rs_conn_app_flags(c);
    return fl >= 0 && (fl & O_NONBLOCK);
}

const char *rs_conn_errmsg(const rs_conn *c) { return c->errmsg; }

/* Changes that no doorbell announces: a connection became readable, or needs a waiter to
 * push its bytes, without the peer ringing anything (an error found here, a move to TCP
 * begun, a SWITCH still to send, our own SHUT_RD, a receive that let the producer skip its
 * bell while it spun).  The preload's epoll passes over members armed and silent since
 * (rs_hooks_epoll.c) only while this count stands still.  All rare: none is per message. */
static uint64_t silent_changes;
void rs_note_silent_change(void) { __atomic_add_fetch(&silent_changes, 1, __ATOMIC_SEQ_CST); }
uint64_t rs_silent_changes(void) { return __atomic_load_n(&silent_changes, __ATOMIC_SEQ_CST); }

void (*rs_conn_failed)(const rs_conn *c);

/* Records the first error only: later failures are consequences of it.  Any thread may
 * call it: one wins, writes the message, then publishes the error, and the host says it
 * where its user looks (rs_conn_failed). */
void rs_conn_set_error(rs_conn *c, int err, const char *fmt, ...)
{
    if (RS_GET(c->err) || __atomic_exchange_n(&c->err_claimed, 1, __ATOMIC_ACQ_REL)) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->errmsg, sizeof c->errmsg, fmt, ap);
    va_end(ap);
    RS_SET(c->err, err);
    rs_note_silent_change();
    if (rs_conn_failed) rs_conn_failed(c);
}

/* The peer reset the connection.  TCP reports that once (ECONNRESET), to whichever call
 * comes first; after it, reads see the end of the stream and writes EPIPE.  Returns
 * -ECONNRESET the first time, 0 after. */
int rs_conn_reset_once(rs_conn *c)
{
    return __atomic_exchange_n(&c->reset_reported, 1, __ATOMIC_ACQ_REL) ? 0 : -ECONNRESET;
}

/* recvfrom(2) for the control plane: Python's socket.recv waits for the socket's timeout
 * before honouring MSG_DONTWAIT, which the handshake reader must not do. */
long rs_fd_recv(int fd, void *buf, size_t n, int flags)
{
    return rs_sys_recv(fd, buf, n, flags);
}
