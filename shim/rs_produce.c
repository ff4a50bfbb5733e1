/* rs_produce.c - the send path: split a write into records and place them in the ring.
 *
 * While the ring has room this is memcpy plus a few stores: no allocation, no system call
 * (a doorbell byte is written only if the consumer went idle and asked for one).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include "rs_conn.h"
#include "rs_sys.h"

/* Orders the payload (possibly written with non-temporal stores by memcpy) before the
 * footer that publishes it. */
static inline void store_fence(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_sfence();
#endif
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

/* Whether the ring's tail is where this process thinks: after a fork another holder may
 * have written records since (PRELOAD 4), which the peer has consumed past our position,
 * or which sit at it still (the ring beyond a producer's tail is zero, 8 bytes at least:
 * room kept for the FIN record).  The peer's head is taken as it is: a false one only
 * keeps us from writing our end. */
int rs_tx_tail_is_ours(rs_conn *c)
{
    if (!c->tx.ring || !c->tx.ctl) return 1;
    if (__atomic_load_n((uint32_t *)(c->tx.ring + (c->tx.pos & c->mask)), __ATOMIC_ACQUIRE)) return 0;
    return __atomic_load_n(&c->tx.ctl->head, __ATOMIC_ACQUIRE) <= c->tx.pos;
}

/* Writes keep 8 bytes of the ring free for the FIN record, so close never has to wait. */
static inline uint64_t tx_free(rs_conn *c)
{
    return (uint64_t)c->ring_size - 8 - (c->tx.pos - c->tx.head_seen);
}

/* Room for data records.  Where both ends spill, a sixteenth of the window is kept for
 * SPILL records: a consumer that takes nothing must not stop the stream from lending the
 * socket's buffers (a program writing 4 KiB at a time needs one record per write). */
static inline uint64_t tx_room(rs_conn *c)
{
    uint64_t keep = c->spill_ok ? c->tx.window / 16u : 0, f = tx_free(c);
    return f > keep ? f - keep : 0;
}

/* The window: records stay below ring offset tx.window and a WRAP ends each lap there, so
 * the pages beyond it are never touched (nor, on the consumer's side, re-zeroed).  The
 * skipped tail counts as used until the consumer passes the WRAP, so a window can only
 * pay while the consumer keeps up; the first time the ring has no room the window
 * doubles, up to the whole ring (a stream gets there within a few laps).  Nothing of
 * this is on the wire: a WRAP may stand anywhere (PROTOCOL 5.4). */
static inline uint32_t tx_win_left(rs_conn *c)
{
    uint32_t off = (uint32_t)(c->tx.pos & c->mask);
    return c->tx.window > off ? c->tx.window - off : 0;
}
static inline uint32_t tx_lap_left(rs_conn *c) { return c->ring_size - (uint32_t)(c->tx.pos & c->mask); }

static inline int tx_grow(rs_conn *c)
{
    if (c->tx.window >= __atomic_load_n(&c->tx.window_max, __ATOMIC_RELAXED)) return 0;
    c->tx.window *= 2;
    return 1;
}

static inline void refresh_credit(rs_conn *c) { c->ops->refresh_credit(c); }

static void put_record(rs_conn *c, uint32_t lenword, const void *payload, uint32_t n)
{
    uint32_t off = (uint32_t)(c->tx.pos & c->mask), rec = rs_rec_size(lenword);
    if (lenword < RS_LEN_CTL_MIN) c->tx.last_data = c->tx.pos;
    c->tx.last_rec = c->tx.pos;
    uint8_t *p = c->tx.ring + off;
    if (n) memcpy(p + 4, payload, n);
    __atomic_store_n((uint32_t *)p, lenword, __ATOMIC_RELAXED);
    store_fence();
    __atomic_store_n((uint32_t *)(p + rec - 4), rs_footer(c->salt, c->tx.seq, lenword), __ATOMIC_RELEASE);
    c->tx.pos += rec;
    c->tx.seq++;
    c->tx.records++;
}

/* The last record of a direction that moves to TCP (caller holds tx_lock): it fits in the
 * 8 bytes every write leaves free. */
void rs_tx_put_moved(rs_conn *c)
{
    put_record(c, RS_LEN_MOVED, NULL, 0);
    rs_tx_flush_bell(c);
}

/* Caller holds tx_lock and found the ring full: how long the consumer has returned no
 * credit since the ring was first found so (0 at the first look). */
uint64_t rs_tx_full_ns(rs_conn *c)
{
    uint64_t now = rs_now_ns();
    if (!c->tx.stall_since || c->tx.stall_head != c->tx.head_seen) {
        c->tx.stall_head = c->tx.head_seen;
        c->tx.stall_since = now;
        return 0;
    }
    return now - c->tx.stall_since;
}

/* Caller holds tx_lock and found the ring full.  1 if the consumer has returned no credit
 * for the transport's stall_ms since the ring was first found full: the connection then
 * moves to TCP (rs_fallback.c), as a ring holds far less than the kernel's socket buffers.
 * Where both ends spill (rs_spill.c), the ring lends the socket's buffers instead and moves
 * only if it has no room left for a SPILL record; a full socket is then TCP's own limit,
 * and the writer waits as over TCP. */
int rs_tx_stalled(rs_conn *c)
{
    if (!c->ops->stall_ms || c->tx.fin_sent) return 0;
    uint64_t full = rs_tx_full_ns(c);
    if (c->spill_ok && rs_tx_spill_room(c)) return 0;
    if (full < c->ops->stall_ms * 1000000ull) return 0;
    rs_fb_begin(c, RS_REASON_RING_STALLED);
    return 1;
}

/* SPILL records (rs_spill.c) are 16 bytes, after a WRAP if fewer are left before the end;
 * they use room a write could use, never the 8 bytes kept for FIN. */
int rs_tx_spill_room(rs_conn *c)
{
    return tx_free(c) >= (tx_win_left(c) < 16 ? tx_lap_left(c) : 0) + 16;
}

static void put_wrap(rs_conn *c)
{
    uint32_t skip = tx_lap_left(c);
    put_record(c, RS_LEN_WRAP, NULL, 0);
    c->tx.pos += skip - 8;                  /* the rest of the lap stays zero */
}

void rs_tx_put_spill(rs_conn *c, uint32_t count)
{
    if (tx_win_left(c) < 16) put_wrap(c);
    uint8_t le[4];
    rs_put_le(le, count, 4);
    put_record(c, RS_LEN_SPILL, le, 4);
}

/* The peer closed its socket: EPIPE, unless its transport failed first and said so, or
 * it reset the connection and nobody was told yet (ECONNRESET, once). */
static int peer_gone(rs_conn *c)
{
    if (!RS_GET(c->err)) c->ops->check_peer(c);                /* its RESYNC frame: it went on by TCP */
    if (RS_GET(c->fb) && !RS_GET(c->err)) return -EAGAIN;       /* a RESYNC frame came first: rs_send goes on by TCP */
    if (RS_GET(c->err)) return -RS_GET(c->err);
    if (RS_GET(c->rx.peer_reset) && rs_conn_reset_once(c)) return -ECONNRESET;
    return -EPIPE;
}

/* A write to a peer that closed its socket.  TCP takes the first one (the kernel learns
 * that the peer is gone only from the reset that write provokes, and the bytes are lost)
 * and fails the ones after it with EPIPE; the peer's reset or a transport error is
 * reported at once. */
static ssize_t write_to_gone(rs_conn *c, size_t len)
{
    int r = peer_gone(c);
    if (r != -EPIPE || c->tx.wrote_to_gone) return r;
    c->tx.wrote_to_gone = 1;
    /* ... and only what its send buffer holds: a program writing megabytes at once must
     * not see them all taken by a peer that is gone */
    int sndbuf = 0;
    socklen_t l = sizeof sndbuf;
    if (rs_syscall(SYS_getsockopt, rs_fd_enter(c), SOL_SOCKET, SO_SNDBUF, &sndbuf, &l) == 0 && sndbuf > 0 &&
        (size_t)sndbuf < len)
        len = (size_t)sndbuf;
    rs_fd_leave(c);
    return (ssize_t)len;
}

/* Small writes are kept in one record (wrapping early); large ones fill the ring tail. */
#define RS_KEEP_WHOLE 512u

/* Blocks until `need` bytes of credit are free (0), a SPILL is due (RS_CREDIT_SPILL), the
 * deadline passes or the peer is gone (-errno). */
#define RS_CREDIT_SPILL 1
static int credit_loop(rs_conn *c, uint64_t need, uint64_t deadline, int progress, struct rs_sigwait *sw);

/* An untimed wait with nothing sent yet takes its signals by the kernel's rules (a
 * handler with SA_RESTART restarts it, any other ends it with EINTR), wherever in the
 * wait they arrive; otherwise any handled signal ends it (rs_nap). */
static int wait_credit(rs_conn *c, uint64_t need, uint64_t deadline, int progress)
{
    struct rs_sigwait sw = { 0 };
    int r = credit_loop(c, need, deadline, progress, &sw);
    rs_sigwait_end(&sw);
    if (c->tx.spills) c->tx.spill_settle = 1;      /* its wait asked for a credit doorbell */
    return r;
}

/* A thread whose CPU is crowded (rs_cpus_busy) does not spin for credit, unless what
 * crowds it is the consumer itself: then the spin's yields (rs_spin_pause) hand the CPU
 * straight to the consumer, where a nap would leave both idle for its length (a 64 KiB
 * stream on one CPU: 2.6 GB/s with naps, 13 GB/s with the yields). */
static int credit_loop(rs_conn *c, uint64_t need, uint64_t deadline, int progress, struct rs_sigwait *sw)
{
    rs_tx_flush_bell(c);                        /* the consumer must know there is data */
    int spin = !rs_cpus_busy() || (c->tx.ctl && rs_cpu_is_mine(&c->tx.ctl->rx_cpu));
    uint64_t spin_start = rs_now_ns(), spin_end = spin_start + (spin ? c->spin_ns : 0);
    unsigned backoff_us = 20;
    for (;;) {
        /* First: while the lock was let go (naps), another thread may have moved the
         * direction to TCP; no record may follow its MOVED record or RESYNC frame. */
        if (RS_GET(c->fb)) return -EAGAIN;              /* rs_send goes on by TCP */
        rs_tx_switch(c);            /* the consumer reads no record of ours before our SWITCH */
        refresh_credit(c);
        if (tx_room(c) >= need) return 0;
        if (RS_GET(c->err)) return -RS_GET(c->err);
        if (RS_GET(c->tcp_eof)) return peer_gone(c);
        if (c->tx.fin_sent) return -EPIPE;         /* shutdown(SHUT_WR) in another thread */
        uint64_t now = rs_now_ns();
        if (rs_passed(deadline)) return -EAGAIN;
        if (now < spin_end && !rs_spin_pause(now - spin_start, sw)) continue;
        spin_end = 0;
        if (sw->active && !(deadline == RS_NEVER && !progress)) {
            int s = rs_spin_done(sw, RS_SIG_EINTR);      /* the naps below take signals themselves */
            if (s < 0) return s;
        }
        rs_tx_arm_credit_locked(c);
        refresh_credit(c);
        if (tx_room(c) >= need) return 0;
        if (rs_tx_stalled(c)) return -EAGAIN;          /* rs_send goes on by TCP */
        if (rs_spill_due(c)) return RS_CREDIT_SPILL;
        int hold = rs_hold_due(c);      /* the peer may be waiting for room in ours */
        /* Sleep without touching the receive side (another thread may be in recv) or
         * the socket's data (its readiness belongs to the receiver): short, growing naps,
         * without the lock (another sender, poll or close may go on meanwhile). */
        rs_unlock(&c->tx.lock);
        if (hold) rs_hold_fill(c);
        int w = deadline == RS_NEVER && !progress ? rs_sigwait_nap(sw, (uint64_t)backoff_us * 1000u, RS_SIG_RESTART)
                                                  : rs_nap((uint64_t)backoff_us * 1000u, deadline, progress);
        rs_lock(&c->tx.lock);
        if (w < 0) return w;
        if (backoff_us < 1000) backoff_us *= 2;
        c->ops->check_peer(c);                         /* a RESYNC frame? */
        rs_peer_gone(c);
    }
}

static ssize_t ring_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms);

/* The transmit state changes under tx_lock (not held while a write waits for credit), so
 * concurrent writers never interleave inside a record, and a thread that finds an rdma
 * transport failed can take the direction over to TCP (rs_fallback.c) in between. */
ssize_t rs_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms)
{
    if (RS_GET(c->err)) return -RS_GET(c->err);
    if (!len) return c->tx.fin_sent ? -EPIPE : 0;      /* TCP: no bytes, no reset provoked */
    if (RS_GET(c->fb)) return rs_fb_send(c, buf, len, nonblock, timeout_ms);
    if (timeout_ms == 0) nonblock = 1;
    uint64_t deadline = rs_deadline(nonblock ? 0 : timeout_ms);
    rs_lock(&c->tx.lock);
    ssize_t r = RS_GET(c->fb) ? -EAGAIN : ring_send(c, buf, len, nonblock, timeout_ms);
    int settle = c->tx.spill_settle;
    c->tx.spill_settle = 0;
    rs_unlock(&c->tx.lock);
    if (__builtin_expect(settle, 0)) rs_spill_settle(c);
    if (!RS_GET(c->fb) || RS_GET(c->err)) return r;
    rs_fb_kick(c);
    if (r < 0) r = 0;
    /* What the ring took is sent (rdma: in the shadow ring, part of the resend); a
     * blocking call goes on over TCP with the rest, as one TCP send would. */
    if ((size_t)r == len || (r > 0 && nonblock)) return r;
    ssize_t more = rs_fb_send(c, (const uint8_t *)buf + r, len - (size_t)r, nonblock,
                              nonblock ? 0 : rs_ms_until(deadline));
    if (more < 0) return r ? r : more;
    return r + more;
}

static ssize_t ring_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms)
{
    const uint8_t *src = buf;
    size_t sent = 0;
    if (timeout_ms == 0) nonblock = 1;
    uint64_t deadline = rs_deadline(nonblock ? 0 : timeout_ms);
    if (RS_GET(c->err)) return -RS_GET(c->err);
    if (c->tx.fin_sent) return -EPIPE;
    if (RS_GET(c->tcp_eof)) return write_to_gone(c, len);
    /* The peer shut its side down; if it closed the socket altogether, TCP fails writes
     * with EPIPE from the second on: ask the kernel (only ever after a FIN record). */
    if (c->rx.fin_seen && rs_peer_gone(c)) return write_to_gone(c, len);
    while (sent < len) {
        uint32_t chunk = len - sent > c->max_payload ? c->max_payload : (uint32_t)(len - sent);
        uint32_t to_end = tx_win_left(c);
        int wrap = 0;
        if (rs_rec_size(chunk) > to_end) {
            if (chunk <= RS_KEEP_WHOLE || to_end < 64) wrap = 1;
            else chunk = to_end - 8;
        }
        uint64_t skip = wrap ? tx_lap_left(c) : 0, need = skip + rs_rec_size(chunk);
        if (tx_room(c) < need) refresh_credit(c);
        if (tx_room(c) < need && tx_grow(c)) continue;
        if (tx_room(c) < need && chunk > RS_KEEP_WHOLE) {
            /* Partial room: write what fits rather than wait for all of it (after the
             * wrap, if one is due), as rs_tx_writable promised. */
            uint64_t room = tx_room(c) > skip ? tx_room(c) - skip : 0;
            if (room >= RS_KEEP_WHOLE + 8) { chunk = (uint32_t)((room - 8) & ~7ull); need = skip + rs_rec_size(chunk); }
        }
        if (tx_room(c) < need) {
            if (!nonblock && deadline == RS_NEVER && rs_conn_app_nonblocking(c)) nonblock = 1;
            if (rs_spill_due(c)) {
                size_t k = rs_spill_send(c, src + sent, len - sent);
                sent += k;
                if (k) continue;
            }
            if (nonblock) {
                /* Full ring: only here is it worth a system call to learn that the peer
                 * is gone (a nonblocking writer would otherwise retry forever). */
                if (!sent && rs_peer_gone(c)) return peer_gone(c);
                if (!sent) rs_tx_stalled(c);       /* then rs_send goes on by TCP */
                break;
            }
            int r = wait_credit(c, need, deadline, sent > 0);
            if (r == RS_CREDIT_SPILL) continue;
            if (RS_GET(c->fb)) break;                   /* sent so far is in the resend; rs_send goes on */
            if (r < 0) {
                if (sent) break;
                return r;
            }
            continue;
        }
        if (wrap) put_wrap(c);
        put_record(c, chunk, src + sent, chunk);
        c->tx.bytes += chunk;
        sent += chunk;
    }
    rs_cpu_note(&c->tx.ctl->tx_cpu);
    rs_tx_flush_bell(c);
    if (sent == 0 && len > 0) return -EAGAIN;
    return (ssize_t)sent;
}

/* The end of our direction: a FIN (or RESET) record after the last data byte.  Always
 * fits (8 bytes reserved).  So also while the connection moves but our direction has not
 * begun to (the peer moved first: ours would follow at our next send; a move begun after
 * the record sends nothing).  Over a lossy transport whose ring failed, and once ours has
 * begun to move, the end is a TCP half-close after the resend. */
static int send_end(rs_conn *c, uint32_t lenword)
{
    rs_lock(&c->tx.lock);
    int r = 0;
    if (!c->tx.fin_sent) {
        c->tx.fin_sent = 1;
        r = RS_GET(c->err) ? -RS_GET(c->err) : 0;
        if (!r && RS_GET(c->fb) && (c->ops->lossy_failure || c->tx.move.state)) rs_fb_shutdown(c);
        else if (!r) {
            put_record(c, lenword, NULL, 0);
            rs_tx_flush_bell(c);
        }
    }
    rs_unlock(&c->tx.lock);
    return r;
}

int rs_send_fin(rs_conn *c) { return send_end(c, RS_LEN_FIN); }

/* An abortive close (the kernel would send RST): the peer's reads end in ECONNRESET. */
int rs_send_reset(rs_conn *c) { return send_end(c, RS_LEN_RESET); }

/* 1 if the peer has not consumed everything we sent (it closed or died with data of ours
 * unread): the transport tells, or once the connection moved, the credit it returned. */
int rs_tx_unread_at_peer(rs_conn *c)
{
    rs_lock(&c->tx.lock);
    int r = 0;
    if (c->tx.bytes && c->tx.ring) r = RS_GET(c->fb) ? rs_tx_credit_unread(c) : c->ops->unread_at_peer(c);
    rs_unlock(&c->tx.lock);
    return r;
}

/* The consumer's credit does not reach past our last data record (caller holds tx_lock). */
int rs_tx_credit_unread(rs_conn *c)
{
    refresh_credit(c);
    return c->tx.head_seen <= c->tx.last_data;
}

/* 1 if a write of at least one small record would not block (caller holds tx_lock). */
int rs_tx_writable_locked(rs_conn *c)
{
    if (RS_GET(c->err) || c->tx.fin_sent) return 1;                 /* the write reports the error */
    if (RS_GET(c->fb)) return rs_fb_tx_writable(c);
    if (RS_GET(c->tcp_eof)) return 1;
    refresh_credit(c);
    return tx_room(c) >= 2u * RS_KEEP_WHOLE + 16;
}

/* Writability for a readiness check (poll, epoll): a full ring that stalled spills, holds
 * what our own ring has (rs_hold.c) or moves to TCP, here, as a wait for room is where a
 * program that writes before it reads waits. */
int rs_tx_writable(rs_conn *c)
{
    rs_lock(&c->tx.lock);
    int r = rs_tx_writable_locked(c), hold = !r && rs_hold_due(c);
    if (!r && rs_spill_due(c)) r = 1;
    if (!r && rs_tx_stalled(c)) r = rs_fb_tx_writable(c);
    rs_unlock(&c->tx.lock);
    if (hold) rs_hold_fill(c);
    return r;
}
