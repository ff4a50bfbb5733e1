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

/* Writes keep 8 bytes of the ring free for the FIN record, so close never has to wait. */
static inline uint64_t tx_free(rs_conn *c)
{
    return (uint64_t)c->ring_size - 8 - (c->tx_pos - c->tx_head_seen);
}

static inline void refresh_credit(rs_conn *c)
{
    if (c->rdma) { rs_rdma_refresh_credit(c); return; }
    c->tx_head_seen = __atomic_load_n(&c->tx_ctl->head, __ATOMIC_ACQUIRE);
}

static void put_record(rs_conn *c, uint32_t lenword, const void *payload, uint32_t n)
{
    uint32_t off = (uint32_t)(c->tx_pos & c->mask), rec = rs_rec_size(lenword);
    uint8_t *p = c->tx_ring + off;
    if (n) memcpy(p + 4, payload, n);
    __atomic_store_n((uint32_t *)p, lenword, __ATOMIC_RELAXED);
    store_fence();
    __atomic_store_n((uint32_t *)(p + rec - 4), rs_footer(c->salt, c->tx_seq, lenword), __ATOMIC_RELEASE);
    c->tx_pos += rec;
    c->tx_seq++;
    c->stat_records_tx++;
}

/* The peer closed its socket: EPIPE, unless its transport failed first and said so. */
static int peer_gone(rs_conn *c)
{
    if (c->rdma && !c->err) rs_rdma_drain(c);
    if (c->fb && !c->err) return -EAGAIN;       /* a RESYNC frame came first: rs_send goes on by TCP */
    return c->err ? -c->err : -EPIPE;
}

/* Small writes are kept in one record (wrapping early); large ones fill the ring tail. */
#define RS_KEEP_WHOLE 512u

/* Blocks until `need` bytes of credit are free, the deadline passes or the peer is gone. */
static int wait_credit(rs_conn *c, uint64_t need, uint64_t deadline_ns)
{
    rs_tx_flush_bell(c);                        /* the consumer must know there is data */
    uint64_t spin_start = rs_now_ns(), spin_end = spin_start + c->spin_ns;
    unsigned backoff_us = 20;
    for (;;) {
        refresh_credit(c);
        if (tx_free(c) >= need) return 0;
        if (c->err) return -c->err;
        if (c->fb) return -EAGAIN;              /* rs_send goes on by TCP */
        if (c->tcp_eof) return peer_gone(c);
        uint64_t now = rs_now_ns();
        if (deadline_ns && now >= deadline_ns) return -EAGAIN;
        if (now < spin_end) { rs_spin_pause(now - spin_start); continue; }
        rs_tx_arm_credit(c);
        refresh_credit(c);
        if (tx_free(c) >= need) return 0;
        /* Sleep without touching the receive side (another thread may be in recv) or
         * the socket's data (its readiness belongs to the receiver): short, growing naps. */
        struct timespec ts = { 0, (long)backoff_us * 1000 };
        nanosleep(&ts, NULL);
        if (backoff_us < 1000) backoff_us *= 2;
        if (!c->tcp_eof) {
            struct pollfd p = { .fd = c->fd, .events = POLLRDHUP | POLLIN };
            if (rs_sys_poll(&p, 1, 0) > 0) {
                if (c->rdma && (p.revents & POLLIN)) rs_rdma_check_peer(c);   /* a RESYNC frame? */
                if (!c->fb && (p.revents & (POLLHUP | POLLERR | POLLRDHUP))) c->tcp_eof = 1;
            }
        }
    }
}

static ssize_t ring_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms);

/* rdma: the transmit state is the producing thread's, under tx_lock, so a thread that finds
 * the transport failed can take the direction over to TCP (rs_fallback.c) in between. */
ssize_t rs_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms)
{
    if (c->err) return -c->err;
    if (!c->rdma) return ring_send(c, buf, len, nonblock, timeout_ms);
    if (c->fb) return rs_fb_send(c, buf, len, nonblock, timeout_ms);
    rs_tx_lock(c);
    ssize_t r = c->fb ? -EAGAIN : ring_send(c, buf, len, nonblock, timeout_ms);
    rs_tx_unlock(c);
    if (!c->fb || c->err) return r;
    rs_fb_kick(c);
    if (r > 0) return r;                        /* in the shadow ring: part of the resend */
    return rs_fb_send(c, buf, len, nonblock, timeout_ms);
}

static ssize_t ring_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms)
{
    const uint8_t *src = buf;
    size_t sent = 0;
    uint64_t deadline = timeout_ms > 0 ? rs_now_ns() + (uint64_t)timeout_ms * 1000000u : 0;
    if (timeout_ms == 0) nonblock = 1;
    if (c->err) return -c->err;
    if (c->tcp_eof) return peer_gone(c);
    if (c->fin_sent) return -EPIPE;
    if (c->fin_seen) {
        /* The peer shut its side down; if it closed the socket altogether, TCP would fail
         * this write with EPIPE: ask the kernel (only ever after a FIN record). */
        struct pollfd p = { .fd = c->fd, .events = POLLRDHUP };
        if (rs_sys_poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR | POLLRDHUP))) { c->tcp_eof = 1; return peer_gone(c); }
    }
    while (sent < len) {
        uint32_t chunk = len - sent > c->max_payload ? c->max_payload : (uint32_t)(len - sent);
        uint32_t to_end = c->ring_size - (uint32_t)(c->tx_pos & c->mask);
        int wrap = 0;
        if (rs_rec_size(chunk) > to_end) {
            if (chunk <= RS_KEEP_WHOLE || to_end < 64) wrap = 1;
            else chunk = to_end - 8;
        }
        uint64_t need = (wrap ? to_end : 0) + rs_rec_size(chunk);
        if (tx_free(c) < need) refresh_credit(c);
        if (tx_free(c) < need && chunk > RS_KEEP_WHOLE) {
            /* Partial room: write what fits rather than wait for all of it (after the
             * wrap, if one is due), as rs_tx_writable promised. */
            uint64_t skip = wrap ? to_end : 0, room = tx_free(c) > skip ? tx_free(c) - skip : 0;
            if (room >= RS_KEEP_WHOLE + 8) { chunk = (uint32_t)((room - 8) & ~7ull); need = skip + rs_rec_size(chunk); }
        }
        if (tx_free(c) < need) {
            if (nonblock) {
                /* Full ring: only here is it worth a system call to learn that the peer
                 * is gone (a nonblocking writer would otherwise retry forever). */
                if (!sent && !c->tcp_eof) {
                    struct pollfd p = { .fd = c->fd, .events = POLLRDHUP };
                    if (rs_sys_poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR | POLLRDHUP))) c->tcp_eof = 1;
                    if (c->tcp_eof) return peer_gone(c);
                }
                break;
            }
            int r = wait_credit(c, need, deadline);
            if (c->fb) break;                   /* sent so far is in the resend; rs_send goes on */
            if (r < 0) {
                if (sent) break;
                return r;
            }
            continue;
        }
        if (wrap) {
            put_record(c, RS_LEN_WRAP, NULL, 0);
            c->tx_pos += to_end - 8;            /* the rest of the tail stays zero */
        }
        put_record(c, chunk, src + sent, chunk);
        c->tx_bytes += chunk;
        sent += chunk;
    }
    unsigned cpu = (unsigned)sched_getcpu() + 1u;          /* vDSO: no system call */
    if (__atomic_load_n(&c->tx_ctl->tx_cpu, __ATOMIC_RELAXED) != cpu)
        __atomic_store_n(&c->tx_ctl->tx_cpu, cpu, __ATOMIC_RELAXED);
    rs_tx_flush_bell(c);
    if (sent == 0 && len > 0) return -EAGAIN;
    return (ssize_t)sent;
}

/* Half-close: a FIN record after the last data byte.  Always fits (8 bytes reserved). */
int rs_send_fin(rs_conn *c)
{
    if (c->fin_sent) return 0;
    rs_tx_lock(c);
    c->fin_sent = 1;
    int r = c->err ? -c->err : 0;
    if (!r && c->fb) rs_fb_shutdown(c);         /* a TCP half-close after the resend */
    else if (!r) {
        put_record(c, RS_LEN_FIN, NULL, 0);
        rs_tx_flush_bell(c);
    }
    rs_tx_unlock(c);
    return r;
}

/* 1 if a write of at least one small record would not block. */
int rs_tx_writable(rs_conn *c)
{
    if (c->err || c->fin_sent) return 1;                 /* the write reports the error */
    if (c->fb) return rs_fb_tx_writable(c);
    if (c->tcp_eof) return 1;
    refresh_credit(c);
    return tx_free(c) >= 2u * RS_KEEP_WHOLE + 16;
}
