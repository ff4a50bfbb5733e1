/* rs_doorbell.c - readiness: doorbell bytes on the TCP socket, going idle, sleeping.
 *
 * The application's TCP socket stays the one descriptor anybody waits on.  A consumer that
 * finds its ring empty asks the producer, through its transport (c->ops->go_idle), for a
 * doorbell byte with the next record, so select/poll/epoll on the socket see it readable;
 * a producer waiting for credit asks the consumer the same way (c->ops->arm_credit).  This
 * file holds what every transport shares: the entry points the data path calls, sending
 * one doorbell byte, the scan of what the socket holds, and the sleep on the socket.
 * Invariant kept for every caller: whenever records are unconsumed and nobody is inside
 * recv, at least one doorbell byte is pending.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include "rs_conn.h"
#include "rs_sys.h"

/* One doorbell byte of `kind` on the socket, never before our SWITCH frame.  1 if it left;
 * 0 if not (a full socket: the caller's next chance tries again; or a closed one, which
 * sets tcp_eof). */
int rs_bell_send(rs_conn *c, uint8_t kind)
{
    long r = rs_tx_switch(c) ? rs_c_send(c, &kind, 1, MSG_DONTWAIT | MSG_NOSIGNAL) : -EAGAIN;
    if (r == 1) { __atomic_fetch_add(&c->bells_sent, 1, __ATOMIC_RELAXED); return 1; }
    if (r == -EPIPE || r == -ECONNRESET || r == -ENOTCONN) RS_SET(c->tcp_eof, 1);
    return 0;
}

/* The doorbell scan: how many of the n bytes peeked off the socket (buf) are doorbells,
 * counted by kind into kinds[0] (data) and kinds[1] (credit) if given.  *next is what
 * follows them: -1 nothing (all n are doorbells), RS_BELL_RESYNC (the peer's direction
 * moved to TCP: the frame and what follows are its stream), RS_BELL_SPILL (a SPILL mark,
 * then stream bytes: rs_spill.c), or a garbage byte. */
long rs_bell_scan(const uint8_t *buf, long n, int *next, uint64_t *kinds)
{
    long k = 0;
    for (; k < n && (buf[k] == RS_BELL_DATA || buf[k] == RS_BELL_CREDIT); k++)
        if (kinds) kinds[buf[k] == RS_BELL_CREDIT]++;
    *next = k < n ? buf[k] : -1;
    return k;
}

/* A byte on the doorbell channel that is neither a doorbell nor a RESYNC frame. */
void rs_bell_garbage(rs_conn *c, int byte)
{
    rs_conn_set_error(c, EPROTO, "rdmasock: garbage byte 0x%02x on the doorbell channel", byte);
}

/* What a recv on the doorbell channel said: 1 bytes came, 0 nothing more (EAGAIN), -1 the
 * socket ended (tcp_eof set, and the error if it was one). */
int rs_bell_read_result(rs_conn *c, long n)
{
    if (n > 0) return 1;
    if (n == -EAGAIN || n == -EINTR) return 0;
    if (n == 0 && c->rx.shut_rd) return 0;                 /* our own SHUT_RD, not the peer */
    if (n < 0) rs_note_sock_error(c, (int)-n);
    RS_SET(c->tcp_eof, 1);
    return -1;
}

/* ---- entry points of the data path --------------------------------------------------- */

/* Producer side (caller holds tx_lock): records were written; they reach the peer and the
 * consumer is woken if it asked for it. */
void rs_tx_flush_bell(rs_conn *c)
{
    rs_tx_switch(c);                                    /* our first records are out */
    if (c->tx.move.state) return;                               /* after a RESYNC frame only the stream */
    c->ops->flush(c);
}

/* Producer with a full ring, before it sleeps: ask the consumer for a credit doorbell
 * (caller holds tx_lock).  Returns 1 if there is room after all. */
int rs_tx_arm_credit_locked(rs_conn *c)
{
    if (RS_GET(c->fb)) return rs_fb_tx_writable(c);
    return c->ops->arm_credit(c);
}

int rs_tx_arm_credit(rs_conn *c)
{
    rs_lock(&c->tx.lock);
    int r = rs_tx_arm_credit_locked(c);
    rs_unlock(&c->tx.lock);
    return r;
}

static void bell_every_locked(rs_conn *c, int on)
{
    c->rx.bell_every = (uint8_t)(on != 0);
    c->ops->bell_every(c, on);
}

/* Whether the program takes SIGIO, where its fcntl calls are not seen: asked of the
 * socket before each idle period, the only moment a doorbell could be missed for it.
 * `fl`: the descriptor's flags as the caller just read them (rs_conn_app_flags), -1 not. */
static void see_async_flag(rs_conn *c, long fl)
{
    if (!c->rx.flags_unseen) return;
    if (fl < 0) fl = rs_syscall(SYS_fcntl, rs_fd_peek(c), F_GETFL);
    if (fl >= 0 && !(fl & O_ASYNC) != !c->rx.bell_every) bell_every_locked(c, (fl & O_ASYNC) != 0);
}

/* Called by a consumer that found its ring empty (caller holds rx_lock).  Returns 1 if a
 * record is there after all (consume it), 0 if the connection is idle: the producer will
 * ring for the next record, and every doorbell byte sent before that moment has been read
 * off the socket. */
static int go_idle_locked(rs_conn *c, int event, long app_flags)
{
    /* Held bytes (rs_hold.c) are data: the doorbells that announced them must stay on the
     * socket, for another thread of the program asleep in poll or recv on it. */
    if (__atomic_load_n(&c->rx.hold_len, __ATOMIC_SEQ_CST)) return 1;
    see_async_flag(c, app_flags);
    if (c->rx.pre.active) return 0;                            /* preamble bytes on the socket are data */
    return event && c->ops->go_idle_event ? c->ops->go_idle_event(c) : c->ops->go_idle(c);
}

int rs_rx_go_idle_locked(rs_conn *c, long app_flags) { return go_idle_locked(c, 0, app_flags); }

/* A blocking receive found its ring empty (caller holds rx_lock) and may sleep on a word
 * the peer raises with its next record (c->ops->arm_word) instead of on the socket.
 * `room`: bytes the receive will take of what comes (0: maybe none, a peek).  Returns 1 a
 * record is there after all, 0 armed: sleep on *word while it holds *seen, 2 the same,
 * armed quietly: rs_rx_word_woken_locked once the sleep ends, -1 not here (preamble bytes
 * on the socket, or no such word): go idle on the socket. */
int rs_rx_arm_word_locked(rs_conn *c, const uint32_t **word, uint32_t *seen, size_t room, long app_flags)
{
    if (__atomic_load_n(&c->rx.hold_len, __ATOMIC_SEQ_CST)) return 1;
    if (c->rx.pre.active) return -1;
    see_async_flag(c, app_flags);
    return c->ops->arm_word(c, word, seen, room);
}

/* A receive armed quietly (arm_word returned 2) is out of its sleep, whatever ended it
 * (caller holds rx_lock).  1: records came that rang no doorbell byte; this receive takes
 * them before it returns (it has the room it declared). */
int rs_rx_word_woken_locked(rs_conn *c)
{
    return c->ops->word_woken ? c->ops->word_woken(c) : 0;
}

int rs_rx_go_idle(rs_conn *c)
{
    rs_lock(&c->rx.lock);
    int r = go_idle_locked(c, 0, -1);
    rs_unlock(&c->rx.lock);
    return r;
}

/* The same for a wait that our event bell wakes, as well as the socket (an epoll instance
 * it was added to, rs_bell_in_epoll). */
int rs_rx_go_idle_event(rs_conn *c)
{
    rs_lock(&c->rx.lock);
    int r = go_idle_locked(c, 1, -1);
    rs_unlock(&c->rx.lock);
    return r;
}

/* A non-blocking receive found the ring empty: 1 if a record is there after all. */
int rs_rx_nonblock_empty(rs_conn *c)
{
    if (__atomic_load_n(&c->rx.hold_len, __ATOMIC_SEQ_CST)) return 1;
    if (c->rx.move.state) return rs_fb_rx_ready(c);
    if (!c->rx.lazy_tidy || c->rx.pre.active) return rs_rx_go_idle_locked(c, -1);
    return c->ops->nonblock_empty(c);
}

/* After a recv emptied the ring (caller holds rx_lock). */
void rs_rx_tidy(rs_conn *c)
{
    if (c->rx.pre.active || c->rx.move.state) return;
    c->ops->tidy(c);
}

/* The kernel reported the socket readable and the ring has nothing new: doorbells of
 * records already consumed, which lazy_tidy leaves there, or the peer's end, or garbage.
 * A level-triggered epoll reports stale bells at every call until they are read, a cost
 * per call that grows with the number of idle connections: they are read now, and no new
 * one is asked for (the hooks arm before they sleep).  The rest is looked at now, once per
 * report (an epoll wait armed with go_idle_event does not peek on its own).  Only under
 * lazy_tidy: otherwise a wait we do not see (another epoll instance, SIGIO) may rely on
 * the next record's doorbell. */
void rs_rx_drop_stale_bells(rs_conn *c)
{
    rs_lock(&c->rx.lock);
    if (c->rx.lazy_tidy && !c->rx.pre.active && !c->rx.move.state && !__atomic_load_n(&c->rx.hold_len, __ATOMIC_SEQ_CST))
        c->ops->drop_stale(c);
    rs_unlock(&c->rx.lock);
}

/* O_ASYNC set (on) or cleared on the socket.  The kernel raises SIGIO for every arrival
 * of data, not only for the first after a read, so the producer is asked for a doorbell
 * after every publication, whatever else it knows of us.  Extra doorbells are harmless:
 * they are counted and drained like any other. */
void rs_rx_bell_every(rs_conn *c, int on)
{
    rs_lock(&c->rx.lock);
    bell_every_locked(c, on);
    rs_unlock(&c->rx.lock);
}

/* Before the application's close: the peer is told that no doorbell is wanted any more,
 * and those it already sent are read off the socket, so that the kernel's close does not
 * turn into a reset over bytes that were only ours.  A reset would throw away what is
 * still in flight to the peer, which after a move to TCP (6.8) is stream data. */
void rs_quiesce_bells(rs_conn *c)
{
    /* Preamble frames still unread (a lazy client that never switched) hide its doorbell
     * bytes, which therefore stay; the request is withdrawn all the same, or the client's
     * next record (its FIN, at its close) would ring into our closed socket and the kernel
     * would answer with a reset. */
    int unread = RS_GET(c->rx.pre.active) && !rs_pre_quiesce(c, RS_QUIESCE_NS);
    if (RS_GET(c->tcp_eof)) return;
    if (!unread && rs_rx_on_tcp(c)) { rs_fb_settle_rx(c); return; }
    rs_lock(&c->rx.lock);
    if (!c->rx.move.state) c->ops->quiesce(c);                  /* not once the socket is the peer's stream */
    rs_unlock(&c->rx.lock);
}

/* ---- the socket -------------------------------------------------------------------- */

/* An error e on the TCP socket (0: read it from SO_ERROR, which reading clears): a peer
 * host that vanished (keepalive timed out, unreachable) is an error of the connection, not
 * an end of stream (a reset is not: stray doorbell bytes make a closing peer send one). */
void rs_note_sock_error(rs_conn *c, int e)
{
    if (!e) e = rs_c_sockerr(c);
    if (e == ETIMEDOUT || e == EHOSTUNREACH || e == ENETUNREACH)
        rs_conn_set_error(c, e, "rdmasock: the connection's TCP socket failed: %s", strerror(e));
}

/* The peer's RESYNC frame waits on the socket behind doorbell bytes: its direction moved
 * to TCP (its MOVED record is in our ring), so a TCP FIN after it is a half-close.  Not
 * known while the client's preamble frames are still unread in front (megabytes, if it
 * wrote before the handshake ended): its SWITCH, doorbells and any RESYNC frame follow
 * them, and the preamble's reader tells an end of the stream there (rs_preamble.c). */
static int peer_moved(rs_conn *c)
{
    if (RS_GET(c->rx.pre.active)) return 1;
    uint8_t buf[4096];
    long n = rs_c_recv(c, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    int next;
    long k = rs_bell_scan(buf, n, &next, NULL);
    if (k == (long)sizeof buf) return 1;        /* only doorbells in view: not known yet, not gone */
    return next == RS_BELL_RESYNC;
}

/* Without blocking: does the TCP socket say that the peer is gone?  An upgraded peer never
 * ends the TCP stream while it lives (its FIN travels as a record), so the kernel's end of
 * stream or reset means its socket is closed: its process died or closed the connection.
 * Not so after our own shutdown(SHUT_RD) (then the kernel reports an end of stream of its
 * own), nor once the peer's direction moved to TCP or ended there, inside a preamble
 * frame (then a TCP FIN is its half-close). */
int rs_peer_gone(rs_conn *c)
{
    if (RS_GET(c->tcp_eof)) return 1;
    short re;
    if (rs_c_poll(c, POLLRDHUP, 0, &re) <= 0) return 0;
    if (re & POLLERR) rs_note_sock_error(c, 0);
    if (re & (POLLHUP | POLLERR | POLLNVAL)) RS_SET(c->tcp_eof, 1);
    else if ((re & POLLRDHUP) && !rs_rx_on_tcp(c) && !peer_moved(c) && !RS_GET(c->rx.pre.ended)) {
        if (!RS_GET(c->rx.shut_rd)) {
            RS_SET(c->tcp_eof, 1);
        } else {
            struct tcp_info ti;
            socklen_t l = sizeof ti;
            if (rs_syscall(SYS_getsockopt, rs_fd_enter(c), IPPROTO_TCP, TCP_INFO, &ti, &l) == 0 &&
                ti.tcpi_state != TCP_ESTABLISHED && ti.tcpi_state != TCP_FIN_WAIT1 && ti.tcpi_state != TCP_FIN_WAIT2)
                RS_SET(c->tcp_eof, 1);                      /* the peer's FIN, behind our own SHUT_RD */
            rs_fd_leave(c);
        }
    }
    return RS_GET(c->tcp_eof);
}

/* Sleeps until the TCP socket is readable (a doorbell, or the peer's end) or timeout_ms
 * passes.  Returns 1 woken, 0 timed out, -errno (EINTR).
 *
 * With no timeout the sleep is a blocking recv(MSG_PEEK) on a duplicate of the socket, so
 * the kernel's own rules apply: a signal whose handler has SA_RESTART restarts it, any
 * other interrupts it (EINTR), as for a recv on a TCP socket; and the duplicate keeps the
 * socket, as a kernel recv would, even if the application closes its number meanwhile.
 * With a timeout (SO_RCVTIMEO, or the caller's) it is a poll, which a signal always
 * interrupts: that too is what a TCP recv with SO_RCVTIMEO does (signal(7)); it wakes at
 * least every RS_WAIT_SLICE_MS to look again.  rdma always takes the poll: its own queue
 * pair can fail while it sleeps, with no byte on the socket to say so (silent_failure). */
#define RS_WAIT_SLICE_MS 500
int rs_wait_fd(rs_conn *c, int timeout_ms)
{
    c->rx.sleeps++;
    short out = rs_tx_switch(c) ? 0 : POLLOUT;          /* room for our SWITCH wakes us too */
    if (timeout_ms < 0 && !c->ops->silent_failure && !out) {
        int fd = rs_fd_enter(c);
        int own = (int)rs_syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, 1024);
        if (own < 0) own = (int)rs_syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, 0);
        rs_fd_leave(c);
        if (own >= 0) {
            uint8_t b;
            long r = rs_syscall(SYS_recvfrom, own, &b, 1, MSG_PEEK, NULL, NULL);
            int e = errno;
            rs_syscall(SYS_close, own);
            if (r >= 0 || e != EAGAIN) {             /* EAGAIN: O_NONBLOCK set meanwhile: poll */
                if (r == 0 && !RS_GET(c->rx.shut_rd)) RS_SET(c->tcp_eof, 1);
                if (r < 0 && e == EINTR) return -EINTR;
                if (r < 0) { rs_note_sock_error(c, e); RS_SET(c->tcp_eof, 1); }
                return 1;
            }
        }
    }
    short re;
    int slice = timeout_ms < 0 || timeout_ms > RS_WAIT_SLICE_MS ? RS_WAIT_SLICE_MS : timeout_ms;
    int r = rs_c_poll(c, POLLIN | POLLRDHUP | out, slice, &re);
    if (r == -EINTR && timeout_ms < 0 && rs_restart_after_signal()) return 1;
    if (r > 0 && (re & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL))) rs_peer_gone(c);
    return r;
}
