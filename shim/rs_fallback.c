/* rs_fallback.c - a connection whose ring cannot go on continues over its TCP socket.
 *
 * Two causes.  RDMA can fail after set-up (a work request completes in error, a READ of
 * the peer's counters goes unanswered, the peer reports its own transport failed) while
 * the TCP socket the connection was bootstrapped on is fine.  And a ring can stall: full,
 * its consumer taking nothing for the transport's stall_ms (and, where SPILL was agreed,
 * no room left for SPILL records), typically because both programs write before they read
 * and the rings hold less than TCP would.  Either way the stream moves to the socket
 * without losing or doubling a byte, each direction on its own (docs/PROTOCOL.md 6.8,
 * 9.10; over rdma a stall takes the failure's path, 9.10).
 *
 * Whether records in flight can be lost is the transport's property (lossy_failure); the
 * rest of this file is the same for every transport.
 *
 * Reliable (shm): the producer writes a MOVED record (its ring keeps 8 bytes for one control
 * record), then a RESYNC frame naming the stream offset right after it, and from then on
 * writes to the socket.  The consumer reads its ring up to the MOVED record, then the
 * socket: doorbell bytes, the frame, the stream.  It notices the move only there, in
 * order, so its own ring direction keeps going until the peer's MOVED record arrives.
 *
 * Lossy (rdma):
 *
 *   producer: stops posting, writes a RESYNC frame naming B, the stream offset of the
 *     oldest record the consumer has not handed back as credit, then resends the payload
 *     of every record from there (all still intact in its shadow of the peer's ring), and
 *     from then on writes straight to the socket.
 *   consumer: takes complete records from its ring up to the first one that is not there,
 *     then reads the socket: doorbell bytes, the frame, and it drops the first
 *     (bytes delivered - B) bytes of what follows, which it already had from the ring.
 *
 * A consumer only credits bytes it delivered, so B <= delivered, and every byte it did
 * not deliver is in the resend.  Neither side waits for the other before moving on.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "rs_conn.h"
#include "rs_sys.h"

enum { TX_RING, TX_RESEND, TX_PLAIN };
enum { RX_RING, RX_BELLS, RX_FRAME, RX_REPEAT, RX_PLAIN };
#define RESYNC_EOF 2              /* rx_resync: the socket ended before the frame */



/* Any thread, any lock held: the work happens in rs_fb_kick and the data paths.  The
 * first cause is the one reported. */
void rs_fb_begin(rs_conn *c, int reason)
{
    uint8_t zero = 0;
    if (__atomic_compare_exchange_n(&c->fb_reason, &zero, (uint8_t)reason, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST) ||
        !RS_GET(c->fb)) {
        __atomic_store_n(&c->fb, 1, __ATOMIC_SEQ_CST);
        rs_note_silent_change();                /* a resend for waiters to push */
    }
}

/* Both directions plain TCP and nothing held (rs_hold.c): the kernel socket tells
 * readiness from now on.  Each side calls it after its own change.  Never where the hold
 * applies: a writer waiting for room goes on filling it from the socket (wait_room), so
 * the program's calls must keep coming here. */
void rs_fb_update_done(rs_conn *c)
{
    if (rs_hold_applies(c)) return;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&c->tx.move.state, __ATOMIC_SEQ_CST) == TX_PLAIN &&
        __atomic_load_n(&c->rx.move.state, __ATOMIC_SEQ_CST) == RX_PLAIN && !__atomic_load_n(&c->rx.hold_len, __ATOMIC_SEQ_CST))
        __atomic_store_n(&c->fb_done, 1, __ATOMIC_RELEASE);
}

static int wait_sock(rs_conn *c, short events, uint64_t deadline)
{
    return rs_sleep_fd(rs_fd_peek(c), events, deadline);
}

/* A writer waiting for room in the socket's buffer.  Where the ring had the hold
 * (rs_hold.c), the writer keeps filling it after the move, from the socket now, every
 * RS_HOLD_AFTER_MS of its wait (*since: when the wait began, 0 before): the socket's
 * buffers, cold after carrying only doorbells, take in far less than the ring and the
 * hold did, or than a TCP connection's would have by now, and a program that writes
 * before it reads (and its peer, doing the same) would otherwise wait for each other.
 * Counted in time, not in sleeps: a stream socket may say it has room and then take
 * nothing. */
static int wait_room(rs_conn *c, uint64_t deadline, uint64_t *since)
{
    if (!rs_hold_applies(c)) return wait_sock(c, POLLOUT, deadline);
    uint64_t now = rs_now_ns(), step = RS_HOLD_AFTER_MS * 1000000ull;
    if (!*since) {
        *since = now;
    } else if (now - *since >= step) {
        rs_hold_fill(c);
        *since = now;
    }
    int w = wait_sock(c, POLLOUT, rs_earlier(deadline, now + step));
    return w == 0 && !rs_passed(deadline) ? 1 : w;     /* 1: look again */
}

/* ---- transmit ---------------------------------------------------------------------- */

static void shut_wr(rs_conn *c)
{
    rs_syscall(SYS_shutdown, rs_fd_enter(c), SHUT_WR);
    rs_fd_leave(c);
}

static void put_frame(rs_conn *c, uint64_t resume)
{
    uint8_t *f = c->tx.move.out;
    memset(f, 0, RS_RESYNC_LEN);
    f[0] = RS_BELL_RESYNC;
    f[1] = RS_RESYNC_VERSION;
    rs_put_le(f + 4, rs_footer(c->salt, resume, RS_RESYNC_TAG), 4);
    rs_put_le(f + 8, resume, 8);
    c->tx.move.out_len = RS_RESYNC_LEN;
    c->tx.move.out_sent = 0;
}

/* Reliable transport (caller holds tx_lock): every byte so far is in the peer's ring, in
 * order, ending with the MOVED record, so the frame resumes right after the last of them.
 * After a FIN or RESET record the direction is over: nothing moves, and the kernel socket
 * is half-closed too, so that a reader of the socket alone (a program the peer exec'd)
 * sees the end of the stream there. */
static void tx_start_at_moved(rs_conn *c)
{
    if (!c->tx.fin_sent) {
        rs_tx_put_moved(c);
        put_frame(c, c->tx.bytes);
    } else {
        shut_wr(c);
    }
    c->tx.move.resend_pos = c->tx.move.resend_end = 0;
    c->tx.move.state = c->tx.fin_sent ? TX_PLAIN : TX_RESEND;
    rs_fb_update_done(c);
}

/* Caller holds tx_lock.  Freezes the ring direction and prepares frame and resend: over
 * a lossy transport, of every record the consumer has not credited. */
static void tx_start(rs_conn *c)
{
    if (!c->ops->lossy_failure) { tx_start_at_moved(c); return; }
    uint64_t pos = c->tx.head_seen, unacked = 0;
    while (pos < c->tx.pos) {
        uint32_t lw = *(uint32_t *)(c->tx.ring + (pos & c->mask));
        if (lw < RS_LEN_CTL_MIN) unacked += lw;
        pos += rs_rec_span(c, pos, lw);
    }
    c->ops->silence(c);                            /* no doorbell byte may follow the frame */
    put_frame(c, c->tx.bytes - unacked);
    c->tx.move.resend_pos = c->tx.head_seen;
    c->tx.move.resend_end = c->tx.pos;
    c->tx.move.resend_off = 0;
    if (c->tx.fin_sent) c->tx.move.shut_pending = 1;
    c->tx.move.state = TX_RESEND;
}

static int tx_broken(rs_conn *c, long n)
{
    if (n == -EPIPE || n == -ECONNRESET || n == -ENOTCONN) RS_SET(c->tcp_eof, 1);
    return (int)n;
}

/* Caller holds tx_lock.  Sends what is pending without waiting: 1 all out, 0 would
 * block, -errno. */
static int tx_pump(rs_conn *c)
{
    if (!rs_tx_switch(c)) return 0;
    while (c->tx.move.out_sent < c->tx.move.out_len) {
        long n = rs_c_send(c, c->tx.move.out + c->tx.move.out_sent, c->tx.move.out_len - c->tx.move.out_sent,
                             MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) return n == -EAGAIN ? 0 : tx_broken(c, n);
        c->tx.move.out_sent += (uint8_t)n;
    }
    while (c->tx.move.resend_pos < c->tx.move.resend_end) {
        uint32_t off = (uint32_t)(c->tx.move.resend_pos & c->mask), lw = *(uint32_t *)(c->tx.ring + off);
        if (lw >= RS_LEN_CTL_MIN || c->tx.move.resend_off == lw) {
            c->tx.move.resend_pos += rs_rec_span(c, c->tx.move.resend_pos, lw);
            c->tx.move.resend_off = 0;
            continue;
        }
        long n = rs_c_send(c, c->tx.ring + off + 4 + c->tx.move.resend_off, lw - c->tx.move.resend_off,
                             MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) return n == -EAGAIN ? 0 : tx_broken(c, n);
        c->tx.move.resend_off += (uint32_t)n;
    }
    if (c->tx.move.shut_pending) {
        c->tx.move.shut_pending = 0;
        shut_wr(c);                                /* the FIN record's meaning, in TCP terms */
    }
    c->tx.move.state = TX_PLAIN;
    rs_fb_update_done(c);
    return 1;
}

/* Caller holds tx_lock.  Starts our direction's move if needed and pushes what it can:
 * tx_pump's result, 1 if nothing is pending. */
static int tx_advance_locked(rs_conn *c)
{
    if (c->tx.move.state == TX_RING) tx_start(c);
    return c->tx.move.state == TX_RESEND ? tx_pump(c) : 1;
}

static int tx_advance(rs_conn *c)
{
    rs_lock(&c->tx.lock);
    int r = tx_advance_locked(c);
    rs_unlock(&c->tx.lock);
    return r;
}

/* Any thread not holding tx_lock. */
void rs_fb_kick(rs_conn *c)
{
    rs_tx_switch(c);
    if (RS_GET(c->fb) && c->tx.move.state != TX_PLAIN) tx_advance(c);
}

int rs_fb_tx_pending(rs_conn *c)
{
    return (RS_GET(c->fb) && c->tx.move.state != TX_PLAIN) || RS_GET(c->switch_due);
}

/* Frame and resend first (the application already counted them as sent), then straight
 * to the socket. */
ssize_t rs_fb_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms)
{
    if (timeout_ms == 0) nonblock = 1;
    uint64_t deadline = rs_deadline(nonblock ? 0 : timeout_ms), since = 0;
    for (;;) {
        int r = tx_advance(c);
        if (r < 0) return r;
        if (r == 1) break;
        if (nonblock) return -EAGAIN;
        int w = wait_room(c, deadline, &since);
        if (w <= 0) return w == 0 ? -EAGAIN : w;
    }
    if (c->tx.fin_sent) return -EPIPE;
    size_t sent = 0;
    while (sent < len) {
        long n = rs_c_send(c, (const uint8_t *)buf + sent, len - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) { sent += (size_t)n; c->tx.bytes += (uint64_t)n; continue; }
        if (n != -EAGAIN) { tx_broken(c, n); return sent ? (ssize_t)sent : n; }
        if (nonblock) break;
        int w = wait_room(c, deadline, &since);
        if (w < 0 && !sent) return w;           /* a signal without SA_RESTART: EINTR, as TCP's send */
        if (w <= 0) break;
    }
    if (!sent && len) return -EAGAIN;
    return (ssize_t)sent;
}

/* The program asked for what only TCP carries (urgent data): our direction moves to the
 * socket now (rdma: the whole connection), its frame and resend leave before the caller's
 * own call on the socket.  0, or -errno (-EAGAIN: the socket's buffer is full and the call
 * may not wait). */
int rs_fb_move_tx(rs_conn *c, int reason, int timeout_ms)
{
    rs_fb_begin(c, reason);
    ssize_t r = rs_fb_send(c, NULL, 0, timeout_ms == 0, timeout_ms);
    return r < 0 ? (int)r : 0;
}

/* Half-close while falling back (caller holds tx_lock): a TCP FIN after the resend. */
void rs_fb_shutdown(rs_conn *c)
{
    c->tx.move.shut_pending = 1;
    if (c->tx.move.state == TX_PLAIN) { c->tx.move.shut_pending = 0; shut_wr(c); }
    else tx_advance_locked(c);               /* the half-close follows the resend */
}

/* Before the connection is torn down: the resend must leave (bounded, as close would
 * otherwise drop bytes the application counted as sent). */
int rs_fb_finish_tx(rs_conn *c, int timeout_ms)
{
    uint64_t deadline = rs_deadline(timeout_ms);
    for (;;) {
        int r = tx_advance(c);
        if (r != 0) return r < 0 ? r : 0;
        if (rs_passed(deadline)) return -ETIMEDOUT;
        wait_sock(c, POLLOUT, deadline);
    }
}

/* Caller holds tx_lock. */
int rs_fb_tx_writable(rs_conn *c)
{
    if (RS_GET(c->fb) && c->tx.move.state != TX_PLAIN) tx_advance_locked(c);
    if (c->tx.move.state != TX_PLAIN) return RS_GET(c->tcp_eof);          /* resend still going out */
    short re;
    return rs_c_poll(c, POLLOUT, 0, &re) > 0;
}

/* ---- receive ----------------------------------------------------------------------- */

/* Reads the doorbell bytes before the peer's RESYNC frame, the frame, and the bytes it
 * repeats.  1: the socket carries the stream now; 0: more to come; RESYNC_EOF; -errno. */
static int rx_resync_locked(rs_conn *c)
{
    uint8_t buf[512];
    while (c->rx.move.state == RX_BELLS) {
        long n = rs_c_recv(c, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0) return RESYNC_EOF;                     /* the peer died before writing it */
        if (n < 0) return n == -EAGAIN ? 0 : n == -ECONNRESET ? RESYNC_EOF : (int)n;
        int next;
        long k = rs_bell_scan(buf, n, &next, NULL);
        if (k) {
            rs_c_recv(c, buf, (size_t)k, MSG_DONTWAIT);   /* exactly the bells peeked */
            c->rx.bells_drained += (uint64_t)k;
        }
        if (next < 0) continue;
        if (next != RS_BELL_RESYNC) {
            rs_conn_set_error(c, EPROTO, "rdmasock: garbage byte 0x%02x before the peer's RESYNC frame", next);
            return -EPROTO;
        }
        c->rx.move.state = RX_FRAME;
    }
    while (c->rx.move.state == RX_FRAME) {
        long n = rs_c_recv(c, c->rx.move.in + c->rx.move.in_got, RS_RESYNC_LEN - c->rx.move.in_got, MSG_DONTWAIT);
        if (n == 0) {
            rs_conn_set_error(c, EPROTO, "rdmasock: the connection ended inside the peer's RESYNC frame "
                              "(%u of %u bytes)", c->rx.move.in_got, RS_RESYNC_LEN);
            return -EPROTO;
        }
        if (n < 0) return n == -EAGAIN ? 0 : (int)n;
        c->rx.move.in_got += (uint8_t)n;
        if (c->rx.move.in_got < RS_RESYNC_LEN) continue;
        uint64_t resume = rs_get_le(c->rx.move.in + 8, 8);
        if (c->rx.move.in[1] != RS_RESYNC_VERSION || c->rx.move.in[2] || c->rx.move.in[3] ||
            rs_get_le(c->rx.move.in + 4, 4) != rs_footer(c->salt, resume, RS_RESYNC_TAG)) {
            rs_conn_set_error(c, EPROTO, "rdmasock: corrupt RESYNC frame from the peer (version %u, offset %llu)",
                              c->rx.move.in[1], (unsigned long long)resume);
            return -EPROTO;
        }
        if (resume > c->rx.bytes || c->rx.bytes - resume > c->ring_size) {
            rs_conn_set_error(c, EPROTO, "rdmasock: the peer's RESYNC frame resumes at byte %llu, but %llu "
                              "were delivered", (unsigned long long)resume, (unsigned long long)c->rx.bytes);
            return -EPROTO;
        }
        c->rx.move.skip = c->rx.bytes - resume;
        c->rx.move.state = RX_REPEAT;
    }
    while (c->rx.move.state == RX_REPEAT && c->rx.move.skip) {
        long n = rs_c_recv(c, buf, c->rx.move.skip < sizeof buf ? c->rx.move.skip : sizeof buf, MSG_DONTWAIT);
        if (n == 0) {
            rs_conn_set_error(c, EPROTO, "rdmasock: the connection ended while the peer resent bytes "
                              "(%llu still to come)", (unsigned long long)c->rx.move.skip);
            return -EPROTO;
        }
        if (n < 0) return n == -EAGAIN ? 0 : (int)n;
        c->rx.move.skip -= (uint64_t)n;
    }
    if (c->rx.move.state == RX_REPEAT) {
        c->rx.move.state = RX_PLAIN;
        rs_fb_update_done(c);
    }
    return 1;
}

/* Caller holds rx_lock. */
static int rx_resync(rs_conn *c)
{
    return c->rx.move.state == RX_PLAIN ? 1 : rx_resync_locked(c);
}

static void rx_leave_ring(rs_conn *c);

/* For the hold (rs_hold.c; caller holds rx_lock), once the ring has nothing more: up to
 * len stream bytes off the socket, without waiting.  Only bytes that are there: the end
 * of the stream or the socket's error stays for the program's own read to report. */
size_t rs_fb_rx_take(rs_conn *c, uint8_t *dst, size_t len)
{
    rx_leave_ring(c);
    if (rx_resync(c) != 1) return 0;
    int queued = 0;
    long r = rs_syscall(SYS_ioctl, rs_fd_enter(c), FIONREAD, &queued);
    rs_fd_leave(c);
    if (r < 0 || queued <= 0) return 0;
    long n = rs_c_recv(c, dst, (size_t)queued < len ? (size_t)queued : len, MSG_DONTWAIT);
    if (n <= 0) return 0;
    c->rx.bytes += (uint64_t)n;
    return (size_t)n;
}

/* A lossy transport failed: the ring has nothing more for us, from here on only the socket
 * (caller decided).  Otherwise the ring is left at the peer's MOVED record (rs_fb_rx_moved). */
static void rx_leave_ring(rs_conn *c)
{
    if (c->rx.move.state == RX_RING && c->ops->lossy_failure) c->rx.move.state = RX_BELLS;
}

/* The consumer took the peer's MOVED record (caller holds rx_lock): the rest of this
 * direction is on the socket, and ours follows it there. */
void rs_fb_rx_moved(rs_conn *c)
{
    __atomic_store_n(&c->rx.move.state, RX_BELLS, __ATOMIC_RELEASE);
    rs_fb_begin(c, RS_REASON_PEER_MOVED);
}

/* 1 once every byte the ring will ever give was delivered and the stream reads straight
 * from the socket. */
int rs_fb_rx_plain(rs_conn *c)
{
    return __atomic_load_n(&c->rx.move.state, __ATOMIC_ACQUIRE) == RX_PLAIN;
}

static ssize_t fb_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);

/* While a thread is in here, the hold takes nothing off the socket (rs_hold.c): the
 * bytes that wake it stay there for it.  What the hold took before comes first. */
ssize_t rs_fb_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms)
{
    __atomic_add_fetch(&c->rx.sock_readers, 1, __ATOMIC_SEQ_CST);
    ssize_t r = fb_recv(c, buf, len, flags, timeout_ms);
    __atomic_sub_fetch(&c->rx.sock_readers, 1, __ATOMIC_SEQ_CST);
    return r;
}

static ssize_t fb_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms)
{
    int peek = flags & RS_MSG_PEEK, waitall = (flags & RS_MSG_WAITALL) && !peek;
    int nonblock = (flags & RS_MSG_DONTWAIT) || timeout_ms == 0;
    uint64_t deadline = rs_deadline(nonblock ? 0 : timeout_ms);
    rs_fb_kick(c);                                 /* the peer may be waiting for our resend */
    size_t got = 0;
    for (;;) {
        rs_lock(&c->rx.lock);
        int r = 1;
        long n = -EAGAIN;
        if (c->rx.hold_len && (!peek || !got)) {
            n = (long)rs_hold_take(c, (uint8_t *)buf + got, len - got, peek);    /* before the socket's */
        } else {
            rx_leave_ring(c);
            r = rx_resync(c);
            if (r == 1) {
                n = rs_c_recv(c, (uint8_t *)buf + got, len - got, (peek ? MSG_PEEK : 0) | MSG_DONTWAIT);
                if (n > 0 && !peek) c->rx.bytes += (uint64_t)n;
            }
        }
        rs_unlock(&c->rx.lock);
        if (n > 0) {
            got += (size_t)n;
            if (got == len || !waitall) return (ssize_t)got;
            continue;
        }
        if (r == RESYNC_EOF) return (ssize_t)got;
        if (r < 0) return got ? (ssize_t)got : r;
        if (r == 1 && n == 0) return (ssize_t)got;
        if (r == 1 && n != -EAGAIN) return got ? (ssize_t)got : n;
        if (nonblock) return got ? (ssize_t)got : -EAGAIN;
        int w = wait_sock(c, POLLIN | (rs_fb_tx_pending(c) ? POLLOUT : 0), deadline);
        if (w < 0) return got ? (ssize_t)got : w;
        if (w == 0) return got ? (ssize_t)got : -EAGAIN;
        rs_fb_kick(c);
    }
}

/* Receive readiness once the ring is done: data (or EOF, or an error) on the socket
 * (caller holds rx_lock). */
int rs_fb_rx_ready(rs_conn *c)
{
    rx_leave_ring(c);
    rs_fb_kick(c);
    int r = rx_resync(c);
    if (r != 0 && r != 1) return 1;                /* EOF or an error to report */
    if (r == 0) return 0;
    short re;
    return rs_c_poll(c, POLLIN, 0, &re) > 0;
}

/* Before the application's close, after a move.  The peer's doorbells, its RESYNC frame
 * and the bytes it repeats are ours, not the application's: left unread, they would turn
 * the kernel's close into a reset, and a reset makes the peer's kernel throw away what it
 * has not yet handed to its program (over a move, the stream itself).  After a lossy
 * transport failed the peer's direction moves too, so its frame is awaited, within
 * RS_PEER_FRAME_WAIT_MS (a peer busy elsewhere sends it at its next socket call); a
 * reliable move is only read as far as it has come.  Stream bytes after them stay: closing
 * with those unread is a reset over TCP as well. */
#define RS_PEER_FRAME_WAIT_MS 2000
void rs_fb_settle_rx(rs_conn *c)
{
    if (!RS_GET(c->fb)) return;
    uint64_t deadline = rs_deadline(c->ops->lossy_failure ? RS_PEER_FRAME_WAIT_MS : 0);
    rs_fb_kick(c);                                 /* our own frame first: the peer may move on it */
    rs_lock(&c->rx.lock);
    rx_leave_ring(c);
    while (c->rx.move.state != RX_RING && rx_resync(c) == 0 && !rs_passed(deadline)) {
        rs_unlock(&c->rx.lock);
        wait_sock(c, POLLIN, deadline);
        rs_lock(&c->rx.lock);
    }
    rs_unlock(&c->rx.lock);
}

/* FIONREAD once the ring is done. */
long rs_fb_rx_available(rs_conn *c)
{
    if (c->rx.move.state != RX_PLAIN) return 0;
    int n = 0;
    long r = rs_syscall(SYS_ioctl, rs_fd_enter(c), FIONREAD, &n);
    rs_fd_leave(c);
    return r < 0 ? 0 : n;
}
