/* rs_consume.c - the receive path: validate records, copy out, re-zero, return credit.
 *
 * Every lenword read from the ring is checked against the ring's capacity before it is
 * used to locate a footer or copy a byte; a record whose footer is non-zero but wrong is
 * a corrupt frame.  Either is a sticky EPROTO for this connection, reported after the
 * bytes that arrived intact before it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "rs_conn.h"
#include "rs_sys.h"

struct cursor { uint64_t pos, seq; uint32_t cur_len, cur_off; };

static inline uint32_t *word_at(rs_conn *c, uint64_t pos) { return (uint32_t *)(c->rx.ring + (pos & c->mask)); }

/* A NIC may make a packet's bytes visible in any order (Soft-RoCE under emulation copies
 * byte by byte), so over such a transport (torn_records) a record can look wrong for an
 * instant.  It is corrupt only if it still looks exactly the same 50 ms later; a
 * producer's own stores (shm) are ordered, so there it is corrupt now. */
#define RS_SUSPECT_NS 50000000ull
static int confirmed_corrupt(rs_conn *c, const struct cursor *cur, uint32_t lw, uint32_t f)
{
    if (!c->ops->torn_records) return 1;
    if (RS_GET(c->fb)) return 0;        /* a WRITE cut short by the failure: the resend has the record */
    uint64_t now = rs_now_ns();
    if (c->rx.suspect_pos != cur->pos + 1 || c->rx.suspect_lw != lw || c->rx.suspect_footer != f) {
        c->rx.suspect_pos = cur->pos + 1;
        c->rx.suspect_lw = lw;
        c->rx.suspect_footer = f;
        c->rx.suspect_since = now;
        return 0;
    }
    return now - c->rx.suspect_since >= RS_SUSPECT_NS;
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
        if (lw != RS_LEN_WRAP && lw != RS_LEN_FIN && lw != RS_LEN_RESET && lw != RS_LEN_MOVED &&
            !(lw == RS_LEN_SPILL && c->spill_ok)) {
            if (!confirmed_corrupt(c, cur, lw, 0)) return 0;
            rs_conn_set_error(c, EPROTO, "rdmasock: corrupt frame: unknown control code 0x%08x at ring offset %u", lw, off);
            return -1;
        }
        rec = rs_rec_size(lw);
        if ((uint64_t)off + rec > c->ring_size) {
            rs_conn_set_error(c, EPROTO, "rdmasock: corrupt frame: control code 0x%08x at ring offset %u crosses the ring end", lw, off);
            return -1;
        }
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
    uint32_t f = __atomic_load_n((uint32_t *)(c->rx.ring + off + rec - 4), __ATOMIC_ACQUIRE);
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

static size_t take_ring(rs_conn *c, uint8_t *dst, size_t len, int peek);

/* Copies up to len payload bytes out of the hold (rs_hold.c), then the ring (caller holds
 * rx_lock).  With peek, nothing is consumed, and a peek at held bytes shows only those. */
size_t rs_rx_take(rs_conn *c, uint8_t *dst, size_t len, int peek)
{
    if (!c->rx.hold_len) return take_ring(c, dst, len, peek);
    size_t n = rs_hold_take(c, dst, len, peek);
    return n == len || peek ? n : n + take_ring(c, dst + n, len - n, 0);
}

/* The ring alone, for the hold (caller holds rx_lock). */
size_t rs_rx_take_ring(rs_conn *c, uint8_t *dst, size_t len) { return take_ring(c, dst, len, 0); }

/* Zeroes a consumed record, its lenword last (release): a producer that finds the lenword
 * zero again (rs_shm.c taken_in_grace) finds the record consumed and zeroed whole. */
static inline void zero_record(uint8_t *rec, uint32_t size)
{
    memset(rec + 4, 0, size - 4);
    __atomic_store_n((uint32_t *)rec, 0, __ATOMIC_RELEASE);
}

/* Copies up to len payload bytes out of the ring (caller holds rx_lock).  With peek,
 * nothing is consumed.  One call walks at most one lap of the ring, whatever the peer
 * keeps writing behind the cursor. */
static size_t take_ring(rs_conn *c, uint8_t *dst, size_t len, int peek)
{
    if (c->rx.move.state) return 0;                     /* the ring is done (rs_fallback.c) */
    if (c->rx.spill_state) return 0;                    /* the socket has the next bytes (rs_spill.c) */
    struct cursor cur = { c->rx.pos, c->rx.seq, c->rx.cur_len, c->rx.cur_off };
    size_t got = 0;
    int fin = 0, moved = 0;
    uint32_t spill = 0;
    uint64_t lap_end = cur.pos + c->ring_size;
    while ((got < len || (!cur.cur_len && !peek)) && cur.pos < lap_end) {
        if (!cur.cur_len) {
            uint32_t lw;
            if (c->rx.fin_seen || check_record(c, &cur, &lw) <= 0) break;
            uint32_t off = (uint32_t)(cur.pos & c->mask);
            if (lw == RS_LEN_MOVED) {
                /* a peek stops before it; a take steps over it and leaves the ring */
                if (peek) break;
                zero_record(c->rx.ring + off, 8);
                cur.pos += 8;
                cur.seq++;
                moved = 1;
                break;
            }
            if (lw == RS_LEN_SPILL) {
                /* the stream goes on on the socket for `count` bytes, then here again; a
                 * peek stops before it (ring_recv steps over it) */
                if (peek) break;
                uint8_t f[8];                   /* copied once, then checked */
                memcpy(f, c->rx.ring + off + 4, sizeof f);
                uint32_t count = (uint32_t)rs_get_le(f, 4), zero = (uint32_t)rs_get_le(f + 4, 4);
                if (!count || count > RS_SPILL_MAX || zero) {
                    rs_conn_set_error(c, EPROTO, "rdmasock: corrupt frame: SPILL of %u bytes at ring offset %u", count, off);
                    break;
                }
                zero_record(c->rx.ring + off, 16);
                cur.pos += 16;
                cur.seq++;
                spill = count;
                break;
            }
            if (lw == RS_LEN_WRAP || lw == RS_LEN_FIN || lw == RS_LEN_RESET) {
                if (!peek) zero_record(c->rx.ring + off, 8);
                if (!peek && lw == RS_LEN_WRAP) rs_rx_saw_wrap(c, off);
                cur.pos += rs_rec_span(c, cur.pos, lw);
                cur.seq++;
                if (lw != RS_LEN_WRAP) { fin = lw == RS_LEN_RESET ? 2 : 1; break; }
                continue;
            }
            cur.cur_len = lw;
            cur.cur_off = 0;
            if (got == len) break;                /* only advanced over control records */
        }
        uint32_t off = (uint32_t)(cur.pos & c->mask);
        size_t n = cur.cur_len - cur.cur_off;
        if (n > len - got) n = len - got;
        memcpy(dst + got, c->rx.ring + off + 4 + cur.cur_off, n);
        got += n;
        cur.cur_off += (uint32_t)n;
        if (cur.cur_off == cur.cur_len) {
            uint32_t rec = rs_rec_size(cur.cur_len);
            if (!peek) { zero_record(c->rx.ring + off, rec); c->rx.records++; }
            cur.pos += rec;
            cur.seq++;
            cur.cur_len = cur.cur_off = 0;
        }
    }
    if (peek) return got;
    __atomic_store_n(&c->rx.pos, cur.pos, __ATOMIC_RELAXED);    /* rx_activity reads it unlocked */
    c->rx.seq = cur.seq; c->rx.cur_len = cur.cur_len; c->rx.cur_off = cur.cur_off;
    c->rx.bytes += got;
    if (fin) c->rx.fin_seen = 1;
    if (fin == 2) c->rx.peer_reset = 1;
    if (spill) rs_spill_begin_rx(c, spill);
    rs_rx_publish_credit(c, moved);
    if (moved) rs_fb_rx_moved(c);
    return got;
}

/* 1 if recv would return without waiting: data, EOF, or an error to report (caller holds
 * rx_lock). */
int rs_rx_ready_locked(rs_conn *c)
{
    if (c->rx.pre.active || !c->rx.ring) return 0;        /* the kernel socket tells */
    if (c->rx.hold_len) return 1;
    if (c->rx.move.state) return rs_fb_rx_ready(c);
    if (c->rx.cur_len || c->rx.fin_seen || RS_GET(c->err) || c->rx.shut_rd) return 1;
    uint8_t dummy;
    rs_rx_take(c, &dummy, 0, 0);                /* steps over WRAP and SPILL, notices FIN */
    if (c->rx.cur_len || c->rx.fin_seen || RS_GET(c->err)) return 1;
    if (c->rx.spill_state) return rs_spill_rx_ready(c);
    if (rs_rx_on_tcp(c)) return rs_fb_rx_ready(c);      /* the ring has nothing more: the socket has the rest */
    return 0;
}

static int pre_ready(rs_conn *c);

/* For readiness hooks.  During the preamble too: the client's frames are data, a SWITCH
 * with nothing behind it is not (it is consumed here). */
int rs_rx_ready(rs_conn *c)
{
    if (!c->rx.ring) return 0;
    if (RS_GET(c->rx.pre.active)) rs_pre_settle(c);
    rs_lock(&c->rx.lock);
    int r = c->rx.pre.active ? pre_ready(c) : rs_rx_ready_locked(c);
    rs_unlock(&c->rx.lock);
    return r;
}

/* shutdown(SHUT_RD): reads take what is there, then return 0.  The kernel's own SHUT_RD
 * wakes any of our calls asleep on the socket, as it would wake a recv (rs_wait_fd); the
 * peer sees nothing of it. */
void rs_shutdown_rd(rs_conn *c)
{
    rs_lock(&c->rx.lock);
    RS_SET(c->rx.shut_rd, 1);
    rs_unlock(&c->rx.lock);
    rs_note_silent_change();
    if (c->word_wake_ok) rs_word_raise(&c->rx.ctl->data_seq);      /* ... and those asleep on the word */
    rs_syscall(SYS_shutdown, rs_fd_enter(c), SHUT_RD);
    rs_fd_leave(c);
}

/* Without the lock: does the ring look as if there were something to read?  (A hint for
 * spinning: the caller confirms under the lock.) */
static int rx_activity(rs_conn *c)
{
    uint64_t pos = __atomic_load_n(&c->rx.pos, __ATOMIC_RELAXED);
    return __atomic_load_n((uint32_t *)(c->rx.ring + (pos & c->mask)), __ATOMIC_RELAXED) != 0 ||
           rs_rx_on_tcp(c) || rs_spill_rx_active(c) || __atomic_load_n(&c->tcp_eof, __ATOMIC_RELAXED) ||
           __atomic_load_n(&c->rx.hold_len, __ATOMIC_RELAXED) ||
           __atomic_load_n(&c->rx.shut_rd, __ATOMIC_RELAXED);
}

/* For hooks that look at many sockets at each wait: 0 if a receive would surely wait (no
 * record at our position, nothing held, no end, error, move or preamble), so the full
 * look (rs_rx_ready, rs_rx_produced) can be skipped; 1 if it may not, or a reader is at
 * it (the full look waits for that reader).  A record that lands just after is found by
 * the arming before any sleep, as after every look. */
int rs_rx_maybe_ready(rs_conn *c)
{
    if (!rs_trylock(&c->rx.lock)) return 1;           /* the reader zeroes what it consumed */
    int r = rx_activity(c) || c->rx.fin_seen || RS_GET(c->err) || RS_GET(c->tcp_eof) || c->rx.pre.active ||
            c->rx.move.state;
    rs_unlock(&c->rx.lock);
    return r;
}

/* Payload bytes receivable without waiting (FIONREAD). */
static ssize_t ring_available(rs_conn *c);

/* During the preamble: the payload of the frames already on the TCP socket (looked at
 * with a bounded peek, behind the first bytes of a header already taken off it), plus
 * the ring's records once SWITCH is among them. */
static ssize_t pre_available(rs_conn *c)
{
    uint8_t buf[RS_PRE_HDR + 4096];
    size_t have = c->rx.pre.hdr_got;
    memcpy(buf, c->rx.pre.hdr, have);
    long n = rs_c_recv(c, buf + have, 4096, MSG_PEEK | MSG_DONTWAIT);
    if (n <= 0) return 0;
    size_t pos = 0, len = have + (size_t)n;
    uint32_t left = c->rx.pre.left;
    ssize_t total = 0;
    for (;;) {
        size_t take = left < len - pos ? left : len - pos;
        total += (ssize_t)take;
        pos += take;
        left -= (uint32_t)take;
        if (left || pos + RS_PRE_HDR > len) return total;
        if (buf[pos] == RS_PRE_SWITCH) return total + (c->rx.ring ? ring_available(c) : 0);
        left = (uint32_t)buf[pos + 4] << 24 | (uint32_t)buf[pos + 5] << 16 | (uint32_t)buf[pos + 6] << 8 | buf[pos + 7];
        pos += RS_PRE_HDR;
    }
}

/* During the preamble (caller holds rx_lock): would a read return without waiting?
 * Frame payload on the socket, or its end or error, which the read reports. */
static int pre_ready(rs_conn *c)
{
    if (RS_GET(c->err) || pre_available(c) > 0) return 1;
    uint8_t b;
    long n = rs_c_recv(c, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && n != -EAGAIN);
}

/* Payload bytes the producer has made available so far (a mark for edge-triggered
 * readiness): what was delivered plus what has landed in the ring. */
uint64_t rs_rx_produced(rs_conn *c)
{
    if (!c->rx.ring) return 0;
    rs_lock(&c->rx.lock);
    uint64_t r = c->rx.bytes + (uint64_t)(c->rx.move.state ? rs_fb_rx_available(c) : ring_available(c));
    rs_unlock(&c->rx.lock);
    return r;
}

ssize_t rs_rx_available(rs_conn *c)
{
    rs_lock(&c->rx.lock);
    ssize_t r = c->rx.pre.active ? pre_available(c) : !c->rx.ring ? 0 : c->rx.move.state ? rs_fb_rx_available(c) : ring_available(c);
    r += (ssize_t)c->rx.hold_len;
    rs_unlock(&c->rx.lock);
    return r;
}

static ssize_t ring_available(rs_conn *c)
{
    if (c->rx.spill_state) return rs_spill_available(c);
    struct cursor cur = { c->rx.pos, c->rx.seq, c->rx.cur_len, c->rx.cur_off };
    uint64_t total = cur.cur_len - cur.cur_off;
    if (cur.cur_len) { cur.pos += rs_rec_size(cur.cur_len); cur.seq++; }
    for (uint64_t walked = 0; walked < c->ring_size && !c->rx.fin_seen;) {
        uint32_t lw;
        if (check_record(c, &cur, &lw) <= 0) break;
        uint32_t step = rs_rec_span(c, cur.pos, lw);
        if (lw == RS_LEN_FIN || lw == RS_LEN_RESET || lw == RS_LEN_MOVED || lw == RS_LEN_SPILL) break;
        if (lw != RS_LEN_WRAP) total += lw;
        cur.pos += step; cur.seq++; walked += step;
    }
    return (ssize_t)total;
}

int rs_peer_shares_cpu(rs_conn *c)
{
    return c->rx.ctl && rs_cpu_is_mine(&c->rx.ctl->tx_cpu);
}

/* Spins for up to the connection's budget (rs_spin, rs_wait.h).  1 found, 0 not, -EINTR:
 * a signal during the spin ended the call (rs_spin_pause). */
static int spin_for_data(rs_conn *c, size_t want, uint64_t deadline_ns, int peek, int progress)
{
    if (!c->spin_ns || rs_peer_shares_cpu(c)) return 0;
    struct rs_dir_ctl *k = c->rx.ctl;
    /* Tell the producer it may skip the doorbell only if it would ring one (want_bell:
     * only we set it, when going idle).  In a busy exchange it is clear, and leaving the
     * line untouched saves a cache-line transfer per message; a peek absorbs nothing, so
     * it must never let the producer skip bells. */
    int publish = !peek && __atomic_load_n(&k->want_bell, __ATOMIC_RELAXED);
    if (publish) {
        __atomic_store_n(&k->spin_limit, c->rx.bytes + want, __ATOMIC_RELAXED);
        __atomic_store_n(&k->spinning, 1, __ATOMIC_RELEASE);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
    uint64_t now0 = rs_now_ns(), end = now0 + rs_spin_allow(&c->rx.spin);
    end = rs_earlier(end, deadline_ns);
    struct rs_sigwait sw = { 0 };
    int found = 0;
    for (unsigned i = 0;; i++) {
        if (rx_activity(c)) { found = 1; break; }
        if ((i & 63) == 63) {
            uint64_t now = rs_now_ns();
            if (now >= end) break;
            /* The peer may share our CPU: after a short pure spin, hand it the CPU. */
            if (rs_spin_pause(now - now0, &sw)) break;
        }
        rs_relax();
    }
    if (publish) {
        __atomic_store_n(&k->spinning, 0, __ATOMIC_SEQ_CST);
        rs_note_silent_change();        /* records that came meanwhile had no bell */
    }
    int sig = found ? (rs_sigwait_end(&sw), 1)
                    : rs_spin_done(&sw, deadline_ns == RS_NEVER && !progress ? RS_SIG_RESTART : RS_SIG_EINTR);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);    /* then the caller re-reads the ring */
    rs_spin_result(&c->rx.spin, found);
    return sig < 0 ? sig : found;
}

/* Without waiting: steps over a MOVED record at the front of the ring and over the
 * socket's doorbells, frame and repeat that follow it.  1 if the stream now reads
 * straight from the socket. */
int rs_rx_reach_tcp(rs_conn *c)
{
    uint8_t none;
    if (!rs_rx_on_tcp(c)) {
        rs_lock(&c->rx.lock);
        if (!c->rx.cur_len) rs_rx_take(c, &none, 0, 0);
        rs_unlock(&c->rx.lock);
    }
    if (rs_rx_on_tcp(c) && !rs_fb_rx_plain(c)) rs_fb_recv(c, &none, 1, RS_MSG_PEEK | RS_MSG_DONTWAIT, 0);
    return rs_fb_rx_plain(c) && !__atomic_load_n(&c->rx.hold_len, __ATOMIC_SEQ_CST);
}

static ssize_t ring_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);

/* MSG_TRUNC on a TCP socket: the bytes are taken and thrown away (with MSG_PEEK only
 * counted), the count is the answer and the buffer is never touched (tcp(7)). */
static ssize_t recv_discard(rs_conn *c, size_t len, int flags, int timeout_ms)
{
    uint8_t sink[4096];
    uint64_t deadline = rs_deadline(timeout_ms);
    if (flags & RS_MSG_PEEK) {
        ssize_t r = rs_recv(c, sink, 1, flags, timeout_ms);
        if (r <= 0) return r;
        long avail = rs_rx_available(c);
        return avail < 1 ? 1 : (size_t)avail > len ? (ssize_t)len : (ssize_t)avail;
    }
    size_t done = 0;
    while (done < len) {
        size_t n = len - done < sizeof sink ? len - done : sizeof sink;
        /* as one read: only the first piece (or every piece, MSG_WAITALL) may wait */
        int fl = done && !(flags & RS_MSG_WAITALL) ? flags | RS_MSG_DONTWAIT : flags;
        ssize_t r = rs_recv(c, sink, n, fl, timeout_ms > 0 ? rs_ms_until(deadline) : timeout_ms);
        if (r <= 0) return done ? (ssize_t)done : r;
        done += (size_t)r;
    }
    return (ssize_t)done;
}

ssize_t rs_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms)
{
    ssize_t got = 0;
    if (len == 0) return 0;
    rs_tx_switch(c);            /* a client's first read ends the server's preamble too */
    if (flags & RS_MSG_TRUNC) return recv_discard(c, len, flags & ~RS_MSG_TRUNC, timeout_ms);
    uint64_t deadline = rs_deadline(timeout_ms);      /* one timeout for the whole call */
    while (RS_GET(c->rx.pre.active)) {
        ssize_t r = rs_pre_recv(c, (uint8_t *)buf + got, len - (size_t)got, flags,
                                timeout_ms > 0 ? rs_ms_until(deadline) : timeout_ms);
        if (r == RS_PRE_OVER) break;
        if (r <= 0) return got ? got : r;
        got += r;
        if ((size_t)got == len || !(flags & RS_MSG_WAITALL) || (flags & RS_MSG_PEEK)) return got;
    }
    if ((size_t)got == len) return got;
    if (timeout_ms > 0) timeout_ms = rs_ms_until(deadline);
    ssize_t r = c->rx.ring ? ring_recv(c, (uint8_t *)buf + got, len - (size_t)got, flags, timeout_ms)
                           : rs_tcp_recv(c, (uint8_t *)buf + got, len - (size_t)got, flags, timeout_ms);
    if (r < 0) return got ? got : r;
    return got + r;
}

#define RS_RECORD_NAP_NS 200000u

/* A blocking receive asleep on the word its peer raises with the next record (arm_word),
 * for at most RS_WORD_WINDOW_MS from `until` on: then it sleeps on the socket, which tells
 * it if the peer died.  Returns as rs_wait_fd: 1 look again, 0 timed out, -EINTR. */
static int word_sleep(rs_conn *c, const uint32_t *word, uint32_t seen, uint64_t deadline, uint64_t until)
{
    __atomic_fetch_add(&c->rx.word_sleeps, 1, __ATOMIC_RELAXED);
    int r = rs_word_wait(word, seen, rs_ms_until(rs_earlier(deadline, until)));
    if (r == 0 && rs_passed(until)) __atomic_fetch_add(&c->rx.word_timeouts, 1, __ATOMIC_RELAXED);
    if (r == -EINTR) return deadline == RS_NEVER && rs_restart_after_signal() ? 1 : -EINTR;
    return r < 0 ? 1 : r;
}

static ssize_t ring_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms)
{
    int peek = flags & RS_MSG_PEEK, waitall = (flags & RS_MSG_WAITALL) && !peek;
    int nonblock = (flags & RS_MSG_DONTWAIT) || timeout_ms == 0;
    uint64_t deadline = rs_deadline(nonblock ? 0 : timeout_ms);
    size_t got = 0;
    ssize_t r;
    /* A record the ring says is there, or activity a spin saw, that yields nothing (being
     * written, or a peer that only pretends to write) is looked at again at most twice,
     * then waited for by napping; once the deadline is reached, looked at once more. */
    int fruitless = 0, last_look = 0, looked_flags = 0;
    uint64_t word_until = 0;                    /* end of the sleeps on a shared word (word_sleep) */
    int quiet = 0;                              /* armed quietly: rs_rx_word_woken_locked is due */
    rs_lock(&c->rx.lock);
    for (;;) {
        if (quiet) {
            quiet = 0;
            rs_rx_word_woken_locked(c);         /* what came is taken now, whatever happens next */
        }
        size_t took = rs_rx_take(c, (uint8_t *)buf + got, len - got, peek);
        got += took;
        fruitless = took ? 0 : fruitless + 1;
        if (got == len || (got && !waitall)) {
            if (!peek) rs_rx_tidy(c);
            r = (ssize_t)got;
            break;
        }
        if (peek && !got && !c->rx.cur_len) {
            uint8_t none;
            rs_rx_take(c, &none, 0, 0);                 /* a SPILL record peeks no further */
        }
        if (c->rx.spill_state) {
            /* the next bytes are on the socket (rs_spill.c), then the ring again */
            rs_unlock(&c->rx.lock);
            if (peek && got) return (ssize_t)got;
            ssize_t n = rs_spill_recv(c, (uint8_t *)buf + got, len - got, flags, nonblock ? 0 : rs_ms_until(deadline));
            if (n < 0) return got ? (ssize_t)got : n;
            got += (size_t)n;
            if (n > 0 && (got == len || !waitall)) return (ssize_t)got;
            fruitless = 0;
            rs_lock(&c->rx.lock);
            continue;
        }
        /* After shutdown(SHUT_RD) a read takes what is there and never waits (Linux TCP). */
        if (c->rx.peer_reset) { r = got ? (ssize_t)got : rs_conn_reset_once(c); break; }
        if (c->rx.fin_seen || c->rx.shut_rd) { r = (ssize_t)got; break; }
        if (RS_GET(c->err)) { r = got ? (ssize_t)got : -RS_GET(c->err); break; }
        if (rs_rx_on_tcp(c) && !c->rx.cur_len) {
            /* the ring has nothing more (RDMA failed, or the peer's MOVED record): the rest
             * comes over TCP */
            rs_unlock(&c->rx.lock);
            if (peek && got) return (ssize_t)got;
            r = rs_fb_recv(c, (uint8_t *)buf + got, len - got, flags, rs_ms_until(deadline));
            if (r < 0) return got ? (ssize_t)got : r;
            return (ssize_t)got + r;
        }
        if (RS_GET(c->tcp_eof)) {
            /* The peer's process is gone.  Whatever it wrote before is in the ring. */
            got += rs_rx_take(c, (uint8_t *)buf + got, len - got, peek);
            if (!got && (rs_rx_on_tcp(c) || c->rx.spill_state)) continue;   /* MOVED or SPILL: the socket has more */
            rs_unlock(&c->rx.lock);
            if (got) return (ssize_t)got;
            if (c->rx.fin_seen) return c->rx.peer_reset ? rs_conn_reset_once(c) : 0;
            /* No FIN record: the peer died, or a forked holder closed it last.  TCP shows
             * that as the end of the stream, unless the peer left data of ours unread:
             * then as a reset. */
            return rs_tx_unread_at_peer(c) ? rs_conn_reset_once(c) : 0;
        }
        if (!nonblock && fruitless <= 2 && !rs_passed(deadline)) {
            rs_unlock(&c->rx.lock);
            int found = spin_for_data(c, len - got, deadline, peek, got > 0);
            if (found < 0) return got ? (ssize_t)got : found;
            rs_lock(&c->rx.lock);
            if (found) continue;
        }
        /* about to sleep: the program may have made the descriptor non-blocking (and the
         * going idle below looks at O_ASYNC in the same flags) */
        long app_flags = -1;
        if (!nonblock && deadline == RS_NEVER && !looked_flags++) {
            app_flags = rs_conn_app_flags(c);
            if (app_flags >= 0 && (app_flags & O_NONBLOCK)) nonblock = 1;
        }
        const uint32_t *word = NULL;
        uint32_t seen = 0;
        int ready = -1;
        if (!nonblock && !rs_passed(deadline)) {
            if (!word_until) word_until = rs_now_ns() + RS_WORD_WINDOW_MS * 1000000ull;
            if (!rs_passed(word_until)) ready = rs_rx_arm_word_locked(c, &word, &seen, peek ? 0 : len - got, app_flags);
            if (ready == 2) ready = 0, quiet = 1;
        }
        if (ready < 0) {
            word = NULL;
            ready = nonblock ? rs_rx_nonblock_empty(c) : rs_rx_go_idle_locked(c, app_flags);
        }
        if (RS_GET(c->tcp_eof) || RS_GET(c->err)) continue;
        if (nonblock || rs_passed(deadline)) {
            if (quiet) continue;                /* woken at the top, and looked at again */
            if (ready && !last_look++) continue;
            r = got ? (ssize_t)got : -EAGAIN;
            break;
        }
        if (ready && fruitless <= 2) continue;
        rs_unlock(&c->rx.lock);
        /* never with the lock: others may read */
        int w = ready ? rs_nap(RS_RECORD_NAP_NS, deadline, got > 0)
                : word ? word_sleep(c, word, seen, deadline, word_until)
                       : rs_wait_fd(c, rs_ms_until(deadline));
        rs_lock(&c->rx.lock);
        if (w == -EINTR) {
            /* records that came quietly are this receive's to take; otherwise the signal */
            int take = quiet && rs_rx_word_woken_locked(c);
            quiet = 0;
            if (!take) {
                rs_unlock(&c->rx.lock);
                return got ? (ssize_t)got : -EINTR;
            }
        }
        if (!ready) fruitless = 0;                      /* woken: worth a spin again */
    }
    rs_unlock(&c->rx.lock);
    return r;
}
