/* rs_shm.c - the `shm` transport (docs/PROTOCOL.md section 4): both rings of a connection
 * in one shared segment, and the control words beside them.
 *
 * The segment is one anonymous memfd per connection.  A memfd has no name in any file
 * system, so nothing is left behind after a close, a crash or SIGKILL, and only processes
 * that hold the descriptor (passed with SCM_RIGHTS to the peer alone) can map it.  The
 * size is sealed so neither side can shrink the segment under the other (which would turn
 * the peer's next access into SIGBUS).
 *
 * A record reaches the consumer by the producer's own stores; credit and doorbell requests
 * are words of the shared control block (struct rs_dir_ctl), and doorbell bytes are
 * counted there (data_bells, credit_bells), so a consumer going idle knows how many to
 * read off the socket.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "rs_conn.h"
#include "rs_sys.h"

static int ring_size_ok(uint32_t n)
{
    return n >= RS_RING_MIN && n <= RS_RING_MAX && (n & (n - 1)) == 0;
}

/* Creates and initialises a segment; returns the memfd or -errno. */
int rs_shm_create(uint32_t ring_size, uint64_t salt, size_t *len_out)
{
    if (!ring_size_ok(ring_size)) return -EINVAL;
    size_t len = RS_SEG_HDR_SIZE + 2 * (size_t)ring_size;
    int fd = memfd_create("rdmasock", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return -errno;
    if (ftruncate(fd, (off_t)len) < 0) goto fail;
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) goto fail;
    struct rs_seg_hdr *h = mmap(NULL, RS_SEG_HDR_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) goto fail;
    h->version = RS_PROTO_VERSION;
    h->ring_size = ring_size;
    h->hdr_size = RS_SEG_HDR_SIZE;
    h->salt = salt;
    h->dir[0].want_bell = h->dir[1].want_bell = 1;   /* no doorbell pending yet */
    __atomic_store_n(&h->magic, RS_SEG_MAGIC, __ATOMIC_RELEASE);
    munmap(h, RS_SEG_HDR_SIZE);
    *len_out = len;
    return fd;
fail:;
    int e = errno;
    close(fd);
    return -e;
}

/* Maps a segment received from the peer after checking that it is one: magic, version,
 * ring size and file size must agree, and the size must be sealed.  The header is the
 * peer's to rewrite at any time: what it says is copied into *seg once, checked there,
 * and never read again.  The pages are not populated: an idle connection commits only
 * what is touched.  Returns 0 or -errno (EBADMSG: not a valid segment). */
int rs_shm_map(int memfd, struct rs_seg *seg, size_t reserved)
{
    struct stat st;
    if (fstat(memfd, &st) < 0) return -errno;
    int seals = fcntl(memfd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) return -EBADMSG;
    if (st.st_size < (off_t)RS_SEG_HDR_SIZE) return -EBADMSG;
    /* The mapping counts against the budget: the caller's reservation first (a client made
     * one before it offered shm), the rest now. */
    size_t need = (size_t)st.st_size;
    if (need > reserved && rs_ring_memory_reserve(need - reserved) < 0) return -ENOBUFS;
    if (need < reserved) rs_ring_memory_release(reserved - need);
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (p == MAP_FAILED) { int e = errno; rs_ring_memory_release(need); return -e; }
    const struct rs_seg_hdr *h = p;
    uint32_t magic = __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE);
    uint32_t version = __atomic_load_n(&h->version, __ATOMIC_RELAXED);
    uint32_t hdr_size = __atomic_load_n(&h->hdr_size, __ATOMIC_RELAXED);
    uint32_t ring_size = __atomic_load_n(&h->ring_size, __ATOMIC_RELAXED);
    uint64_t salt = __atomic_load_n(&h->salt, __ATOMIC_RELAXED);
    if (magic != RS_SEG_MAGIC || version != RS_PROTO_VERSION || hdr_size != RS_SEG_HDR_SIZE ||
        !ring_size_ok(ring_size) || (off_t)(RS_SEG_HDR_SIZE + 2 * (size_t)ring_size) != st.st_size) {
        rs_ring_unmap(p, need);
        return -EBADMSG;
    }
    seg->base = p;
    seg->len = (size_t)st.st_size;
    seg->ring_size = ring_size;
    seg->salt = salt;
    return 0;
}

#define GRACE_MAX_NS 8000u       /* the doorbell's wait for a consumer between receives (taken_in_grace) */
#define GRACE_MIN_NS 250u
#define GRACE_OFF    64u

/* Takes ownership of the mapping seg describes (rs_shm_map: checked copies of the
 * header, which is never read again for them), and unmaps it if it returns NULL.  The server consumes ring 0 and produces
 * into ring 1; the client the other way round. */
rs_conn *rs_conn_attach_shm(const struct rs_seg *seg, int fd, int is_server, uint32_t spin_ns)
{
    struct rs_seg_hdr *h = seg->base;
    rs_conn *c = rs_conn_alloc();
    if (!c) { rs_ring_unmap(seg->base, seg->len); return NULL; }
    c->ops = &rs_transport_shm;
    c->fd = fd;
    rs_conn_set_ring(c, seg->ring_size, 1);
    c->salt = seg->salt;
    uint8_t *ring0 = (uint8_t *)seg->base + RS_SEG_HDR_SIZE, *ring1 = ring0 + seg->ring_size;
    int rx_dir = is_server ? RS_DIR_C2S : RS_DIR_S2C;
    c->rx.ctl = &h->dir[rx_dir];
    c->tx.ctl = &h->dir[1 - rx_dir];
    c->rx.ring = rx_dir == RS_DIR_C2S ? ring0 : ring1;
    c->tx.ring = rx_dir == RS_DIR_C2S ? ring1 : ring0;
    c->spin_ns = spin_ns;
    rs_spin_init(&c->rx.spin, spin_ns);
    c->tx.grace_ns = spin_ns < GRACE_MAX_NS ? spin_ns : GRACE_MAX_NS;
    c->map_base = seg->base;
    c->map_len = seg->len;
    return c;
}

/* ---- doorbells -------------------------------------------------------------------------
 * A consumer going idle sets want_bell; the producer answers the next record with one data
 * doorbell.  A producer with a full ring sets tx_waiting; the consumer answers its next
 * credit with one credit doorbell.  Each side counts what it sent in the control block
 * before sending, so the other knows how many bytes to read off the socket. */

/* The counter was raised before the send (the consumer's snapshot relies on that order);
 * a byte that never left is taken back so the consumer does not wait to drain it. */
static int send_counted(rs_conn *c, uint8_t kind, uint64_t *counter)
{
    if (rs_bell_send(c, kind)) return 1;
    __atomic_fetch_sub(counter, 1, __ATOMIC_SEQ_CST);
    return 0;
}

/* A consumer that asked for a doorbell and did not say it sleeps (want_bell exactly 1; a
 * sleeper adds RS_WANT_SLEEPS) is in its program between two receives, or in a wait of
 * its own (select): a loop comes back within microseconds and takes the record anyway,
 * and a doorbell then costs a system call on each side for nothing (a Python program
 * between recv calls: about 0.6 doorbells per round trip).  So before ringing, the
 * producer watches the last record it wrote for a moment: once the consumer has taken it
 * (its lenword is zero again), no doorbell is due, and the request stays for the next
 * record.  The record is published already; only the doorbell waits, at most grace_ns.
 * The wait halves after one that did not pay, and stops for GRACE_OFF doorbells below
 * GRACE_MIN_NS, then tries again; none while the consumer last ran on our CPU, or while
 * this thread waits for its CPU (rs_cpus_busy): the consumer could not run meanwhile.  (A
 * hold never takes records of an shm ring, stall_ms moves it instead: a zero lenword
 * means a receive took them.) */
static int taken_in_grace(rs_conn *c)
{
    struct rs_dir_ctl *k = c->tx.ctl;
    if (c->tx.grace_off) { c->tx.grace_off--; return 0; }
    if (rs_cpu_is_mine(&k->rx_cpu) || rs_cpus_busy()) return 0;
    const uint32_t *lenword = (const uint32_t *)(c->tx.ring + (c->tx.last_rec & c->mask));
    uint64_t end = rs_now_ns() + c->tx.grace_ns;
    for (unsigned i = 1;; i++) {
        if (!__atomic_load_n(lenword, __ATOMIC_ACQUIRE)) {
            c->tx.grace_ns = c->tx.grace_ns * 2 < GRACE_MAX_NS ? c->tx.grace_ns * 2 : GRACE_MAX_NS;
            if (c->spin_ns < c->tx.grace_ns) c->tx.grace_ns = c->spin_ns;
            return 1;
        }
        /* the consumer went to sleep (RS_WANT_SLEEPS, or a wake-up other than the byte):
         * the rule decides afresh */
        if (__atomic_load_n(&k->want_bell, __ATOMIC_RELAXED) != RS_WANT_NEXT) break;
        if (!(i & 15) && rs_now_ns() >= end) break;
        rs_relax();
    }
    c->tx.grace_ns /= 2;
    if (c->tx.grace_ns < GRACE_MIN_NS) { c->tx.grace_ns = GRACE_MIN_NS; c->tx.grace_off = GRACE_OFF; }
    return 0;
}

/* Producer (caller holds tx_lock): the records are in the peer's ring already; wake the
 * consumer if it asked for it, by the means it asked for (want_bell's bits).  The bell is
 * counted before the request is claimed: a consumer that withdraws its request (before
 * its close) and then reads the counter knows of every bell still to come, and reads it
 * off the socket (a byte arriving after the close would make the kernel reset the
 * connection, and after a move to TCP the reset throws away stream data). */
static void shm_flush(rs_conn *c)
{
    struct rs_dir_ctl *k = c->tx.ctl;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);           /* pairs with the consumer's fence */
    uint32_t want = __atomic_load_n(&k->want_bell, __ATOMIC_RELAXED);
    if (!want) return;                                  /* a bell is pending */
    if (!(want & RS_WANT_EVERY) && __atomic_load_n(&k->spinning, __ATOMIC_ACQUIRE) &&
        c->tx.bytes <= __atomic_load_n(&k->spin_limit, __ATOMIC_ACQUIRE))
        return;                                         /* a spinning recv will absorb it */
    if (want == RS_WANT_NEXT && c->tx.grace_ns) {
        if (taken_in_grace(c)) return;
        want = __atomic_load_n(&k->want_bell, __ATOMIC_SEQ_CST);
        if (!want) return;
    }
    if (want & RS_WANT_EVENT) {
        /* the consumer waits where its eventfd wakes it (rs_bells.c); one we cannot raise
         * (none agreed, a write that failed) is asked of the socket instead, which that
         * wait holds too */
        if ((__atomic_fetch_and(&k->want_bell, ~RS_WANT_EVENT, __ATOMIC_SEQ_CST) & RS_WANT_EVENT) && !rs_bell_raise(c))
            __atomic_fetch_or(&k->want_bell, RS_WANT_NEXT, __ATOMIC_SEQ_CST);
        want = __atomic_load_n(&k->want_bell, __ATOMIC_SEQ_CST);
        if (!want) return;
    }
    int wake = 0;
    if (want & RS_WANT_QUIET) {
        /* receives asleep on the word that read up to quiet_limit (6.13): the word alone,
         * if that is all we published; a byte for later records either way */
        if (__atomic_fetch_and(&k->want_bell, ~(RS_WANT_QUIET | RS_WANT_FUTEX), __ATOMIC_SEQ_CST) & RS_WANT_QUIET) {
            int fits = c->tx.bytes <= __atomic_load_n(&k->quiet_limit, __ATOMIC_SEQ_CST);
            __atomic_fetch_or(&k->want_bell, RS_WANT_NEXT, __ATOMIC_SEQ_CST);
            if (fits) {
                rs_word_raise(&k->data_seq);
                return;
            }
            wake = 1;
        }
        want = __atomic_load_n(&k->want_bell, __ATOMIC_SEQ_CST);
    }
    if (!(want & (RS_WANT_NEXT | RS_WANT_EVERY))) {
        /* only a sleeper on the shared word: no byte, nothing to count (a bell asked for
         * meanwhile stays for the next record: its consumer looks at the ring after asking) */
        if (__atomic_fetch_and(&k->want_bell, ~RS_WANT_FUTEX, __ATOMIC_SEQ_CST) & RS_WANT_FUTEX)
            rs_word_raise(&k->data_seq);
        return;
    }
    __atomic_fetch_add(&k->data_bells, 1, __ATOMIC_SEQ_CST);
    want = __atomic_load_n(&k->want_bell, __ATOMIC_SEQ_CST);
    if (!(want & RS_WANT_EVERY)) {
        want = __atomic_exchange_n(&k->want_bell, 0, __ATOMIC_SEQ_CST);
        /* RS_WANT_EVERY asked for meanwhile: it stays */
        if (want & RS_WANT_EVERY) __atomic_fetch_or(&k->want_bell, RS_WANT_EVERY, __ATOMIC_SEQ_CST);
    } else if (want & RS_WANT_FUTEX) {
        /* RS_WANT_EVERY: the consumer's program learns of each arrival from a SIGIO, as over
         * TCP, so every publication rings, spinning consumer or not; the request stays. */
        want = __atomic_fetch_and(&k->want_bell, ~RS_WANT_FUTEX, __ATOMIC_SEQ_CST);
    }
    if (!(want & (RS_WANT_NEXT | RS_WANT_EVERY)))
        __atomic_fetch_sub(&k->data_bells, 1, __ATOMIC_SEQ_CST);      /* no bell after all */
    /* Not sent (send buffer full, e.g. of preamble the peer has not read yet): the
     * consumer still wants one, so the next record tries again. */
    else if (!send_counted(c, RS_BELL_DATA, &k->data_bells) && !(want & RS_WANT_EVERY))
        __atomic_fetch_or(&k->want_bell, RS_WANT_NEXT, __ATOMIC_SEQ_CST);
    if ((want & RS_WANT_FUTEX) || wake) rs_word_raise(&k->data_seq);
}

/* Consumer: wake a producer blocked on a full ring (credit was just published).  Under
 * tx_lock: once our own direction has moved to TCP (its RESYNC frame is out), no byte but
 * the stream may follow it; a producer waiting for credit then finds it in memory (its
 * waits nap and look). */
static void credit_bell(rs_conn *c)
{
    struct rs_dir_ctl *k = c->rx.ctl;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&k->tx_waiting, __ATOMIC_RELAXED)) return;
    rs_lock(&c->tx.lock);
    if (!c->tx.move.state) {
        __atomic_fetch_add(&k->credit_bells, 1, __ATOMIC_SEQ_CST);        /* counted before claimed, as in shm_flush */
        if (!__atomic_exchange_n(&k->tx_waiting, 0, __ATOMIC_SEQ_CST))
            __atomic_fetch_sub(&k->credit_bells, 1, __ATOMIC_SEQ_CST);
        else if (!send_counted(c, RS_BELL_CREDIT, &k->credit_bells))
            __atomic_store_n(&k->tx_waiting, 1, __ATOMIC_SEQ_CST);
    }
    rs_unlock(&c->tx.lock);
}

/* Doorbell bytes at the front of what the socket holds (peeked: n bytes in buf): how many
 * may be read off.  A RESYNC frame's first byte ends them: the peer's direction moved to
 * TCP and our ring has its MOVED record, which the consumer reaches first.  So does a
 * SPILL mark: its SPILL record is in our ring, or about to be. */
static long leading_bells(rs_conn *c, const uint8_t *buf, long n)
{
    int next;
    long k = rs_bell_scan(buf, n, &next, NULL);
    if (next >= 0 && next != RS_BELL_RESYNC && !(next == RS_BELL_SPILL && c->spill_ok)) rs_bell_garbage(c, next);
    return k;
}

/* Reads up to `todo` doorbell bytes that were sent before the caller's snapshot (the
 * peer writes the counter: at most 64 reads, whatever it says). */
static void drain_bells(rs_conn *c, uint64_t todo)
{
    uint8_t buf[256];
    for (int rounds = 0; todo > 0 && !RS_GET(c->tcp_eof) && rounds < 64; rounds++) {
        long n = rs_c_recv(c, buf, todo < sizeof buf ? todo : sizeof buf, MSG_PEEK | MSG_DONTWAIT);
        if (rs_bell_read_result(c, n) <= 0) break;      /* EAGAIN: still in flight */
        long k = leading_bells(c, buf, n);
        if (k) rs_c_recv(c, buf, (size_t)k, MSG_DONTWAIT);     /* exactly the bells peeked */
        c->rx.bells_drained += (uint64_t)k;
        todo -= (uint64_t)k;
        if (k < n) break;
    }
}

/* With every counted bell drained, anything still readable is either a bell sent after
 * the snapshot, EOF (the peer is gone), a RESYNC frame or garbage.  Peeking consumes
 * nothing, so the invariant holds; without this an idle nonblocking reader would never
 * see EOF.  Bells a dead peer left behind (credit doorbells for writes that finished
 * anyway) hide its end from the peek: then the kernel is asked. */
static void check_uncounted(rs_conn *c)
{
    uint8_t buf[64];
    long n = rs_c_recv(c, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    if (rs_bell_read_result(c, n) <= 0) return;
    if (leading_bells(c, buf, n) == n) rs_peer_gone(c);
}

/* check_uncounted now and then.  A waiter goes idle before every sleep, and a program that
 * reads until EAGAIN finds its ring empty after every message (a server under load: for
 * every statement): a peek each time cost a system call per message.  What the peek finds
 * (the peer's end, a garbage byte) also makes the socket readable, so a wait that skipped
 * it wakes at once and looks again.  At most every millisecond, then; every 50 ms under
 * the preload library (lazy_tidy), whose poll/select/epoll hooks look into a readable
 * socket themselves (drop_stale), so only a program that never waits, or waits where no
 * hook sees it, relies on this peek to notice its peer's death. */
static void check_uncounted_now_and_then(rs_conn *c)
{
    uint64_t now = rs_now_ns(), every = c->rx.lazy_tidy ? 50000000u : 1000000u;
    if (now - c->rx.last_peek_ns <= every) return;
    c->rx.last_peek_ns = now;
    check_uncounted(c);
}

/* Doorbell bytes the peer counted as sent to us, both kinds. */
static uint64_t bells_counted(rs_conn *c)
{
    return __atomic_load_n(&c->rx.ctl->data_bells, __ATOMIC_SEQ_CST) +
           __atomic_load_n(&c->tx.ctl->credit_bells, __ATOMIC_SEQ_CST);
}

/* Reads off the doorbells counted so far, unless a record is there (1).  Snapshot before
 * the re-check: a bell counted here belongs to a record the re-check is guaranteed to see,
 * so draining it cannot strand that record without a bell.  *all: every counted bell was
 * read. */
static int drain_counted(rs_conn *c, int *all)
{
    uint64_t sent = bells_counted(c);
    if (rs_rx_ready_locked(c)) return 1;
    if (sent > c->rx.bells_drained) drain_bells(c, sent - c->rx.bells_drained);
    *all = sent <= c->rx.bells_drained;
    return 0;
}

/* `bell`: what to ask for, RS_WANT_NEXT or RS_WANT_EVENT (RS_WANT_EVERY overrides it).
 * `peek`: look at the socket now and then for what is not a counted bell (the peer's end,
 * garbage); not needed where the kernel's wait holds the socket and its reports are
 * looked into (drop_stale). */
static int go_idle(rs_conn *c, int check, uint32_t bell, int peek)
{
    struct rs_dir_ctl *k = c->rx.ctl;
    if (c->rx.move.state) return rs_fb_rx_ready(c);     /* past the peer's MOVED record: the socket is the stream */
    if (c->rx.spill_state) return rs_spill_rx_ready(c); /* inside a SPILL: the socket has the next bytes */
    if (check) c->ops->publish_credit(c, 1);    /* really idle: hand back all credit */
    /* or'ed: another thread of ours may be asleep on the shared word (RS_WANT_FUTEX), or
     * in a wait that needs the socket's byte (RS_WANT_NEXT).  A caller that goes to sleep
     * in the kernel (or returns EAGAIN, whose program does) says so: the producer then
     * rings at once instead of waiting for it to take the record (taken_in_grace). */
    uint32_t want = c->rx.bell_every ? RS_WANT_EVERY : bell;
    if (check && want == RS_WANT_NEXT) want |= RS_WANT_SLEEPS;
    __atomic_fetch_or(&k->want_bell, want, __ATOMIC_SEQ_CST);
    int all;
    if (drain_counted(c, &all)) return 1;
    if (peek && all && !RS_GET(c->tcp_eof)) check_uncounted_now_and_then(c);
    return 0;
}

/* Consumer found its ring empty (caller holds rx_lock): want_bell set and every doorbell
 * sent before that drained; 1 if a record is there after all. */
static int shm_go_idle(rs_conn *c) { return go_idle(c, 1, RS_WANT_NEXT, 1); }

/* The same, for an epoll wait that our event bell wakes: the peer raises the bell, not the
 * socket (without a bell, the socket).  That wait holds the socket too, and what the
 * kernel reports for it is looked into (shm_drop_stale): no peeks here, which cost a
 * server with a thousand connections a system call per connection and millisecond. */
static int shm_go_idle_event(rs_conn *c)
{
    return go_idle(c, 1, c->rx.bell_fd >= 0 ? RS_WANT_EVENT : RS_WANT_NEXT, 0);
}

/* Bit 0 (a byte for the next record) replaced by bits 2 and 4, never a moment with neither
 * (6.13).  quiet_limit: the least of the payload positions the
 * receives asleep will read up to. */
static void quiet_arm(rs_conn *c, size_t room)
{
    struct rs_dir_ctl *k = c->rx.ctl;
    uint64_t limit = c->rx.bytes + room;
    if (c->rx.quiet_sleepers++) {
        uint64_t cur = __atomic_load_n(&k->quiet_limit, __ATOMIC_RELAXED);
        if (cur < limit) limit = cur;
    }
    __atomic_store_n(&k->quiet_limit, limit, __ATOMIC_SEQ_CST);
    /* the request first, then bit 0 away: a producer that finds both answers quietly and
     * ORs bit 0 back, which this receive, not yet asleep, clears or outlives (its re-check) */
    __atomic_fetch_or(&k->want_bell, RS_WANT_FUTEX | RS_WANT_QUIET, __ATOMIC_SEQ_CST);
    __atomic_fetch_and(&k->want_bell, ~(RS_WANT_NEXT | RS_WANT_SLEEPS), __ATOMIC_SEQ_CST);
}

/* A receive armed by quiet_arm is out of its sleep (caller holds rx_lock).  The last one
 * out withdraws the request and asks for a byte again, because its program may
 * wait for the descriptor next; 1 if a publication answered the request without a byte:
 * its records are in the ring, and the receive takes them (they end by quiet_limit). */
static int shm_word_woken(rs_conn *c)
{
    struct rs_dir_ctl *k = c->rx.ctl;
    if (!c->rx.quiet_sleepers || --c->rx.quiet_sleepers) return 1;
    /* bit 0 first, then the request away (two atomics, no loop on a word the peer writes) */
    __atomic_fetch_or(&k->want_bell, RS_WANT_NEXT, __ATOMIC_SEQ_CST);
    return !(__atomic_fetch_and(&k->want_bell, ~(RS_WANT_QUIET | RS_WANT_FUTEX), __ATOMIC_SEQ_CST) & RS_WANT_QUIET);
}

/* A blocking receive found the ring empty (caller holds rx_lock), and both ends speak
 * FUTEX_WAKE: the producer is asked to raise data_seq with the next record (a futex wake,
 * a fraction of a doorbell byte's send and the receiver's two reads of it).  The same
 * order as go_idle: the request, the word's value, then the re-check, so a record the
 * re-check misses was published after the request and raises the word past *seen.
 * Where the program may wait for the descriptor in the kernel (not lazy_tidy: the Python
 * API), bit 0 stays asked for (6.7), unless both ends speak QUIET_WAKE and the receive will
 * take whatever comes (`room`): then the byte is asked for only if more comes (6.13). */
static int shm_arm_word(rs_conn *c, const uint32_t **word, uint32_t *seen, size_t room)
{
    struct rs_dir_ctl *k = c->rx.ctl;
    if (!c->word_wake_ok || c->rx.move.state || c->rx.spill_state) return -1;
    c->ops->publish_credit(c, 1);
    int quiet = c->quiet_wake_ok && room && !c->rx.lazy_tidy && !c->rx.bell_every;
    if (quiet) quiet_arm(c, room);
    else __atomic_fetch_or(&k->want_bell, RS_WANT_FUTEX, __ATOMIC_SEQ_CST);
    *word = &k->data_seq;
    *seen = __atomic_load_n(&k->data_seq, __ATOMIC_SEQ_CST);
    if (rs_rx_ready_locked(c)) {
        if (quiet) shm_word_woken(c);           /* no sleep: the request must not outlive the receive */
        return 1;
    }
    return quiet ? 2 : 0;
}

/* A non-blocking receive found the ring empty.  Programs that read until EAGAIN (libpq,
 * event loops) do so after every message; arming there (want_bell) made the peer ring a
 * doorbell for the next message, a send and a wake-up per request.  Under the preload
 * library (lazy_tidy) the wait that follows goes through its poll/epoll hooks, which arm
 * before they sleep, so this only hands back credit and, at most every millisecond, looks
 * for EOF (an idle reader that never waits must still see the peer's death).  1 if a
 * record is there after all. */
static int shm_nonblock_empty(rs_conn *c)
{
    c->ops->publish_credit(c, 1);
    if (rs_rx_ready_locked(c)) return 1;
    if (!RS_GET(c->tcp_eof)) check_uncounted_now_and_then(c);
    return 0;
}

/* After a recv emptied the ring: if doorbell bytes are outstanding, read them now so a
 * level-triggered select/epoll does not report a readiness that has been consumed.
 * Costs a system call only in episodes where the producer already paid one. */
static void shm_tidy(rs_conn *c)
{
    /* Under the preload library poll/select/epoll look at the ring first, so a stale
     * doorbell costs nothing there, while draining it here re-arms want_bell: the next
     * record then rings again, and a request/response exchange paid a send and a recv
     * system call per message for it.  The stale byte keeps the invariant (6.7). */
    if (c->rx.lazy_tidy) return;
    if (bells_counted(c) > c->rx.bells_drained && !rs_rx_ready_locked(c)) go_idle(c, 0, RS_WANT_NEXT, 0);
}

/* The kernel reported the socket readable and the ring has nothing new for it.  Doorbells
 * of records already consumed are read off without asking for the next one (as go_idle
 * would); then what else the socket holds is looked at: the peer's end, garbage.  Bells of
 * records still unread stay (another wait of the program may rely on them); behind them
 * the kernel is asked whether the peer is gone. */
static void shm_drop_stale(rs_conn *c)
{
    int all = 1;
    if (c->rx.spill_state) return;                          /* the socket has stream bytes */
    if (bells_counted(c) > c->rx.bells_drained) {
        if (rs_rx_ready_locked(c)) all = 0;
        else if (drain_counted(c, &all)) return;            /* a record came meanwhile */
    }
    if (RS_GET(c->tcp_eof)) return;
    if (all) check_uncounted(c);
    else rs_peer_gone(c);
}

/* rs_spill_settle: our credit doorbell request withdrawn; doorbells of records consumed
 * read off, if no reader is at it (it would read them) and the socket holds no stream
 * bytes in front of them. */
static void shm_after_spill(rs_conn *c)
{
    __atomic_store_n(&c->tx.ctl->tx_waiting, 0, __ATOMIC_SEQ_CST);
    if (!rs_trylock(&c->rx.lock)) return;
    int all;
    if (!c->rx.spill_state && !c->rx.move.state && !RS_GET(c->rx.pre.active) && bells_counted(c) > c->rx.bells_drained)
        drain_counted(c, &all);
    rs_unlock(&c->rx.lock);
}

/* A lazy client's SWITCH (rs_pre_switch_later) may come long after the server closed, and
 * a byte reaching a closed socket is answered with a reset, which throws away what the
 * server's socket still holds for the client (spilled bytes).  Each side announces itself,
 * then looks at the other (both sequentially consistent): either the client sees that the
 * server closes and sends no SWITCH, or the server sees the SWITCH on its way and waits for
 * it (PROTOCOL 2.9). */
static int shm_may_switch(rs_conn *c)
{
    struct rs_dir_ctl *k = c->tx.ctl;
    __atomic_store_n(&k->switching, 1, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&k->closing, __ATOMIC_SEQ_CST)) return 1;
    __atomic_store_n(&k->switching, 2, __ATOMIC_SEQ_CST);
    return 0;
}

static int shm_closing_unswitched(rs_conn *c)
{
    struct rs_dir_ctl *k = c->rx.ctl;
    __atomic_store_n(&k->closing, 1, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&k->switching, __ATOMIC_SEQ_CST) == 1;
}

static void shm_bell_every(rs_conn *c, int on)
{
    uint32_t *want = &c->rx.ctl->want_bell;
    if (c->rx.move.state) return;
    if (on) __atomic_fetch_or(want, RS_WANT_EVERY, __ATOMIC_SEQ_CST);
    else if (__atomic_fetch_and(want, ~RS_WANT_EVERY, __ATOMIC_SEQ_CST) & RS_WANT_EVERY)
        __atomic_fetch_or(want, RS_WANT_NEXT, __ATOMIC_SEQ_CST);    /* still idle: the next one */
}

/* Before close (caller holds rx_lock): no doorbell wanted any more, and those already sent
 * read off the socket (a short bounded wait for ones in flight). */
static void shm_quiesce(rs_conn *c)
{
    __atomic_store_n(&c->rx.ctl->want_bell, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&c->tx.ctl->tx_waiting, 0, __ATOMIC_SEQ_CST);
    if (RS_GET(c->rx.pre.active)) return;        /* bytes behind preamble frames: not ours to read */
    uint64_t until = rs_now_ns() + RS_QUIESCE_NS;
    for (int i = 0; i < 64; i++) {
        uint64_t sent = bells_counted(c);
        if (sent <= c->rx.bells_drained || RS_GET(c->tcp_eof) || rs_now_ns() >= until) break;
        drain_bells(c, sent - c->rx.bells_drained);
        if (sent > c->rx.bells_drained) {
            struct timespec ts = { 0, 200000 };
            nanosleep(&ts, NULL);
        }
    }
}

/* ---- credit ---------------------------------------------------------------------------- */

/* Producer with a full ring, before it sleeps (caller holds tx_lock). */
static int shm_arm_credit(rs_conn *c)
{
    /* what we put in, for a holder that looks at rings nobody reads (rs_hold.c); kept
     * only here, off the path of a ring with room */
    __atomic_store_n(&c->tx.ctl->tx_bytes, c->tx.bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&c->tx.ctl->tx_waiting, 1, __ATOMIC_SEQ_CST);
    return rs_tx_writable_locked(c);
}

/* The credit the consumer returned (its `head`, which the peer may set to anything): taken
 * only if it is a record boundary between the last credit and what we wrote; anything else
 * is ignored, and the writer waits for credit as long as its timeout lets it. */
static void shm_refresh_credit(rs_conn *c)
{
    rs_take_credit(c, __atomic_load_n(&c->tx.ctl->head, __ATOMIC_ACQUIRE));
}

/* Returns the consumed ring bytes to the producer: every quarter of its window, when the
 * producer is blocked, or (force) before going idle. */
static void shm_publish_credit(rs_conn *c, int force)
{
    struct rs_dir_ctl *k = c->rx.ctl;
    uint64_t lag = c->rx.pos - c->rx.head_pub;
    if (!lag && !force) return;
    if (!force && lag < c->rx.credit_lag && !__atomic_load_n(&k->tx_waiting, __ATOMIC_RELAXED)) return;
    if (lag) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_sfence();                 /* the re-zeroing is visible before the credit */
#endif
        __atomic_store_n(&k->head, c->rx.pos, __ATOMIC_RELEASE);
        c->rx.head_pub = c->rx.pos;
        rs_cpu_note(&k->rx_cpu);
    }
    credit_bell(c);
}

/* The consumer re-zeroes records in order as it consumes them, so our last data record
 * still being there says it left data unread. */
static int shm_unread_at_peer(rs_conn *c)
{
    return __atomic_load_n((uint32_t *)(c->tx.ring + (c->tx.last_data & c->mask)), __ATOMIC_ACQUIRE) != 0;
}

static uint64_t shm_peer_posted(rs_conn *c)
{
    return __atomic_load_n(&c->rx.ctl->tx_bytes, __ATOMIC_RELAXED);
}

static void nothing(rs_conn *c) { (void)c; }

/* The shared words of both directions (the peer writes half of them). */
static int shm_describe(rs_conn *c, char *buf, size_t n)
{
    const struct rs_dir_ctl *rx = c->rx.ctl, *tx = c->tx.ctl;
    int k = snprintf(buf, n, "; shared: rx head=%llu bells data=%llu credit=%llu seq data=%u credit=%u; "
                     "tx head=%llu bells data=%llu credit=%llu seq data=%u credit=%u",
                     RS_SEEN(rx->head), RS_SEEN(rx->data_bells), RS_SEEN(rx->credit_bells), (unsigned)RS_SEEN(rx->data_seq),
                     (unsigned)RS_SEEN(rx->credit_seq), RS_SEEN(tx->head), RS_SEEN(tx->data_bells), RS_SEEN(tx->credit_bells),
                     (unsigned)RS_SEEN(tx->data_seq), (unsigned)RS_SEEN(tx->credit_seq));
    return k < 0 ? 0 : (size_t)k >= n ? (int)n - 1 : k;
}

const struct rs_transport rs_transport_shm = {
    .name = "shm",
    .id = RS_TRANSPORT_SHM,
    .stall_ms = 500,
    .room_recheck_ms = 10,
    .refresh_credit = shm_refresh_credit,
    .flush = shm_flush,
    .arm_credit = shm_arm_credit,
    .unread_at_peer = shm_unread_at_peer,
    .peer_posted = shm_peer_posted,
    .check_peer = nothing,                      /* the peer's MOVED record comes through the ring */
    .silence = nothing,                         /* its bells stop at our tx.move.state (credit_bell) */
    .publish_credit = shm_publish_credit,
    .go_idle = shm_go_idle,
    .go_idle_event = shm_go_idle_event,
    .arm_word = shm_arm_word,
    .word_woken = shm_word_woken,
    .nonblock_empty = shm_nonblock_empty,
    .tidy = shm_tidy,
    .drop_stale = shm_drop_stale,
    .after_spill = shm_after_spill,
    .bell_every = shm_bell_every,
    .may_switch = shm_may_switch,
    .closing_unswitched = shm_closing_unswitched,
    .quiesce = shm_quiesce,
    .closed = nothing,
    .after_fork_child = rs_bells_after_fork_child,
    .free = rs_bells_release,
    .describe = shm_describe,
};
