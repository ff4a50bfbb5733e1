/* rs_spill.c - a ring that stays full lends the TCP socket's buffers for a while.
 *
 * A ring holds far less than the kernel's socket buffers (256 KiB against several MiB),
 * and programs that write before they read (pipelining clients, proxies, uploads to a
 * server that answers early) count on what TCP holds.  So when the consumer has taken
 * nothing from a full ring for RS_SPILL_AFTER_NS, the producer writes what the socket
 * accepts without waiting, after an 8-byte SPILL mark, and then a SPILL record with that
 * count into the ring (docs/PROTOCOL.md 6.9).  The consumer, reaching the record, reads
 * the doorbells before the mark, the mark, exactly that many stream bytes, and goes back
 * to its ring.  Until the consumer takes something, every write spills at once, as long
 * as the socket takes bytes and the ring has room for the records (a sixteenth of it is
 * kept for them).  The connection stays upgraded: what was in flight now is what TCP would
 * hold, bounded by the socket's own SO_SNDBUF/SO_RCVBUF.
 *
 * Only where both ends said so in the handshake (spill_ok) and over a transport that
 * cannot lose records (a lossy one's resend after a failure replays the ring alone).
 * Every byte this side writes on the socket is written under tx_lock (doorbells, frames,
 * spills), so nothing lands between a mark and its bytes.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include "rs_conn.h"
#include "rs_sys.h"

enum { SPILL_NONE, SPILL_SEEK, SPILL_MARK, SPILL_DATA };

#define RS_SPILL_AFTER_NS 10000000ull     /* a full ring untouched this long spills */
#define RS_MARK_FINISH_MS 5000            /* bound on finishing a mark the socket cut short */

/* ---- producer ------------------------------------------------------------------------- */

/* Caller holds tx_lock and found the ring too full for its next record: 1 if a SPILL may
 * go now (the ring has room for its record and the socket for some bytes). */
int rs_spill_due(rs_conn *c)
{
    if (!c->spill_ok || c->ops->lossy_failure || c->tx.fin_sent || RS_GET(c->fb) || RS_GET(c->tcp_eof) ||
        RS_GET(c->err) || !rs_tx_switch(c) || !rs_tx_spill_room(c))
        return 0;
    if (rs_tx_full_ns(c) < RS_SPILL_AFTER_NS) return 0;
    short re;
    return rs_c_poll(c, POLLOUT, 0, &re) > 0 && !(re & (POLLERR | POLLHUP | POLLNVAL));
}

/* The rest of a mark (and its first stream byte) that the socket took only part of.  The
 * peer's mark must be whole before anything else of ours follows. */
static int finish_mark(rs_conn *c, const uint8_t *p, size_t n)
{
    uint64_t deadline = rs_deadline(RS_MARK_FINISH_MS);
    while (n) {
        long r = rs_c_send(c, p, n, MSG_NOSIGNAL);
        if (r > 0) { p += r; n -= (size_t)r; continue; }
        if (r != -EAGAIN && r != -EINTR) return (int)r;
        if (rs_passed(deadline)) return -ETIMEDOUT;
        rs_sleep_fd(rs_fd_peek(c), POLLOUT, deadline);
    }
    return 0;
}

/* Caller holds tx_lock and rs_spill_due said yes.  Sends a mark and as much of src as the
 * socket takes without waiting, then the SPILL record.  Returns the stream bytes spilled,
 * 0 if none (the socket was full after all, or broken: the caller's wait finds out). */
size_t rs_spill_send(rs_conn *c, const void *src, size_t len)
{
    uint8_t mark[RS_SPILL_MARK_LEN] = { RS_BELL_SPILL, RS_SPILL_VERSION, 0, 0 };
    rs_put_le(mark + 4, rs_footer(c->salt, c->tx.bytes, RS_SPILL_TAG), 4);
    if (len > RS_SPILL_MAX) len = RS_SPILL_MAX;
    struct iovec iov[2] = { { mark, sizeof mark }, { (void *)src, len } };
    struct msghdr mh = { .msg_iov = iov, .msg_iovlen = 2 };
    long n = rs_syscall(SYS_sendmsg, rs_fd_enter(c), &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) n = -errno;
    rs_fd_leave(c);
    if (n <= 0) {
        if (n == -EPIPE || n == -ECONNRESET || n == -ENOTCONN) RS_SET(c->tcp_eof, 1);
        c->tx.stall_since = rs_now_ns();            /* not again for a while */
        return 0;
    }
    if ((size_t)n <= sizeof mark) {
        /* Cut inside the mark: a socket that said it had room rarely does this.  The mark
         * and one byte go out whole, or the connection has failed. */
        uint8_t rest[RS_SPILL_MARK_LEN + 1];
        size_t k = sizeof mark - (size_t)n;
        memcpy(rest, mark + n, k);
        rest[k] = *(const uint8_t *)src;
        int r = finish_mark(c, rest, k + 1);
        if (r < 0) {
            rs_conn_set_error(c, EIO, "rdmasock: the socket took only part of a SPILL mark: %s", strerror(-r));
            return 0;
        }
        n = sizeof mark + 1;
    }
    uint32_t count = (uint32_t)((size_t)n - sizeof mark);
    rs_tx_put_spill(c, count);
    c->tx.bytes += count;
    __atomic_store_n(&c->tx.spilled, c->tx.spilled + count, __ATOMIC_RELAXED);
    __atomic_store_n(&c->tx.spills, c->tx.spills + 1, __ATOMIC_RELAXED);
    c->tx.spill_settle = 1;
    rs_tx_flush_bell(c);
    return count;
}

/* Spilled bytes may sit unsent in our socket (the peer is not reading) for as long as the
 * peer takes; a reset of the socket throws them away.  The kernel resets a socket that is
 * closed with bytes unread, or that a byte reaches after its close, and that is how a
 * process that dies ends it: no exit path of ours runs.  Over TCP neither happens to a
 * sender that read everything.  So once a send that spilled (or waited after spilling)
 * ends, the doorbells of records we already consumed are read off, and no credit doorbell
 * stays asked for: a writer that waits again asks again, and the waits need it only to
 * wake sooner (they nap, and look every 10 ms).  Data the peer writes later still rings,
 * as its bytes would reach a dead TCP socket too.  Called without locks; transports
 * without SPILL have no after_spill. */
void rs_spill_settle(rs_conn *c)
{
    if (c->ops->after_spill) c->ops->after_spill(c);
}

/* ---- consumer ------------------------------------------------------------------------- */

/* The consumer took a SPILL record of `count` bytes (caller holds rx_lock). */
void rs_spill_begin_rx(rs_conn *c, uint32_t count)
{
    c->rx.spill_left = count;
    c->rx.spill_got = 0;
    __atomic_store_n(&c->rx.spill_state, SPILL_SEEK, __ATOMIC_RELEASE);
}

int rs_spill_rx_active(rs_conn *c)
{
    return __atomic_load_n(&c->rx.spill_state, __ATOMIC_ACQUIRE) != SPILL_NONE;
}

static int ended(rs_conn *c, const char *where)
{
    rs_conn_set_error(c, EPROTO, "rdmasock: the connection ended %s (%llu announced bytes still to come)", where,
                      (unsigned long long)c->rx.spill_left);
    return -EPROTO;
}

/* Caller holds rx_lock.  Reads the doorbells before the mark and the mark, without
 * waiting.  1: the spilled bytes are next on the socket; 0: not yet; -errno. */
static int reach_data(rs_conn *c)
{
    uint8_t buf[256];
    while (c->rx.spill_state == SPILL_SEEK) {
        long n = rs_c_recv(c, buf, sizeof buf, MSG_PEEK);
        if (n == 0) return ended(c, "before the peer's SPILL mark");
        if (n < 0) return n == -EAGAIN || n == -EINTR ? 0 : (int)n;
        int next;
        long k = rs_bell_scan(buf, n, &next, NULL);
        if (k) {
            rs_c_recv(c, buf, (size_t)k, 0);                /* exactly the bells peeked */
            c->rx.bells_drained += (uint64_t)k;
        }
        if (next < 0) continue;
        if (next != RS_BELL_SPILL) {
            rs_conn_set_error(c, EPROTO, "rdmasock: garbage byte 0x%02x before the peer's SPILL mark", next);
            return -EPROTO;
        }
        c->rx.spill_state = SPILL_MARK;
    }
    while (c->rx.spill_state == SPILL_MARK) {
        long n = rs_c_recv(c, c->rx.spill_mark + c->rx.spill_got, RS_SPILL_MARK_LEN - c->rx.spill_got, 0);
        if (n == 0) return ended(c, "inside the peer's SPILL mark");
        if (n < 0) return n == -EAGAIN || n == -EINTR ? 0 : (int)n;
        c->rx.spill_got += (uint8_t)n;
        if (c->rx.spill_got < RS_SPILL_MARK_LEN) continue;
        const uint8_t *m = c->rx.spill_mark;
        if (m[1] != RS_SPILL_VERSION || m[2] || m[3] || rs_get_le(m + 4, 4) != rs_footer(c->salt, c->rx.bytes, RS_SPILL_TAG)) {
            rs_conn_set_error(c, EPROTO, "rdmasock: corrupt SPILL mark from the peer (version %u, at byte %llu)",
                              m[1], (unsigned long long)c->rx.bytes);
            return -EPROTO;
        }
        c->rx.spill_state = SPILL_DATA;
    }
    return 1;
}

/* Receives from the spilled bytes, as a TCP recv would (caller does not hold rx_lock).
 * Returns bytes, 0 if the spill is over (the ring goes on), or -errno. */
ssize_t rs_spill_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms)
{
    int peek = flags & RS_MSG_PEEK;
    int nonblock = (flags & RS_MSG_DONTWAIT) || timeout_ms == 0;
    uint64_t deadline = rs_deadline(nonblock ? 0 : timeout_ms);
    for (;;) {
        rs_lock(&c->rx.lock);
        if (c->rx.spill_state == SPILL_NONE) { rs_unlock(&c->rx.lock); return 0; }
        int r = reach_data(c);
        long n = -EAGAIN;
        if (r == 1) {
            size_t want = len < c->rx.spill_left ? len : (size_t)c->rx.spill_left;
            n = rs_c_recv(c, buf, want, peek ? MSG_PEEK : 0);
            if (n == 0) n = ended(c, "inside the peer's spilled bytes");
            if (n > 0 && !peek) {
                c->rx.bytes += (uint64_t)n;
                c->rx.spilled += (uint64_t)n;
                c->rx.spill_left -= (uint64_t)n;
                if (!c->rx.spill_left) __atomic_store_n(&c->rx.spill_state, SPILL_NONE, __ATOMIC_RELEASE);
            }
        }
        rs_unlock(&c->rx.lock);
        if (r < 0) return r;
        if (n > 0) return n;
        if (n != -EAGAIN && n != -EINTR) return n;
        if (nonblock) return -EAGAIN;
        int w = rs_sleep_fd(rs_fd_peek(c), POLLIN, deadline);
        if (w < 0) return w;
        if (w == 0) return -EAGAIN;
    }
}

/* Caller holds rx_lock: 1 if a receive would not wait (spilled bytes, or an error). */
int rs_spill_rx_ready(rs_conn *c)
{
    int r = reach_data(c);
    if (r <= 0) return r < 0;
    short re;
    return rs_c_poll(c, POLLIN, 0, &re) > 0;
}

/* Caller holds rx_lock: spilled bytes receivable now (FIONREAD). */
long rs_spill_available(rs_conn *c)
{
    if (reach_data(c) != 1) return 0;
    int n = 0;
    long r = rs_syscall(SYS_ioctl, rs_fd_enter(c), FIONREAD, &n);
    rs_fd_leave(c);
    if (r < 0 || n < 0) return 0;
    return (uint64_t)n < c->rx.spill_left ? n : (long)c->rx.spill_left;
}
