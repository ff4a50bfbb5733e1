/* rs_consume.c - the receive path: validate records, copy out, re-zero, return credit.
 *
 * Every lenword read from the ring is checked against the ring's capacity before it is
 * used to locate a footer or copy a byte; a record whose footer is non-zero but wrong is
 * a corrupt frame.  Either is a sticky EPROTO for this connection, reported after the
 * bytes that arrived intact before it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <string.h>
#include "rs_conn.h"
#include "rs_sys.h"

struct cursor { uint64_t pos, seq; uint32_t cur_len, cur_off; };

static inline uint32_t *word_at(rs_conn *c, uint64_t pos) { return (uint32_t *)(c->rx_ring + (pos & c->mask)); }

/* rdma: a NIC may make a packet's bytes visible in any order (Soft-RoCE under emulation
 * copies byte by byte), so a record can look wrong for an instant.  It is corrupt only if
 * it still looks exactly the same 50 ms later; shm stores are atomic, so there it is now. */
#define RS_SUSPECT_NS 50000000ull
static int confirmed_corrupt(rs_conn *c, const struct cursor *cur, uint32_t lw, uint32_t f)
{
    if (!c->rdma) return 1;
    if (c->fb) return 0;        /* a WRITE cut short by the failure: the resend has the record */
    uint64_t now = rs_now_ns();
    if (c->suspect_pos != cur->pos + 1 || c->suspect_lw != lw || c->suspect_footer != f) {
        c->suspect_pos = cur->pos + 1;
        c->suspect_lw = lw;
        c->suspect_footer = f;
        c->suspect_since = now;
        return 0;
    }
    return now - c->suspect_since >= RS_SUSPECT_NS;
}

/* Looks at the record starting at cur->pos.  1: complete (*lw set), 0: not there yet,
 * -1: corrupt (connection error set). */
static int check_record(rs_conn *c, const struct cursor *cur, uint32_t *lw_out)
{
    uint32_t off = (uint32_t)(cur->pos & c->mask);
    uint32_t lw = __atomic_load_n(word_at(c, cur->pos), __ATOMIC_ACQUIRE);
    if (lw == 0) return 0;
    uint32_t rec;
    if (lw >= RS_LEN_CTL_MIN) {
        if (lw != RS_LEN_WRAP && lw != RS_LEN_FIN) {
            if (!confirmed_corrupt(c, cur, lw, 0)) return 0;
            rs_conn_set_error(c, EPROTO, "rdmasock: corrupt frame: unknown control code 0x%08x at ring offset %u", lw, off);
            return -1;
        }
        rec = 8;
    } else {
        if (lw > c->max_payload) {
            if (!confirmed_corrupt(c, cur, lw, 0)) return 0;
            rs_conn_set_error(c, EPROTO, "rdmasock: corrupt frame: bogus length %u at ring offset %u (max %u)", lw, off, c->max_payload);
            return -1;
        }
        rec = rs_rec_size(lw);
        if ((uint64_t)off + rec > c->ring_size) {
            if (!confirmed_corrupt(c, cur, lw, 0)) return 0;
            rs_conn_set_error(c, EPROTO, "rdmasock: corrupt frame: length %u at ring offset %u crosses the ring end", lw, off);
            return -1;
        }
    }
    uint32_t f = __atomic_load_n((uint32_t *)(c->rx_ring + off + rec - 4), __ATOMIC_ACQUIRE);
    if (f == 0) return 0;                                   /* still being written */
    if (f != rs_footer(c->salt, cur->seq, lw)) {
        if (!confirmed_corrupt(c, cur, lw, f)) return 0;
        rs_conn_set_error(c, EPROTO, "rdmasock: corrupt frame: bad footer 0x%08x at ring offset %u (record %llu)",
                          f, off, (unsigned long long)cur->seq);
        return -1;
    }
    *lw_out = lw;
    return 1;
}

/* Returns the consumed ring bytes to the producer: every quarter ring, when the producer
 * is blocked, or (force) before going idle. */
void rs_rx_publish_credit(rs_conn *c, int force)
{
    if (c->rdma) { rs_rdma_publish_credit(c, force); return; }
    struct rs_dir_ctl *k = c->rx_ctl;
    uint64_t lag = c->rx_pos - c->rx_head_pub;
    if (!lag && !force) return;
    if (!force && lag < c->ring_size / 4 && !__atomic_load_n(&k->tx_waiting, __ATOMIC_RELAXED)) return;
    if (lag) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_sfence();                 /* the re-zeroing is visible before the credit */
#endif
        __atomic_store_n(&k->head, c->rx_pos, __ATOMIC_RELEASE);
        c->rx_head_pub = c->rx_pos;
    }
    rs_ring_bell(c, k, &k->credit_bells, RS_BELL_CREDIT);
}

/* Copies up to len payload bytes out of the ring.  With peek, nothing is consumed. */
size_t rs_rx_take(rs_conn *c, uint8_t *dst, size_t len, int peek)
{
    if (c->fb_rx) return 0;                     /* the ring is done (rs_fallback.c) */
    struct cursor cur = { c->rx_pos, c->rx_seq, c->rx_cur_len, c->rx_cur_off };
    size_t got = 0;
    int fin = 0;
    while (got < len || (!cur.cur_len && !peek)) {
        if (!cur.cur_len) {
            uint32_t lw;
            if (c->fin_seen || check_record(c, &cur, &lw) <= 0) break;
            uint32_t off = (uint32_t)(cur.pos & c->mask);
            if (lw == RS_LEN_WRAP || lw == RS_LEN_FIN) {
                if (!peek) memset(c->rx_ring + off, 0, 8);
                cur.pos += lw == RS_LEN_WRAP ? c->ring_size - off : 8;
                cur.seq++;
                if (lw == RS_LEN_FIN) { fin = 1; break; }
                continue;
            }
            cur.cur_len = lw;
            cur.cur_off = 0;
            if (got == len) break;                /* only advanced over control records */
        }
        uint32_t off = (uint32_t)(cur.pos & c->mask);
        size_t n = cur.cur_len - cur.cur_off;
        if (n > len - got) n = len - got;
        memcpy(dst + got, c->rx_ring + off + 4 + cur.cur_off, n);
        got += n;
        cur.cur_off += (uint32_t)n;
        if (cur.cur_off == cur.cur_len) {
            uint32_t rec = rs_rec_size(cur.cur_len);
            if (!peek) { memset(c->rx_ring + off, 0, rec); c->stat_records_rx++; }
            cur.pos += rec;
            cur.seq++;
            cur.cur_len = cur.cur_off = 0;
        }
    }
    if (peek) return got;
    c->rx_pos = cur.pos; c->rx_seq = cur.seq; c->rx_cur_len = cur.cur_len; c->rx_cur_off = cur.cur_off;
    c->rx_bytes += got;
    if (fin) c->fin_seen = 1;
    rs_rx_publish_credit(c, 0);
    return got;
}

/* 1 if recv would return without waiting: data, EOF, or an error to report. */
int rs_rx_ready(rs_conn *c)
{
    if (c->rx_pre || !c->rx_ring) return 0;        /* the kernel socket tells */
    if (c->fb_rx) return rs_fb_rx_ready(c);
    if (c->rx_cur_len || c->fin_seen || c->err) return 1;
    uint8_t dummy;
    rs_rx_take(c, &dummy, 0, 0);                /* steps over WRAP, notices FIN */
    if (c->rx_cur_len || c->fin_seen || c->err) return 1;
    if (c->fb) return rs_fb_rx_ready(c);        /* the ring has nothing more: the socket has the rest */
    return 0;
}

/* Payload bytes receivable without waiting (FIONREAD). */
static ssize_t ring_available(rs_conn *c);

/* During the preamble: the payload of the frames already on the TCP socket (looked at
 * with a bounded peek), plus the ring's records once SWITCH is among them. */
static ssize_t pre_available(rs_conn *c)
{
    uint8_t buf[4096];
    long n = rs_sys_recv(c->fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    if (n <= 0) return 0;
    size_t pos = 0, len = (size_t)n;
    uint32_t left = c->pre_left;
    ssize_t total = 0;
    for (;;) {
        size_t take = left < len - pos ? left : len - pos;
        total += (ssize_t)take;
        pos += take;
        left -= (uint32_t)take;
        if (left || pos + RS_PRE_HDR > len) return total;
        if (buf[pos] == RS_PRE_SWITCH) return total + (c->rx_ring ? ring_available(c) : 0);
        left = (uint32_t)buf[pos + 4] << 24 | (uint32_t)buf[pos + 5] << 16 | (uint32_t)buf[pos + 6] << 8 | buf[pos + 7];
        pos += RS_PRE_HDR;
    }
}

/* Payload bytes the producer has made available so far (a mark for edge-triggered
 * readiness): shm shares the producer's counter, rdma counts what has landed. */
uint64_t rs_rx_produced(rs_conn *c)
{
    if (!c->rx_ring) return 0;
    if (c->fb_rx) return c->rx_bytes + (uint64_t)rs_fb_rx_available(c);
    return c->rx_bytes + (uint64_t)ring_available(c);
}

ssize_t rs_rx_available(rs_conn *c)
{
    if (c->rx_pre) return pre_available(c);
    if (!c->rx_ring) return 0;
    if (c->fb_rx) return rs_fb_rx_available(c);
    return ring_available(c);
}

static ssize_t ring_available(rs_conn *c)
{
    struct cursor cur = { c->rx_pos, c->rx_seq, c->rx_cur_len, c->rx_cur_off };
    uint64_t total = cur.cur_len - cur.cur_off;
    if (cur.cur_len) { cur.pos += rs_rec_size(cur.cur_len); cur.seq++; }
    for (uint64_t walked = 0; walked < c->ring_size && !c->fin_seen;) {
        uint32_t lw;
        if (check_record(c, &cur, &lw) <= 0) break;
        uint32_t step = lw == RS_LEN_WRAP ? c->ring_size - (uint32_t)(cur.pos & c->mask) : rs_rec_size(lw);
        if (lw == RS_LEN_FIN) break;
        if (lw != RS_LEN_WRAP) total += lw;
        cur.pos += step; cur.seq++; walked += step;
    }
    return (ssize_t)total;
}

/* Adaptive spin: a budget that halves when spinning found nothing and grows back when it
 * did, so two processes sharing one CPU quickly stop burning each other's time slice. */
int rs_peer_shares_cpu(rs_conn *c)
{
    if (!c->rx_ctl) return 0;
    unsigned peer = __atomic_load_n(&c->rx_ctl->tx_cpu, __ATOMIC_RELAXED);
    return peer && peer == (unsigned)sched_getcpu() + 1u;
}

static int spin_for_data(rs_conn *c, size_t want, uint64_t deadline_ns, int peek)
{
    if (!c->spin_ns || rs_peer_shares_cpu(c)) return 0;
    struct rs_dir_ctl *k = c->rx_ctl;
    /* Tell the producer it may skip the doorbell only if it would ring one (want_bell:
     * only we set it, when going idle).  In a busy exchange it is clear, and leaving the
     * line untouched saves a cache-line transfer per message; a peek absorbs nothing, so
     * it must never let the producer skip bells. */
    int publish = !peek && __atomic_load_n(&k->want_bell, __ATOMIC_RELAXED);
    if (publish) {
        __atomic_store_n(&k->spin_limit, c->rx_bytes + want, __ATOMIC_RELAXED);
        __atomic_store_n(&k->spinning, 1, __ATOMIC_RELEASE);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
    uint64_t now0 = rs_now_ns(), end = now0 + c->spin_cur;
    if (deadline_ns && end > deadline_ns) end = deadline_ns;
    uint64_t yield_after = now0 + RS_PURE_SPIN_NS;
    int found = 0;
    for (unsigned i = 0;; i++) {
        if (rs_rx_ready(c)) { found = 1; break; }
        if ((i & 63) == 63) {
            uint64_t now = rs_now_ns();
            if (now >= end) break;
            /* The peer may share our CPU: after a short pure spin, hand it the CPU. */
            if (now >= yield_after) sched_yield();
        }
        rs_relax();
    }
    if (publish) __atomic_store_n(&k->spinning, 0, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);    /* then the caller re-reads the ring */
    if (found) c->spin_cur = c->spin_cur * 2 > c->spin_ns ? c->spin_ns : c->spin_cur * 2;
    else if (c->spin_cur > c->spin_ns / 64 + 500) c->spin_cur /= 2;
    return found;
}

static ssize_t ring_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);

ssize_t rs_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms)
{
    ssize_t got = 0;
    if (len == 0 || c->shut_rd) return 0;
    while (c->rx_pre) {
        ssize_t r = rs_pre_recv(c, (uint8_t *)buf + got, len - (size_t)got, flags, timeout_ms);
        if (r == RS_PRE_OVER) break;
        if (r <= 0) return got ? got : r;
        got += r;
        if ((size_t)got == len || !(flags & RS_MSG_WAITALL) || (flags & RS_MSG_PEEK)) return got;
    }
    if ((size_t)got == len) return got;
    ssize_t r = c->rx_ring ? ring_recv(c, (uint8_t *)buf + got, len - (size_t)got, flags, timeout_ms)
                           : rs_tcp_recv(c->fd, (uint8_t *)buf + got, len - (size_t)got, flags, timeout_ms);
    if (r < 0) return got ? got : r;
    return got + r;
}

static ssize_t ring_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms)
{
    int peek = flags & RS_MSG_PEEK, waitall = (flags & RS_MSG_WAITALL) && !peek;
    int nonblock = (flags & RS_MSG_DONTWAIT) || timeout_ms == 0;
    uint64_t deadline = timeout_ms > 0 ? rs_now_ns() + (uint64_t)timeout_ms * 1000000u : 0;
    size_t got = 0;
    for (;;) {
        got += rs_rx_take(c, (uint8_t *)buf + got, len - got, peek);
        if (got == len || (got && !waitall)) {
            if (!peek) rs_rx_tidy(c);
            return (ssize_t)got;
        }
        if (c->fin_seen) return (ssize_t)got;
        if (c->err) return got ? (ssize_t)got : -c->err;
        if (c->fb && !c->rx_cur_len) {
            /* RDMA failed and the ring has nothing more: the rest comes over TCP */
            if (peek && got) return (ssize_t)got;
            int left = timeout_ms;
            if (deadline) {
                uint64_t now = rs_now_ns();
                left = now >= deadline ? 0 : (int)((deadline - now) / 1000000u + 1);
            }
            ssize_t r = rs_fb_recv(c, (uint8_t *)buf + got, len - got, flags, nonblock ? 0 : left);
            if (r < 0) return got ? (ssize_t)got : r;
            return (ssize_t)got + r;
        }
        if (c->tcp_eof) {
            /* The peer's process is gone.  Whatever it wrote before is in the ring. */
            got += rs_rx_take(c, (uint8_t *)buf + got, len - got, peek);
            /* No FIN record: the peer died or its last holder was a forked process.  TCP
             * shows a closed peer as EOF, and so do we. */
            return (ssize_t)got;
        }
        if (!nonblock && spin_for_data(c, len - got, deadline, peek)) continue;
        if (nonblock ? rs_rx_nonblock_empty(c) : rs_rx_go_idle(c)) continue;
        if (c->tcp_eof || c->err) continue;
        if (nonblock) return got ? (ssize_t)got : -EAGAIN;
        int slice = 500;                        /* re-check now and then, whatever happens */
        if (deadline) {
            uint64_t now = rs_now_ns();
            if (now >= deadline) return got ? (ssize_t)got : -EAGAIN;
            uint64_t left = (deadline - now) / 1000000u + 1;
            if (left < (uint64_t)slice) slice = (int)left;
        }
        int r = rs_wait_fd(c, slice);
        if (r == -EINTR) return got ? (ssize_t)got : -EINTR;
    }
}
