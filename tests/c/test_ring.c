/* test_ring.c - unit tests of the shared-memory ring data path (shim/) and of the
 * preamble frames a client writes before the server's answer (rs_preamble.c, pre_*).
 *
 * Built by tests/test_ring_c.py together with the shim/ sources, once under ASan/UBSan and once
 * with -O2.  Every test builds its own connection pair: one memfd segment (rs_shm_create)
 * mapped twice (rs_shm_map), attached as server and client, with a connected AF_UNIX
 * socketpair standing in for the TCP socket that carries doorbell bytes.
 *
 * usage: test_ring [-l] [-x NAME]... [NAME]...
 *   no NAME: run every test; -x NAME: skip that test; -l: list the tests.
 * Each test prints "ok NAME"; a failed check prints "FAIL NAME (file:line): ..." and aborts.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "rs_conn.h"
#include "rs_fdmap.h"

/* ---- checks ------------------------------------------------------------------------ */

static const char *volatile cur_test = "(none)";

#define FAIL_AT(what, ...)                                                            \
    do {                                                                              \
        fprintf(stderr, "FAIL %s (%s:%d): %s", cur_test, __FILE__, __LINE__, what);   \
        fprintf(stderr, __VA_ARGS__);                                                 \
        fputc('\n', stderr);                                                          \
        fflush(NULL);                                                                 \
        abort();                                                                      \
    } while (0)

#define FAIL(...) FAIL_AT("", __VA_ARGS__)

#define CHECK(cond, ...)                                                              \
    do {                                                                              \
        if (!(cond)) FAIL_AT("CHECK(" #cond ") failed: ", __VA_ARGS__);               \
    } while (0)

#define CHECK_EQ(a, b)                                                                \
    do {                                                                              \
        long long a_ = (long long)(a), b_ = (long long)(b);                          \
        if (a_ != b_) FAIL_AT("CHECK_EQ(" #a ", " #b ") failed: ", "%lld != %lld", a_, b_); \
    } while (0)

/* the message of a connection's sticky error must contain `word` */
#define CHECK_MSG(c, word)                                                            \
    do {                                                                              \
        const char *m_ = rs_conn_errmsg(c);                                           \
        if (!strstr(m_, (word)))                                                      \
            FAIL("error message \"%s\" does not mention \"%s\"", m_, (word));          \
    } while (0)

static void on_alarm(int sig)
{
    (void)sig;
    static const char pre[] = "FAIL: watchdog: test took too long: ";
    const char *t = cur_test;
    if (write(2, pre, sizeof pre - 1) < 0 || write(2, t, strlen(t)) < 0 || write(2, "\n", 1) < 0) {}
    abort();
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {}
}

/* ---- deterministic data ------------------------------------------------------------ */

struct rng { uint64_t s; };

static uint64_t rnd(struct rng *r)
{
    r->s ^= r->s >> 12; r->s ^= r->s << 25; r->s ^= r->s >> 27;
    return r->s * 0x2545F4914F6CDD1Dull;
}

static uint64_t rnd_range(struct rng *r, uint64_t lo, uint64_t hi)   /* inclusive */
{
    return lo + rnd(r) % (hi - lo + 1);
}

static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 33; x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33; x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
}

/* Byte `i` of stream `s`: a pseudo-random function of the absolute stream position, so a
 * lost, repeated or reordered byte shows up at the exact position where it happens. */
static inline uint8_t pat(uint32_t s, uint64_t i)
{
    return (uint8_t)(mix64(((uint64_t)s << 48) ^ (i >> 3) ^ 0x5bd1e995ull) >> ((i & 7) * 8));
}

static void fill_pat(uint8_t *b, uint32_t s, uint64_t pos, size_t n)
{
    for (size_t i = 0; i < n; i++) b[i] = pat(s, pos + i);
}

#define VERIFY_PAT(b, s, pos, n)                                                      \
    do {                                                                              \
        const uint8_t *vb_ = (const uint8_t *)(b);                                    \
        uint64_t vp_ = (pos);                                                         \
        size_t vn_ = (n);                                                             \
        for (size_t vi_ = 0; vi_ < vn_; vi_++)                                        \
            if (vb_[vi_] != pat((s), vp_ + vi_))                                      \
                FAIL("stream %u: byte at stream offset %llu is 0x%02x, expected 0x%02x " \
                     "(recv chunk of %zu bytes starting at %llu)", (unsigned)(s),       \
                     (unsigned long long)(vp_ + vi_), vb_[vi_], pat((s), vp_ + vi_), vn_, \
                     (unsigned long long)vp_);                                        \
    } while (0)

static uint64_t fnv(uint64_t h, const uint8_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 0x100000001B3ull; }
    return h;
}
#define FNV_INIT 0xCBF29CE484222325ull

/* ---- connection pairs -------------------------------------------------------------- */

struct pair {
    rs_conn *srv, *cli;      /* srv consumes ring 0 (client->server), cli ring 1 */
    int fd[2];               /* fd[0]: the server's "TCP socket", fd[1]: the client's */
    void *heap;              /* heap-backed segment (see pair_open_heap), else NULL */
    uint32_t ring;
};

static uint64_t salt_counter = 0x243F6A8885A308D3ull;

static void pair_sockets(struct pair *p)
{
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, p->fd) == 0, "socketpair: %s", strerror(errno));
}

/* The real thing: one memfd segment, mapped twice (as two processes would). */
static void pair_open(struct pair *p, uint32_t ring, uint32_t spin_ns)
{
    memset(p, 0, sizeof *p);
    p->ring = ring;
    size_t len = 0;
    int memfd = rs_shm_create(ring, salt_counter++ * 0x9E3779B97F4A7C15ull, &len);
    CHECK(memfd >= 0, "rs_shm_create: %s", strerror(-memfd));
    struct rs_seg s1, s2;
    int e1 = rs_shm_map(memfd, &s1, 0), e2 = rs_shm_map(memfd, &s2, 0);
    CHECK(!e1 && !e2, "rs_shm_map: %s / %s", strerror(-e1), strerror(-e2));
    CHECK(s1.base != s2.base, "two mappings expected");
    CHECK_EQ(s1.len, len);
    CHECK_EQ(s2.len, len);
    CHECK_EQ(s1.ring_size, ring);
    close(memfd);
    pair_sockets(p);
    p->srv = rs_conn_attach_shm(&s1, p->fd[0], 1, spin_ns);
    p->cli = rs_conn_attach_shm(&s2, p->fd[1], 0, spin_ns);
    CHECK(p->srv && p->cli, "rs_conn_attach_shm");
    CHECK_EQ(p->srv->ring_size, ring);
    CHECK_EQ(p->srv->max_payload, ring / 4 - 8);
}

/* The same layout in one malloc'd block that both sides share, so that AddressSanitizer's
 * redzone sits right behind ring 1 (the client's receive ring): any read or write past the
 * end of that ring is reported. */
static void pair_open_heap(struct pair *p, uint32_t ring, uint32_t spin_ns)
{
    memset(p, 0, sizeof *p);
    p->ring = ring;
    size_t len = RS_SEG_HDR_SIZE + 2 * (size_t)ring;
    p->heap = aligned_alloc(4096, len);
    CHECK(p->heap, "aligned_alloc");
    memset(p->heap, 0, len);
    struct rs_seg_hdr *h = p->heap;
    h->magic = RS_SEG_MAGIC;
    h->version = RS_PROTO_VERSION;
    h->ring_size = ring;
    h->hdr_size = RS_SEG_HDR_SIZE;
    h->salt = salt_counter++ * 0x9E3779B97F4A7C15ull;
    h->dir[0].want_bell = h->dir[1].want_bell = 1;
    pair_sockets(p);
    struct rs_seg seg = { p->heap, len, ring, h->salt };
    p->srv = rs_conn_attach_shm(&seg, p->fd[0], 1, spin_ns);
    p->cli = rs_conn_attach_shm(&seg, p->fd[1], 0, spin_ns);
    CHECK(p->srv && p->cli, "rs_conn_attach_shm");
    p->srv->map_base = p->cli->map_base = NULL;       /* not a mapping: do not munmap */
}

static void close_fd(struct pair *p, int i)
{
    if (p->fd[i] >= 0) close(p->fd[i]);
    p->fd[i] = -1;
}

static void pair_close(struct pair *p)
{
    rs_conn_free(p->srv);
    rs_conn_free(p->cli);
    free(p->heap);
    close_fd(p, 0);
    close_fd(p, 1);
    memset(p, 0, sizeof *p);
}

/* ---- helpers ----------------------------------------------------------------------- */

static void send_all_nb(rs_conn *c, const void *b, size_t n)
{
    ssize_t r = rs_send(c, b, n, 1, 0);
    CHECK(r == (ssize_t)n, "nonblocking rs_send of %zu bytes returned %zd (%s)", n, r,
          r < 0 ? strerror((int)-r) : "short");
}

static void send_str(rs_conn *c, const char *s) { send_all_nb(c, s, strlen(s)); }

static void recv_exact(rs_conn *c, void *b, size_t n, int timeout_ms)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = rs_recv(c, (uint8_t *)b + got, n - got, 0, timeout_ms);
        CHECK(r > 0, "rs_recv returned %zd (%s) after %zu of %zu bytes; errmsg \"%s\"", r,
              r < 0 ? strerror((int)-r) : "EOF", got, n, rs_conn_errmsg(c));
        got += (size_t)r;
    }
}

static void expect_str(rs_conn *c, const char *s)
{
    size_t n = strlen(s);
    char buf[512];
    CHECK(n < sizeof buf, "string too long");
    recv_exact(c, buf, n, 1000);
    buf[n] = 0;
    CHECK(memcmp(buf, s, n) == 0, "received \"%s\", expected \"%s\"", buf, s);
}

static void expect_recv_rc(rs_conn *c, ssize_t want, int flags, int timeout_ms)
{
    uint8_t buf[64];
    ssize_t r = rs_recv(c, buf, sizeof buf, flags, timeout_ms);
    CHECK(r == want, "rs_recv returned %zd, expected %zd; errmsg \"%s\"", r, want, rs_conn_errmsg(c));
}

static int ring_is_zero(const uint8_t *ring, uint32_t n, uint32_t *first_nz)
{
    for (uint32_t i = 0; i < n; i++)
        if (ring[i]) { *first_nz = i; return 0; }
    return 1;
}

#define CHECK_RING_ZERO(c)                                                            \
    do {                                                                              \
        uint32_t nz_ = 0;                                                             \
        if (!ring_is_zero((c)->rx.ring, (c)->ring_size, &nz_))                         \
            FAIL("receive ring not zero after everything was consumed: byte at offset %u is 0x%02x " \
                 "(rx_pos %llu)", nz_, (c)->rx.ring[nz_], (unsigned long long)(c)->rx.pos); \
    } while (0)

static uint64_t head_of(rs_conn *consumer) { return __atomic_load_n(&consumer->rx.ctl->head, __ATOMIC_ACQUIRE); }

/* Fills the ring `c` sends into with `msg`-byte writes (stream `stream`, next byte at
 * *pos) until a nonblocking send fails with EAGAIN; returns the number of writes that
 * went in (whole or, for large writes, in part). */
static int fill_ring(rs_conn *c, size_t msg, uint32_t stream, uint64_t *pos)
{
    uint8_t buf[4096];
    CHECK(msg <= sizeof buf, "msg too large");
    for (int k = 0;; k++) {
        fill_pat(buf, stream, *pos, msg);
        ssize_t r = rs_send(c, buf, msg, 1, 0);
        if (r == -EAGAIN) return k;
        CHECK(r > 0 && (r == (ssize_t)msg || msg > 512), "rs_send(%zu) returned %zd while filling", msg, r);
        *pos += (uint64_t)r;
        CHECK(k < 1000000, "ring never fills");
    }
}

/* Sends records (stream `stream`, next byte at *pos) until the producer's tx_pos is
 * `target`, which must lie within the free space. */
static void advance_to(rs_conn *c, uint64_t target, uint32_t stream, uint64_t *pos)
{
    uint8_t buf[4096];
    while (c->tx.pos < target) {
        uint64_t rem = target - c->tx.pos;
        CHECK(rem >= 16 && rem % 8 == 0, "cannot advance by %llu", (unsigned long long)rem);
        size_t n = (size_t)rem - 8;
        if (n > c->max_payload) {
            n = c->max_payload;
            if (rem - (n + 8) == 8) n -= 8;             /* never leave a gap of 8 */
        }
        CHECK(n <= sizeof buf, "ring too large for advance_to");
        fill_pat(buf, stream, *pos, n);
        send_all_nb(c, buf, n);
        *pos += n;
    }
    CHECK_EQ(c->tx.pos, target);
}

/* ---- 1. basic ---------------------------------------------------------------------- */

static void t_basic(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    size_t l;
    CHECK_EQ(rs_shm_create(1000, 1, &l), -EINVAL);

    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
    send_str(p.cli, "hello");
    expect_str(p.srv, "hello");
    send_str(p.srv, "world!");
    expect_str(p.cli, "world!");
    expect_recv_rc(p.srv, -EAGAIN, 0, 0);
    expect_recv_rc(p.cli, -EAGAIN, RS_MSG_DONTWAIT, 0);

    /* every length 1..64, every byte value, several records read in one call */
    uint8_t out[64], in[64 * 65 / 2 + 16];
    size_t total = 0;
    uint64_t rec0 = p.cli->tx.records;
    for (int n = 1; n <= 64; n++) {
        for (int i = 0; i < n; i++) out[i] = (uint8_t)(n * 37 + i * 251);
        send_all_nb(p.cli, out, (size_t)n);
        total += (size_t)n;
    }
    CHECK_EQ(p.cli->tx.records - rec0, 64);
    ssize_t r = rs_recv(p.srv, in, sizeof in, 0, 1000);
    CHECK_EQ(r, total);
    size_t o = 0;
    for (int n = 1; n <= 64; n++)
        for (int i = 0; i < n; i++, o++)
            CHECK(in[o] == (uint8_t)(n * 37 + i * 251), "byte %zu of message %d differs", o, n);
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);

    /* all 256 byte values, including ones that look like control words */
    uint8_t all[256];
    for (int i = 0; i < 256; i++) all[i] = (uint8_t)(255 - i);
    uint32_t ctl = RS_LEN_WRAP;
    memcpy(all, &ctl, 4);
    send_all_nb(p.srv, all, sizeof all);
    uint8_t back[256];
    recv_exact(p.cli, back, sizeof back, 1000);
    CHECK(memcmp(all, back, sizeof all) == 0, "256-byte message differs");

    CHECK_EQ(p.cli->tx.bytes, total + 6 - 1);        /* "hello" + 1..64 */
    CHECK_EQ(p.srv->rx.bytes, total + 5);
    CHECK_EQ(p.cli->err, 0);
    CHECK_EQ(p.srv->err, 0);
    pair_close(&p);
}

/* ---- 2. wrap-around ---------------------------------------------------------------- */

struct producer {
    rs_conn *c;
    uint32_t stream;
    uint64_t total, seed;
    size_t min_write, max_write;
    int single;              /* one rs_send of `total` bytes (split test) */
    uint64_t cks, laps, writes;
};

static void *producer_run(void *arg)
{
    struct producer *a = arg;
    rs_conn *c = a->c;
    struct rng r = { a->seed };
    size_t cap = a->single ? a->total : a->max_write;
    uint8_t *buf = malloc(cap);
    CHECK(buf, "malloc");
    uint64_t pos = 0;
    a->cks = FNV_INIT;
    while (pos < a->total) {
        size_t n = a->single ? a->total : (size_t)rnd_range(&r, a->min_write, a->max_write);
        if (n > a->total - pos) n = a->total - pos;
        fill_pat(buf, a->stream, pos, n);
        uint64_t lap0 = c->tx.pos / c->ring_size;
        ssize_t s = rs_send(c, buf, n, 0, 20000);
        CHECK(s == (ssize_t)n, "blocking rs_send of %zu bytes at stream offset %llu returned %zd; errmsg \"%s\"",
              n, (unsigned long long)pos, s, rs_conn_errmsg(c));
        a->laps += c->tx.pos / c->ring_size - lap0;
        a->cks = fnv(a->cks, buf, n);
        pos += n;
        a->writes++;
    }
    CHECK_EQ(rs_send_fin(c), 0);
    free(buf);
    return NULL;
}

/* Producer thread writes `total` bytes into `p.srv`'s ring; the main thread reads them
 * with recv buffers of random sizes, checking every byte and the running checksum. */
static void stream_through(struct pair *p, struct producer *a, size_t max_read, uint64_t seed)
{
    pthread_t th;
    a->c = p->srv;
    uint64_t rx0 = p->cli->rx.bytes, tx0 = p->srv->tx.bytes;
    CHECK(pthread_create(&th, NULL, producer_run, a) == 0, "pthread_create");
    struct rng r = { seed };
    uint8_t *buf = malloc(max_read);
    uint64_t got = 0, cks = FNV_INIT;
    while (got < a->total) {
        size_t n = (size_t)rnd_range(&r, 1, max_read);
        ssize_t k = rs_recv(p->cli, buf, n, 0, 20000);
        CHECK(k > 0 && (size_t)k <= n, "rs_recv(%zu) returned %zd after %llu of %llu bytes; errmsg \"%s\"",
              n, k, (unsigned long long)got, (unsigned long long)a->total, rs_conn_errmsg(p->cli));
        VERIFY_PAT(buf, a->stream, got, (size_t)k);
        cks = fnv(cks, buf, (size_t)k);
        got += (uint64_t)k;
    }
    expect_recv_rc(p->cli, 0, 0, 20000);                /* the FIN */
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    CHECK(cks == a->cks, "stream checksum %016llx != producer's %016llx", (unsigned long long)cks,
          (unsigned long long)a->cks);
    CHECK_EQ(p->cli->rx.bytes - rx0, a->total);
    CHECK_EQ(p->srv->tx.bytes - tx0, a->total);
    CHECK_RING_ZERO(p->cli);
    free(buf);
}

static void t_wrap(void)
{
    struct pair p;
    pair_open(&p, 4096, 20000);
    struct producer a = { .stream = 2, .total = 6u << 20, .seed = 12345, .min_write = 1, .max_write = 5000 };
    stream_through(&p, &a, 6000, 777);
    /* stat_records_tx counts every record: data, WRAP and the FIN; stat_records_rx data only */
    uint64_t wraps = p.srv->tx.records - p.cli->rx.records - 1;
    printf("  wrap: %llu bytes in %llu writes, %llu data records, %llu WRAP records, %llu laps\n",
           (unsigned long long)a.total, (unsigned long long)a.writes, (unsigned long long)p.cli->rx.records,
           (unsigned long long)wraps, (unsigned long long)a.laps);
    CHECK(wraps > 100, "expected many WRAP records, counted %llu", (unsigned long long)wraps);
    CHECK(a.laps >= a.total / 4096 - 1, "the ring was lapped only %llu times", (unsigned long long)a.laps);
    pair_close(&p);

    /* small writes only: mostly whole records, so nearly every lap ends in a WRAP */
    pair_open(&p, 4096, 0);
    struct producer b = { .stream = 3, .total = 1u << 20, .seed = 99, .min_write = 1, .max_write = 600 };
    stream_through(&p, &b, 700, 778);
    wraps = p.srv->tx.records - p.cli->rx.records - 1;
    CHECK(wraps > b.laps / 2, "%llu WRAP records in %llu laps", (unsigned long long)wraps, (unsigned long long)b.laps);
    pair_close(&p);
}

/* Both directions at once: each thread owns one end and interleaves nonblocking writes and
 * reads, waiting (blocking send or recv with a short timeout) only when neither moved. */
struct duplex {
    rs_conn *c;
    uint32_t out_stream, in_stream;
    uint64_t total, seed;
    uint64_t cks_out, cks_in, waits;
};

static void *duplex_run(void *arg)
{
    struct duplex *d = arg;
    rs_conn *c = d->c;
    struct rng r = { d->seed };
    uint8_t *obuf = malloc(5000), *ibuf = malloc(6000);
    uint64_t sent = 0, rcvd = 0, chunk_pos = 0;
    size_t chunk_n = 0;
    int eof = 0;
    d->cks_out = d->cks_in = FNV_INIT;
    while (sent < d->total || !eof) {
        int progress = 0;
        for (int phase = 0; phase < 3; phase++) {
            /* phase 0: nonblocking send, 1: nonblocking recv, 2: wait in one of them */
            int do_send, block = phase == 2;
            if (phase == 2) {
                if (progress) break;
                d->waits++;
                if (sent == d->total) do_send = 0;
                else if (eof) do_send = 1;
                else do_send = (int)(rnd(&r) & 1);
            } else {
                do_send = phase == 0;
            }
            if (do_send && sent < d->total) {
                if (chunk_pos + chunk_n == sent) {        /* previous chunk fully sent */
                    chunk_pos = sent;
                    chunk_n = (size_t)rnd_range(&r, 1, 5000);
                    if (chunk_n > d->total - sent) chunk_n = d->total - sent;
                    fill_pat(obuf, d->out_stream, chunk_pos, chunk_n);
                }
                size_t off = (size_t)(sent - chunk_pos);
                ssize_t k = rs_send(c, obuf + off, chunk_n - off, !block, block ? 5 : 0);
                if (k > 0) {
                    CHECK((size_t)k <= chunk_n - off, "rs_send overshoot");
                    d->cks_out = fnv(d->cks_out, obuf + off, (size_t)k);
                    sent += (uint64_t)k;
                    progress = 1;
                    if (sent == d->total) CHECK_EQ(rs_send_fin(c), 0);
                } else {
                    CHECK(k == -EAGAIN, "rs_send returned %zd; errmsg \"%s\"", k, rs_conn_errmsg(c));
                }
            } else if (!do_send && !eof) {
                size_t n = (size_t)rnd_range(&r, 1, 6000);
                ssize_t k = rs_recv(c, ibuf, n, block ? 0 : RS_MSG_DONTWAIT, block ? 5 : 0);
                if (k > 0) {
                    VERIFY_PAT(ibuf, d->in_stream, rcvd, (size_t)k);
                    d->cks_in = fnv(d->cks_in, ibuf, (size_t)k);
                    rcvd += (uint64_t)k;
                    progress = 1;
                } else if (k == 0) {
                    CHECK(rcvd == d->total, "EOF after %llu of %llu bytes", (unsigned long long)rcvd,
                          (unsigned long long)d->total);
                    eof = 1;
                    progress = 1;
                } else {
                    CHECK(k == -EAGAIN, "rs_recv returned %zd; errmsg \"%s\"", k, rs_conn_errmsg(c));
                }
            }
        }
    }
    free(obuf);
    free(ibuf);
    return NULL;
}

static void t_wrap_duplex(void)
{
    struct pair p;
    pair_open(&p, 4096, 20000);
    struct duplex ds = { .c = p.srv, .out_stream = 10, .in_stream = 11, .total = 3u << 20, .seed = 5 };
    struct duplex dc = { .c = p.cli, .out_stream = 11, .in_stream = 10, .total = 3u << 20, .seed = 6 };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, duplex_run, &ds) == 0, "pthread_create");
    duplex_run(&dc);
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    CHECK(ds.cks_out == dc.cks_in && dc.cks_out == ds.cks_in, "duplex checksums differ");
    uint64_t wraps = p.srv->tx.records - p.cli->rx.records - 1 + p.cli->tx.records - p.srv->rx.records - 1;
    printf("  duplex: 2 x %llu bytes, %llu WRAP records, waits %llu/%llu, bells %llu/%llu, sleeps %llu/%llu\n",
           (unsigned long long)ds.total, (unsigned long long)wraps, (unsigned long long)ds.waits,
           (unsigned long long)dc.waits, (unsigned long long)p.srv->bells_sent,
           (unsigned long long)p.cli->bells_sent, (unsigned long long)p.srv->rx.sleeps,
           (unsigned long long)p.cli->rx.sleeps);
    CHECK(wraps > 0, "no WRAP records");
    CHECK_RING_ZERO(p.srv);
    CHECK_RING_ZERO(p.cli);
    CHECK_EQ(p.srv->err, 0);
    CHECK_EQ(p.cli->err, 0);
    pair_close(&p);
}

/* ---- 3. split ---------------------------------------------------------------------- */

static void t_split(void)
{
    struct pair p;
    /* single-threaded: 3000 bytes into an empty 4096-byte ring = 1016 + 1016 + 968 */
    pair_open(&p, 4096, 0);
    uint8_t out[3000], in[3000];
    fill_pat(out, 20, 0, sizeof out);
    uint64_t rec0 = p.cli->tx.records;
    send_all_nb(p.cli, out, sizeof out);
    CHECK_EQ(p.cli->tx.records - rec0, 3);
    ssize_t r = rs_recv(p.srv, in, sizeof in, 0, 1000);       /* one call spans all records */
    CHECK_EQ(r, sizeof in);
    VERIFY_PAT(in, 20, 0, sizeof in);
    CHECK_EQ(p.srv->rx.records, 3);
    pair_close(&p);

    /* one large write per ring size, read with random buffer sizes by the other thread */
    static const uint32_t rings[] = { 4096, 65536 };
    for (unsigned i = 0; i < sizeof rings / sizeof rings[0]; i++) {
        pair_open(&p, rings[i], 20000);
        struct producer a = { .stream = 21 + i, .total = 64u * rings[i] + 12345, .seed = 1, .single = 1 };
        stream_through(&p, &a, 3 * p.srv->max_payload, 4242 + i);
        uint64_t min_records = (a.total + p.srv->max_payload - 1) / p.srv->max_payload;
        CHECK(p.cli->rx.records >= min_records, "%llu bytes arrived in only %llu records (max payload %u)",
              (unsigned long long)a.total, (unsigned long long)p.cli->rx.records, p.srv->max_payload);
        CHECK_EQ(a.writes, 1);
        pair_close(&p);
    }
}

/* ---- 4. footer validation ---------------------------------------------------------- */

static void t_footer(void)
{
    struct pair p;
    uint8_t a[100], b[200], c[50], in[1000];
    fill_pat(a, 30, 0, sizeof a);
    fill_pat(b, 30, 100, sizeof b);
    fill_pat(c, 30, 300, sizeof c);

    for (int variant = 0; variant < 2; variant++) {
        pair_open(&p, 4096, 0);
        if (variant) {                                  /* start somewhere in the middle */
            uint8_t pad[2504];
            fill_pat(pad, 31, 0, sizeof pad);
            send_all_nb(p.cli, pad, sizeof pad);
            recv_exact(p.srv, pad, sizeof pad, 1000);
        }
        send_all_nb(p.cli, a, sizeof a);
        send_all_nb(p.cli, b, sizeof b);
        uint64_t pos_c = p.cli->tx.pos;
        send_all_nb(p.cli, c, sizeof c);
        /* flip one bit of record c's footer, through the producer's own mapping */
        uint32_t *foot = (uint32_t *)(p.cli->tx.ring + (pos_c & p.cli->mask) + rs_rec_size(sizeof c) - 4);
        uint32_t good = *foot;
        CHECK(good != 0, "footer not written");
        *foot = good ^ (good & 0x100 ? 0x1 : 0x100);     /* stays non-zero */
        /* earlier intact records first: partially, then the rest */
        ssize_t r = rs_recv(p.srv, in, 50, 0, 1000);
        CHECK_EQ(r, 50);
        VERIFY_PAT(in, 30, 0, 50);
        r = rs_recv(p.srv, in, sizeof in, 0, 1000);
        CHECK(r == 250, "rs_recv returned %zd, expected the 250 intact bytes; errmsg \"%s\"", r, rs_conn_errmsg(p.srv));
        VERIFY_PAT(in, 30, 50, 250);
        r = rs_recv(p.srv, in, sizeof in, 0, 1000);
        CHECK(r == -EPROTO, "rs_recv returned %zd, expected -EPROTO for the corrupt footer", r);
        CHECK_MSG(p.srv, "footer");
        /* sticky; blocking and nonblocking alike, no waiting */
        double t0 = now_ms();
        expect_recv_rc(p.srv, -EPROTO, 0, 2000);
        CHECK(now_ms() - t0 < 500, "error not reported at once");
        expect_recv_rc(p.srv, -EPROTO, RS_MSG_PEEK, 0);
        CHECK_EQ(p.srv->rx.bytes, 300 + (variant ? 2504 : 0));
        pair_close(&p);
    }

    /* the very first record corrupt: nothing delivered */
    pair_open(&p, 4096, 0);
    send_all_nb(p.cli, a, sizeof a);
    uint32_t *foot = (uint32_t *)(p.srv->rx.ring + rs_rec_size(sizeof a) - 4);
    *foot ^= 0x80000000u;
    expect_recv_rc(p.srv, -EPROTO, 0, 1000);
    CHECK_MSG(p.srv, "footer");
    pair_close(&p);

    /* a footer of a different connection (other salt) is rejected as well */
    struct pair q;
    pair_open(&p, 4096, 0);
    pair_open(&q, 4096, 0);
    send_all_nb(p.cli, a, sizeof a);
    send_all_nb(q.cli, a, sizeof a);
    memcpy(p.srv->rx.ring, q.srv->rx.ring, rs_rec_size(sizeof a));
    expect_recv_rc(p.srv, -EPROTO, 0, 1000);
    CHECK_MSG(p.srv, "footer");
    pair_close(&q);
    pair_close(&p);
}

/* ---- 5. bogus length --------------------------------------------------------------- */

enum bogus_kind { BOGUS_TOO_LONG, BOGUS_CROSSES_END, BOGUS_CTL };

/* Writes a bad lenword at the read position of the client's receive ring (ring 1, the
 * last one in the segment) after some valid traffic and one intact record. */
static void bogus_case(int heap, enum bogus_kind kind, uint32_t lw, int blocking)
{
    struct pair p;
    if (heap) pair_open_heap(&p, 4096, 0);
    else pair_open(&p, 4096, 0);
    rs_conn *prod = p.srv, *cons = p.cli;
    uint32_t ring = p.ring;
    uint8_t buf[4096];

    /* move the positions: for the crossing case so that the bad record starts 24 bytes
     * before the ring end, elsewhere to an arbitrary point */
#define INTACT "intact-record-before-the-bad-one"
    uint32_t target = kind == BOGUS_CROSSES_END ? ring - 24 - rs_rec_size(sizeof INTACT - 1) : 1000;
    uint64_t pos = 0;
    advance_to(prod, target, 40, &pos);
    recv_exact(cons, buf, (size_t)pos, 1000);
    VERIFY_PAT(buf, 40, 0, (size_t)pos);
    /* one intact record that must be delivered before the error */
    send_str(prod, INTACT);
    uint64_t bad_pos = prod->tx.pos;
    uint32_t off = (uint32_t)(bad_pos & (ring - 1));
    if (kind == BOGUS_CROSSES_END) CHECK_EQ(off, ring - 24);
    /* the bad lenword, then non-zero junk after it: a "footer" candidate for every reading */
    uint8_t *rp = cons->rx.ring;
    for (uint32_t i = off + 4; i < ring && i < off + 4 + 256; i++) rp[i] = (uint8_t)(0xA5 ^ i);
    rp[ring - 1] = 0x5A;                               /* the last word of the ring too */
    __atomic_store_n((uint32_t *)(rp + off), lw, __ATOMIC_RELEASE);

    char got[200];
    ssize_t r = rs_recv(cons, got, sizeof got, 0, 1000);
    CHECK(r == (ssize_t)sizeof INTACT - 1, "intact record first: rs_recv returned %zd; errmsg \"%s\"", r,
          rs_conn_errmsg(cons));
    CHECK(memcmp(got, INTACT, sizeof INTACT - 1) == 0, "intact record differs");

    if (heap) {
        /* the other readers of the ring must not overrun either (ASan watches); the value
         * rs_rx_available returns is checked by the rx_available test */
        (void)rs_rx_available(cons);
        CHECK(cons->err == EPROTO, "rs_rx_available did not notice the bad record");
        CHECK_EQ(rs_rx_ready(cons), 1);                      /* an error to report */
    }
    double t0 = now_ms();
    r = rs_recv(cons, got, sizeof got, blocking ? 0 : RS_MSG_DONTWAIT, blocking ? 2000 : 0);
    CHECK(r == -EPROTO, "bad lenword 0x%08x at offset %u: rs_recv returned %zd, expected -EPROTO; errmsg \"%s\"",
          lw, off, r, rs_conn_errmsg(cons));
    CHECK(now_ms() - t0 < 500, "error not reported at once");
    char num[32];
    if (kind == BOGUS_CTL) {
        CHECK_MSG(cons, "control code");
        snprintf(num, sizeof num, "0x%08x", lw);
    } else {
        CHECK_MSG(cons, "length");
        snprintf(num, sizeof num, "%u", lw);
        if (kind == BOGUS_CROSSES_END) CHECK_MSG(cons, "ring end");
    }
    CHECK_MSG(cons, num);
    expect_recv_rc(cons, -EPROTO, 0, 100);                   /* sticky */
    pair_close(&p);
}

static void t_bogus_length(void)
{
    const uint32_t maxp = rs_max_payload(4096);
    const uint32_t too_long[] = { maxp + 1, 4096, 4097, 65536, 0x7FFFFFFFu, RS_LEN_CTL_MIN - 1 };
    for (int heap = 0; heap < 2; heap++) {
        for (unsigned i = 0; i < sizeof too_long / sizeof too_long[0]; i++)
            bogus_case(heap, BOGUS_TOO_LONG, too_long[i], i & 1);
        bogus_case(heap, BOGUS_CROSSES_END, 100, 0);
        bogus_case(heap, BOGUS_CROSSES_END, maxp, 1);
        bogus_case(heap, BOGUS_CROSSES_END, 17, 0);        /* rec 32 > the 24 bytes left */
        bogus_case(heap, BOGUS_CTL, 0xFFFFFF10u, 0);
        bogus_case(heap, BOGUS_CTL, RS_LEN_CTL_MIN, 1);
        bogus_case(heap, BOGUS_CTL, 0xFFFFFFFBu, 0);          /* SPILL, never agreed on here */
        bogus_case(heap, BOGUS_CTL, 0xFFFFFFFAu, 1);
    }
}

/* ---- 6. zeroing -------------------------------------------------------------------- */

static void zero_rounds(rs_conn *prod, rs_conn *cons, uint32_t stream, uint64_t seed, int rounds)
{
    struct rng r = { seed };
    uint8_t out[3000], in[4000];
    uint64_t sent = 0, rcvd = 0;
    for (int round = 0; round < rounds; round++) {
        int k = (int)rnd_range(&r, 1, 6);
        for (int i = 0; i < k; i++) {
            size_t n = (size_t)rnd_range(&r, 1, rnd(&r) & 1 ? 64 : 3000);
            fill_pat(out, stream, sent, n);
            ssize_t s = rs_send(prod, out, n, 1, 0);
            if (s == -EAGAIN) break;
            CHECK(s > 0, "rs_send returned %zd", s);
            sent += (uint64_t)s;
        }
        for (;;) {
            size_t n = (size_t)rnd_range(&r, 1, sizeof in);
            int flags = (rnd(&r) % 5 == 0) ? RS_MSG_PEEK : 0;
            ssize_t g = rs_recv(cons, in, n, flags | RS_MSG_DONTWAIT, 0);
            if (g == -EAGAIN) break;
            CHECK(g > 0, "rs_recv returned %zd; errmsg \"%s\"", g, rs_conn_errmsg(cons));
            VERIFY_PAT(in, stream, rcvd, (size_t)g);
            if (!flags) rcvd += (uint64_t)g;
        }
        CHECK_EQ(rcvd, sent);
        CHECK_RING_ZERO(cons);
        CHECK_EQ(head_of(cons), cons->rx.pos);           /* idle: all credit returned */
    }
}

static void t_zeroing(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    zero_rounds(p.cli, p.srv, 50, 1, 400);
    zero_rounds(p.srv, p.cli, 51, 2, 400);
    CHECK(p.srv->rx.pos > 20 * 4096 && p.cli->rx.pos > 20 * 4096, "rings lapped too few times");
    CHECK_EQ(rs_send_fin(p.cli), 0);
    expect_recv_rc(p.srv, 0, 0, 1000);
    CHECK_RING_ZERO(p.srv);
    pair_close(&p);
}

/* ---- 7. credits -------------------------------------------------------------------- */

struct blocked_send { rs_conn *c; size_t n; int timeout_ms; ssize_t r; double ms; volatile int done; };

static void *blocked_send_run(void *arg)
{
    struct blocked_send *b = arg;
    uint8_t buf[4096];
    memset(buf, 0x33, sizeof buf);
    double t0 = now_ms();
    b->r = rs_send(b->c, buf, b->n, 0, b->timeout_ms);
    b->ms = now_ms() - t0;
    __atomic_store_n(&b->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void t_credits(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    rs_conn *prod = p.cli, *cons = p.srv;
    const uint32_t quarter = 4096 / 4, rec = rs_rec_size(16);
    uint8_t buf[4096];
    uint64_t pos = 0, rpos = 0;

    int k = fill_ring(prod, 16, 60, &pos);
    CHECK_EQ(k, (4096 - 8) / rec);                 /* 8 bytes stay reserved for the FIN */
    CHECK_EQ(head_of(cons), 0);
    CHECK_EQ(prod->tx.ctl->head, 0);                /* the producer's mapping of the same word */

    /* a tiny read returns no credit */
    recv_exact(cons, buf, 16, 1000);
    VERIFY_PAT(buf, 60, rpos, 16); rpos += 16;
    CHECK_EQ(cons->rx.pos, rec);
    CHECK_EQ(head_of(cons), 0);
    CHECK_EQ(rs_send(prod, buf, 16, 1, 0), -EAGAIN);
    CHECK_EQ(rs_tx_writable(prod), 0);

    /* one record at a time: the credit appears exactly once a quarter ring was consumed */
    while (cons->rx.pos < quarter) {
        CHECK_EQ(head_of(cons), 0);
        recv_exact(cons, buf, 16, 1000);
        VERIFY_PAT(buf, 60, rpos, 16); rpos += 16;
    }
    uint64_t h1 = head_of(cons);
    CHECK_EQ(h1, cons->rx.pos);
    CHECK_EQ(prod->tx.ctl->head, h1);
    /* ... and the producer can use it */
    uint64_t before = pos;
    int k2 = fill_ring(prod, 16, 60, &pos);
    CHECK(k2 > 0 && (uint64_t)k2 * rec <= h1, "after %llu bytes of credit %d records fit", (unsigned long long)h1, k2);
    CHECK(pos > before, "nothing sent after credit");

    /* lazily again: constant until the next quarter */
    while (cons->rx.pos < h1 + quarter) {
        CHECK_EQ(head_of(cons), h1);
        recv_exact(cons, buf, 16, 1000);
        VERIFY_PAT(buf, 60, rpos, 16); rpos += 16;
    }
    CHECK_EQ(head_of(cons), cons->rx.pos);

    /* consume everything exactly (no credit yet), then going idle publishes it */
    uint64_t left = pos - rpos;
    uint64_t h2 = head_of(cons);
    recv_exact(cons, buf, 16, 1000);
    VERIFY_PAT(buf, 60, rpos, 16); rpos += 16; left -= 16;
    CHECK_EQ(head_of(cons), h2);
    while (left) {
        size_t n = left > sizeof buf ? sizeof buf : (size_t)left;
        ssize_t r = rs_recv(cons, buf, n, RS_MSG_DONTWAIT, 0);
        CHECK(r > 0, "rs_recv returned %zd", r);
        VERIFY_PAT(buf, 60, rpos, (size_t)r); rpos += (uint64_t)r; left -= (uint64_t)r;
    }
    expect_recv_rc(cons, -EAGAIN, RS_MSG_DONTWAIT, 0);
    CHECK_EQ(head_of(cons), cons->rx.pos);
    CHECK_EQ(rs_tx_writable(prod), 1);
    pair_close(&p);

    /* small lag, all consumed: no credit until idle */
    pair_open(&p, 4096, 0);
    for (int i = 0; i < 3; i++) send_all_nb(p.cli, buf, 16);
    recv_exact(p.srv, buf, 48, 1000);
    CHECK_EQ(p.srv->rx.pos, 3 * rec);
    CHECK_EQ(head_of(p.srv), 0);
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
    CHECK_EQ(head_of(p.srv), 3 * rec);
    pair_close(&p);

    /* a producer blocked on a full ring (tx_waiting) gets every credit at once */
    pair_open(&p, 4096, 0);
    prod = p.cli; cons = p.srv; pos = 0;
    fill_ring(prod, 16, 61, &pos);
    struct blocked_send b = { .c = prod, .n = 16, .timeout_ms = 10000 };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, blocked_send_run, &b) == 0, "pthread_create");
    int reads = 0;
    double t0 = now_ms();
    while (!__atomic_load_n(&b.done, __ATOMIC_ACQUIRE)) {
        CHECK(now_ms() - t0 < 8000, "blocked producer never finished");
        if (!__atomic_load_n(&cons->rx.ctl->tx_waiting, __ATOMIC_ACQUIRE)) { sleep_ms(1); continue; }
        recv_exact(cons, buf, 16, 1000);
        reads++;
        CHECK(head_of(cons) == cons->rx.pos, "credit not published at once to a waiting producer: head %llu, rx_pos %llu",
              (unsigned long long)head_of(cons), (unsigned long long)cons->rx.pos);
    }
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    CHECK(b.r == 16, "blocked rs_send returned %zd", b.r);
    CHECK(reads >= 1 && reads < 10, "%d reads to unblock the producer", reads);
    pair_close(&p);
}

/* ---- 8. full ring / backpressure --------------------------------------------------- */

static void t_backpressure(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    rs_conn *prod = p.cli, *cons = p.srv;
    static uint8_t big[100000], in[100000];
    uint64_t sent = 0, rcvd = 0;

    fill_pat(big, 70, 0, sizeof big);
    ssize_t r = rs_send(prod, big, sizeof big, 1, 0);
    CHECK(r > 0 && r < (ssize_t)sizeof big, "nonblocking send of 100000 into a 4096 ring returned %zd", r);
    CHECK(r <= 4096 - 8, "more than the ring holds: %zd", r);
    sent += (uint64_t)r;
    for (int i = 0;; i++) {                             /* EAGAIN or a partial count */
        fill_pat(big, 70, sent, 5000);
        r = rs_send(prod, big, 5000, 1, 0);
        if (r == -EAGAIN) break;
        CHECK(r > 0 && r < 5000, "rs_send on a full ring returned %zd", r);
        sent += (uint64_t)r;
        CHECK(i < 100, "ring never full");
    }
    CHECK_EQ(rs_send(prod, big, 1, 1, 0), -EAGAIN);     /* a 1-byte record needs 16 */
    CHECK_EQ(rs_send(prod, big, 1000, 0, 0), -EAGAIN);  /* timeout 0 means nonblocking */
    CHECK_EQ(rs_tx_writable(prod), 0);

    /* the consumer reads: sending works again */
    r = rs_recv(cons, in, sizeof in, 0, 1000);
    CHECK(r > 0, "rs_recv returned %zd", r);
    VERIFY_PAT(in, 70, rcvd, (size_t)r);
    rcvd += (uint64_t)r;
    CHECK_EQ(rcvd, sent);
    expect_recv_rc(cons, -EAGAIN, RS_MSG_DONTWAIT, 0);
    CHECK_EQ(rs_tx_writable(prod), 1);
    fill_pat(big, 70, sent, 1000);
    r = rs_send(prod, big, 1000, 1, 0);
    CHECK_EQ(r, 1000);
    sent += 1000;

    /* blocking send with a 50 ms timeout on a full ring: EAGAIN after about 50 ms */
    fill_ring(prod, 1000, 70, &sent);
    fill_ring(prod, 1, 70, &sent);
    double t0 = now_ms();
    r = rs_send(prod, big, 1000, 0, 50);
    double dt = now_ms() - t0;
    printf("  blocking send on a full ring: %zd after %.1f ms\n", r, dt);
    CHECK_EQ(r, -EAGAIN);
    CHECK(dt >= 49 && dt < 1000, "timeout 50 ms took %.1f ms", dt);
    /* a large blocking write returns what it wrote once the timeout passes */
    while (rcvd < sent) {
        r = rs_recv(cons, in, sizeof in, 0, 1000);
        CHECK(r > 0, "rs_recv returned %zd", r);
        VERIFY_PAT(in, 70, rcvd, (size_t)r);
        rcvd += (uint64_t)r;
    }
    expect_recv_rc(cons, -EAGAIN, RS_MSG_DONTWAIT, 0);
    fill_pat(big, 70, sent, sizeof big);
    t0 = now_ms();
    r = rs_send(prod, big, sizeof big, 0, 50);
    dt = now_ms() - t0;
    CHECK(r > 0 && r < (ssize_t)sizeof big, "blocking send of 100000 with nobody reading returned %zd", r);
    CHECK(dt >= 49 && dt < 1000, "timeout 50 ms took %.1f ms", dt);
    sent += (uint64_t)r;
    while (rcvd < sent) {
        ssize_t g = rs_recv(cons, in, sizeof in, 0, 1000);
        CHECK(g > 0, "rs_recv returned %zd", g);
        VERIFY_PAT(in, 70, rcvd, (size_t)g);
        rcvd += (uint64_t)g;
    }
    /* and the channel is still healthy: the credit doorbells were valid */
    send_str(prod, "still fine");
    expect_str(cons, "still fine");
    expect_recv_rc(cons, -EAGAIN, RS_MSG_DONTWAIT, 0);
    send_str(cons, "reverse fine");
    expect_str(prod, "reverse fine");
    expect_recv_rc(prod, -EAGAIN, RS_MSG_DONTWAIT, 0);
    CHECK_EQ(prod->err, 0);
    CHECK_EQ(cons->err, 0);
    CHECK_RING_ZERO(cons);
    pair_close(&p);
}

/* ---- 9. FIN / half-close ----------------------------------------------------------- */

struct delayed_fin { rs_conn *c; int delay_ms; };

static void *delayed_fin_run(void *arg)
{
    struct delayed_fin *d = arg;
    sleep_ms(d->delay_ms);
    CHECK_EQ(rs_send_fin(d->c), 0);
    return NULL;
}

/* Fills the ring to the brim, sends FIN, checks the consumer gets every byte, then EOF. */
static void fin_on_full_ring(uint32_t start, int exact)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    rs_conn *prod = p.cli, *cons = p.srv;
    uint8_t buf[4096];
    uint64_t sent = 0, rcvd = 0;
    advance_to(prod, start, 90, &sent);
    recv_exact(cons, buf, (size_t)sent, 1000);
    VERIFY_PAT(buf, 90, 0, (size_t)sent);
    rcvd = sent;
    expect_recv_rc(cons, -EAGAIN, RS_MSG_DONTWAIT, 0);     /* idle: credit back */
    if (exact) {
        /* 1-byte records (16 ring bytes) and one 24-byte record: exactly ring - 8 bytes */
        CHECK_EQ(start, 0);
        for (int i = 0; i < 254; i++) { fill_pat(buf, 90, sent, 1); send_all_nb(prod, buf, 1); sent++; }
        fill_pat(buf, 90, sent, 16); send_all_nb(prod, buf, 16); sent += 16;
        CHECK_EQ(prod->tx.pos - head_of(cons), 4096 - 8);
    } else {
        fill_ring(prod, 1, 90, &sent);
    }
    CHECK_EQ(rs_send(prod, buf, 1, 1, 0), -EAGAIN);
    CHECK_EQ(rs_send_fin(prod), 0);
    CHECK(prod->tx.pos - head_of(cons) <= 4096, "FIN overran the consumer: %llu bytes in flight",
          (unsigned long long)(prod->tx.pos - head_of(cons)));
    struct rng rg = { start * 31 + 7 };
    while (1) {
        ssize_t r = rs_recv(cons, buf, (size_t)rnd_range(&rg, 1, sizeof buf), 0, 1000);
        if (r == 0) break;
        CHECK(r > 0, "rs_recv returned %zd; errmsg \"%s\"", r, rs_conn_errmsg(cons));
        VERIFY_PAT(buf, 90, rcvd, (size_t)r);
        rcvd += (uint64_t)r;
    }
    CHECK_EQ(rcvd, sent);
    expect_recv_rc(cons, 0, 0, 1000);
    CHECK_RING_ZERO(cons);
    CHECK_EQ(rs_send(prod, buf, 1, 1, 0), -EPIPE);
    pair_close(&p);
}

static void t_fin(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    send_str(p.cli, "last data");
    CHECK_EQ(rs_send_fin(p.cli), 0);
    CHECK_EQ(rs_send(p.cli, "x", 1, 1, 0), -EPIPE);
    CHECK_EQ(rs_send(p.cli, "x", 1, 0, 100), -EPIPE);
    CHECK_EQ(rs_send_fin(p.cli), 0);                    /* idempotent */
    expect_str(p.srv, "last data");
    expect_recv_rc(p.srv, 0, 0, 1000);
    expect_recv_rc(p.srv, 0, RS_MSG_DONTWAIT, 0);       /* EOF stays */
    expect_recv_rc(p.srv, 0, RS_MSG_PEEK, 0);
    CHECK_RING_ZERO(p.srv);
    /* half-close: the other direction still works */
    send_str(p.srv, "reply after FIN");
    expect_str(p.cli, "reply after FIN");
    CHECK_EQ(rs_send_fin(p.srv), 0);
    expect_recv_rc(p.cli, 0, 0, 1000);
    pair_close(&p);

    /* FIN wakes a consumer blocked in recv (its doorbell) */
    pair_open(&p, 4096, 0);
    struct delayed_fin d = { p.srv, 100 };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, delayed_fin_run, &d) == 0, "pthread_create");
    double t0 = now_ms();
    expect_recv_rc(p.cli, 0, 0, 5000);
    double dt = now_ms() - t0;
    CHECK(dt < 2000, "blocked recv woke %.0f ms after the FIN", dt - 100);
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    pair_close(&p);

    fin_on_full_ring(0, 1);          /* exactly ring - 8 bytes of data: FIN in the last 8 */
    fin_on_full_ring(0, 0);
    fin_on_full_ring(2008, 0);       /* fill across the ring end: WRAP records, then FIN */
    fin_on_full_ring(4088, 0);       /* FIN position right at a wrap */
}

/* ---- stalled ring: the direction moves to TCP (PROTOCOL 6.8) ------------------------- */

/* Reads n pattern bytes (stream, from *pos) and checks them. */
static void expect_pat(rs_conn *c, uint32_t stream, uint64_t *pos, size_t n)
{
    uint8_t buf[4096], want[4096];
    while (n) {
        size_t k = n < sizeof buf ? n : sizeof buf;
        recv_exact(c, buf, k, 2000);
        fill_pat(want, stream, *pos, k);
        CHECK(memcmp(buf, want, k) == 0, "stream byte differs near %llu", (unsigned long long)*pos);
        *pos += k;
        n -= k;
    }
}

static void t_stall_move(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    uint64_t wpos = 0, rpos = 0;
    uint8_t buf[4096];
    fill_ring(p.cli, 1000, 7, &wpos);
    uint64_t in_ring = wpos;
    CHECK(in_ring > 0 && in_ring < 4096, "filled %llu bytes", (unsigned long long)in_ring);
    /* full, and not for long: still EAGAIN */
    fill_pat(buf, 7, wpos, 1000);
    CHECK_EQ(rs_send(p.cli, buf, 1000, 1, 0), -EAGAIN);
    CHECK_EQ(p.cli->fb, 0);
    sleep_ms(p.cli->ops->stall_ms + 100);
    /* the consumer took nothing for longer than stall_ms: the write goes to TCP */
    ssize_t r = rs_send(p.cli, buf, 1000, 1, 0);
    CHECK(r == 1000, "write after the stall returned %zd (%s)", r, r < 0 ? strerror((int)-r) : "short");
    CHECK_EQ(p.cli->fb, 1);
    CHECK_EQ(p.cli->fb_reason, RS_REASON_RING_STALLED);
    wpos += (uint64_t)r;
    for (int k = 0; k < 16; k++) {                 /* more than the ring holds, all on TCP */
        fill_pat(buf, 7, wpos, sizeof buf);
        r = rs_send(p.cli, buf, sizeof buf, 1, 0);
        if (r == -EAGAIN) break;
        CHECK(r > 0, "rs_send on TCP returned %zd", r);
        wpos += (uint64_t)r;
    }
    CHECK(wpos > in_ring + 8192, "only %llu bytes sent", (unsigned long long)wpos);
    /* the consumer: the ring up to MOVED, then the socket, in order, nothing repeated */
    CHECK_EQ(p.srv->fb, 0);
    expect_pat(p.srv, 7, &rpos, in_ring);
    expect_pat(p.srv, 7, &rpos, (size_t)(wpos - in_ring));
    CHECK_EQ(p.srv->fb, 1);                          /* it saw MOVED: its direction follows */
    CHECK_EQ(p.srv->fb_reason, RS_REASON_PEER_MOVED);
    CHECK_RING_ZERO(p.srv);
    CHECK_EQ(rs_rx_available(p.srv), 0);
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
    /* the other direction: ring records first, then MOVED and the socket */
    send_str(p.srv, "reply");
    expect_str(p.cli, "reply");
    send_str(p.srv, "more");
    expect_str(p.cli, "more");
    CHECK_EQ(p.srv->fb_done, 1);
    CHECK_EQ(p.cli->fb_done, 1);
    /* half-close travels as a TCP FIN now */
    CHECK_EQ(rs_send_fin(p.cli), 0);
    expect_recv_rc(p.srv, 0, 0, 1000);
    send_str(p.srv, "after fin");
    expect_str(p.cli, "after fin");
    pair_close(&p);
}

/* Fills c's ring, lets it stall and writes 1000 bytes more, which move the direction to
 * TCP (MOVED record, RESYNC frame, then the bytes): the bytes that went by the ring. */
static uint64_t fill_and_move(rs_conn *c, uint32_t stream, uint64_t *pos)
{
    uint8_t buf[1000];
    fill_ring(c, sizeof buf, stream, pos);
    uint64_t in_ring = *pos;
    sleep_ms(c->ops->stall_ms + 100);
    fill_pat(buf, stream, *pos, sizeof buf);
    ssize_t r = rs_send(c, buf, sizeof buf, 1, 0);
    CHECK(r == (ssize_t)sizeof buf, "write after the stall returned %zd", r);
    CHECK_EQ(c->fb_reason, RS_REASON_RING_STALLED);
    *pos += (uint64_t)r;
    return in_ring;
}

/* The peer moved first and ours has not followed yet (it would at our next send) when our
 * program half-closes: the end must reach the peer (it once reached it neither as a FIN
 * record nor as a TCP FIN, and the peer waited for ever). */
static void t_fin_after_peer_moved(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    uint64_t wpos = 0, rpos = 0;
    uint64_t in_ring = fill_and_move(p.srv, 5, &wpos);
    expect_pat(p.cli, 5, &rpos, in_ring);            /* the ring's records and MOVED behind them */
    CHECK_EQ(p.cli->fb, 1);
    CHECK_EQ(p.cli->fb_reason, RS_REASON_PEER_MOVED);
    CHECK_EQ(rs_send_fin(p.cli), 0);
    expect_recv_rc(p.srv, 0, 0, 2000);                            /* the end, not a wait */
    expect_pat(p.cli, 5, &rpos, (size_t)(wpos - in_ring));
    send_str(p.srv, "after fin");
    expect_str(p.cli, "after fin");
    pair_close(&p);
}

/* ---- SPILL (docs/PROTOCOL.md 6.9) ---------------------------------------------------- */

static void raw_write(int fd, const void *b, size_t n);

static void pair_open_spill(struct pair *p, uint32_t ring)
{
    pair_open(p, ring, 0);
    p->srv->spill_ok = p->cli->spill_ok = 1;
}

/* Writes into a full ring that nobody reads: EAGAIN until the ring has been untouched for
 * the spill delay, then whatever the socket takes goes there, behind SPILL records, until
 * the socket is full too; a blocking write does the same by itself.  The consumer gets
 * every byte in order, through plain, peeking, MSG_WAITALL and FIONREAD reads, and the
 * connection never leaves its ring. */
static void t_spill(void)
{
    struct pair p;
    pair_open_spill(&p, 4096);
    uint64_t wpos = 0, rpos = 0;
    uint8_t buf[16384];
    fill_ring(p.cli, 1000, 11, &wpos);
    uint64_t in_ring = wpos;
    CHECK(in_ring > 2048 && in_ring < 4096, "filled %llu bytes", (unsigned long long)in_ring);
    fill_pat(buf, 11, wpos, 1000);
    CHECK_EQ(rs_send(p.cli, buf, 1000, 1, 0), -EAGAIN);   /* full, and not for long */
    CHECK_EQ(p.cli->tx.spills, 0);
    sleep_ms(30);
    uint64_t spilled = 0;
    for (int k = 0; k < 10000; k++) {
        fill_pat(buf, 11, wpos, sizeof buf);
        ssize_t r = rs_send(p.cli, buf, sizeof buf, 1, 0);
        if (r == -EAGAIN) break;
        CHECK(r > 0, "spilling rs_send returned %zd (%s)", r, r < 0 ? strerror((int)-r) : "");
        wpos += (uint64_t)r;
        spilled += (uint64_t)r;
    }
    CHECK(spilled > 16384, "only %llu bytes spilled", (unsigned long long)spilled);
    CHECK(p.cli->tx.spills >= 1, "no SPILL record");
    CHECK_EQ(p.cli->tx.spilled, spilled);
    CHECK_EQ(p.cli->fb, 0);
    /* a blocking write waits while the socket is full too: TCP's own limit */
    fill_pat(buf, 11, wpos, 100);
    double t0 = now_ms();
    CHECK_EQ(rs_send(p.cli, buf, 100, 0, 200), -EAGAIN);
    CHECK(now_ms() - t0 >= 150, "blocking write gave up early");
    /* the consumer: ring records, then the spilled bytes; peeks and FIONREAD see them */
    expect_pat(p.srv, 11, &rpos, in_ring);
    ssize_t avail = rs_rx_available(p.srv);
    CHECK(avail > 0 && (uint64_t)avail <= spilled, "FIONREAD inside a spill says %zd", avail);
    uint8_t pk[64], want[64];
    CHECK_EQ(rs_recv(p.srv, pk, sizeof pk, RS_MSG_PEEK, 1000), (ssize_t)sizeof pk);
    fill_pat(want, 11, rpos, sizeof want);
    CHECK(memcmp(pk, want, sizeof pk) == 0, "peeked spilled bytes differ");
    CHECK_EQ(p.srv->rx.bytes, rpos);                       /* a peek consumed nothing */
    uint8_t *big = malloc(spilled);
    CHECK(big, "malloc");
    ssize_t r = rs_recv(p.srv, big, (size_t)spilled, RS_MSG_WAITALL, 2000);
    CHECK(r == (ssize_t)spilled, "MSG_WAITALL over the spill returned %zd of %llu; errmsg \"%s\"", r,
          (unsigned long long)spilled, rs_conn_errmsg(p.srv));
    VERIFY_PAT(big, 11, rpos, (size_t)spilled);
    rpos += spilled;
    free(big);
    CHECK_EQ(p.srv->rx.spilled, spilled);
    CHECK_EQ(p.srv->fb, 0);
    /* back on the ring: the writer's credit returns, it writes records again */
    uint64_t spills = p.cli->tx.spills;
    fill_pat(buf, 11, wpos, 3000);
    send_all_nb(p.cli, buf, 3000);
    wpos += 3000;
    CHECK_EQ(p.cli->tx.spills, spills);
    expect_pat(p.srv, 11, &rpos, 3000);
    CHECK_RING_ZERO(p.srv);
    /* a blocking write into a full ring spills by itself */
    fill_ring(p.cli, 1000, 11, &wpos);
    uint64_t before = wpos;
    fill_pat(buf, 11, wpos, 8192);
    r = rs_send(p.cli, buf, 8192, 0, 2000);
    CHECK(r == 8192, "blocking write into a full ring returned %zd", r);
    wpos += 8192;
    CHECK(p.cli->tx.spills > spills, "the blocking write did not spill");
    expect_pat(p.srv, 11, &rpos, (size_t)(wpos - rpos));
    CHECK(wpos > before, "nothing written");
    /* readiness during a spill, then EOF after it */
    fill_ring(p.cli, 1000, 11, &wpos);
    sleep_ms(30);
    fill_pat(buf, 11, wpos, 500);
    CHECK_EQ(rs_send(p.cli, buf, 500, 1, 0), 500);
    wpos += 500;
    CHECK_EQ(rs_send_fin(p.cli), 0);
    expect_pat(p.srv, 11, &rpos, (size_t)(wpos - rpos));
    expect_recv_rc(p.srv, 0, 0, 1000);
    CHECK_EQ(p.srv->fb, 0);
    CHECK_EQ(p.cli->fb, 0);
    pair_close(&p);

    /* an old peer (no SPILL agreed): a stalled ring still moves, as stall_move shows */
    pair_open(&p, 4096, 0);
    wpos = 0;
    fill_ring(p.cli, 1000, 12, &wpos);
    sleep_ms(30);
    CHECK_EQ(rs_send(p.cli, buf, 1000, 1, 0), -EAGAIN);
    CHECK_EQ(p.cli->tx.spills, 0);
    pair_close(&p);
}

/* A writer thread streams 8 MiB in writes of random size while the reader pauses for
 * longer than the spill delay now and then: the stream alternates between ring records
 * and spills, read through plain, peeking and non-blocking receives of random size, and
 * arrives byte for byte, on the ring, with nothing left in it. */
static void t_spill_concurrent(void)
{
    struct pair p;
    pair_open_spill(&p, 4096);
    struct producer a = { .c = p.srv, .stream = 13, .total = 8u << 20, .seed = 4242, .min_write = 1,
                          .max_write = 20000 };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, producer_run, &a) == 0, "pthread_create");
    struct rng r = { 99 };
    uint8_t *buf = malloc(30000);
    CHECK(buf, "malloc");
    uint64_t got = 0, cks = FNV_INIT;
    int pauses = 0;
    while (got < a.total) {
        uint64_t what = rnd_range(&r, 0, 99);
        if (what < 2) { sleep_ms(15 + (int)rnd_range(&r, 0, 10)); pauses++; continue; }
        size_t n = (size_t)rnd_range(&r, 1, 30000);
        if (what < 12) {
            ssize_t k = rs_recv(p.cli, buf, n, RS_MSG_PEEK, 20000);
            CHECK(k > 0 && (size_t)k <= n, "peek returned %zd; errmsg \"%s\"", k, rs_conn_errmsg(p.cli));
            VERIFY_PAT(buf, a.stream, got, (size_t)k);
            continue;
        }
        int flags = what < 30 ? RS_MSG_DONTWAIT : 0;
        ssize_t k = rs_recv(p.cli, buf, n, flags, flags ? 0 : 20000);
        if (k == -EAGAIN && flags) continue;
        CHECK(k > 0 && (size_t)k <= n, "rs_recv(%zu) returned %zd after %llu bytes; errmsg \"%s\"", n, k,
              (unsigned long long)got, rs_conn_errmsg(p.cli));
        VERIFY_PAT(buf, a.stream, got, (size_t)k);
        cks = fnv(cks, buf, (size_t)k);
        got += (uint64_t)k;
    }
    expect_recv_rc(p.cli, 0, 0, 20000);
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    CHECK(cks == a.cks, "stream checksum differs");
    printf("  spill_concurrent: %d pauses, %llu SPILL records, %llu of %llu bytes spilled\n", pauses,
           (unsigned long long)p.srv->tx.spills, (unsigned long long)p.srv->tx.spilled, (unsigned long long)a.total);
    CHECK(p.srv->tx.spills > 0, "the pauses caused no spill");
    CHECK_EQ(p.cli->rx.spilled, p.srv->tx.spilled);
    CHECK_EQ(p.srv->fb, 0);
    CHECK_RING_ZERO(p.cli);
    free(buf);
    pair_close(&p);
}

/* ---- the hold (shim/rs_hold.c) ------------------------------------------------------ */

/* shm with rdma's properties where the hold matters: no SPILL, no move on a stall, and a
 * go_idle that reads the doorbells off the socket before it looks at the ring. */
static struct rs_transport shm_no_stall;

static int go_idle_bells_first(rs_conn *c)
{
    uint8_t b[256];
    long n = recv(c->fd, b, sizeof b, MSG_PEEK | MSG_DONTWAIT), k = 0;
    while (k < n && (b[k] == RS_BELL_DATA || b[k] == RS_BELL_CREDIT)) k++;
    if (k) CHECK(recv(c->fd, b, (size_t)k, MSG_DONTWAIT) == k, "reading doorbells");
    return rs_transport_shm.go_idle(c);
}

static void pair_open_hold(struct pair *p, uint32_t ring)
{
    pair_open(p, ring, 0);
    shm_no_stall = rs_transport_shm;
    shm_no_stall.stall_ms = 0;
    shm_no_stall.go_idle = go_idle_bells_first;
    p->srv->ops = p->cli->ops = &shm_no_stall;
}

/* An end whose receive side no hold ever takes (a stall would move it to TCP, but only
 * after ten minutes): a reader that is really absent. */
static struct rs_transport shm_never_held;

static void never_held(rs_conn *c)
{
    shm_never_held = rs_transport_shm;
    shm_never_held.stall_ms = 60000;
    c->ops = &shm_never_held;
}

/* Both ends write 2 MiB through 4 KiB rings before they read, as an echo client and a
 * server that answer before reading the rest do: each writer, waiting for room, holds
 * what its own ring has, so both finish; then each reads the other's bytes, whole, from
 * the hold and the ring, and the FIN after them. */
struct hold_side { struct producer w; rs_conn *rx; uint32_t in_stream; uint64_t in_total, in_cks; };

static void *hold_side_run(void *arg)
{
    struct hold_side *h = arg;
    producer_run(&h->w);
    uint8_t *buf = malloc(65536);
    CHECK(buf, "malloc");
    uint64_t got = 0;
    h->in_cks = FNV_INIT;
    while (got < h->in_total) {
        size_t n = h->in_total - got < 65536 ? (size_t)(h->in_total - got) : 65536;
        ssize_t k = rs_recv(h->rx, buf, n, RS_MSG_WAITALL, 20000);
        CHECK(k == (ssize_t)n, "rs_recv(%zu) after %llu bytes returned %zd; errmsg \"%s\"", n, (unsigned long long)got, k,
              rs_conn_errmsg(h->rx));
        VERIFY_PAT(buf, h->in_stream, got, n);
        h->in_cks = fnv(h->in_cks, buf, n);
        got += n;
    }
    expect_recv_rc(h->rx, 0, 0, 20000);
    free(buf);
    return NULL;
}

static void t_hold(void)
{
    struct pair p;
    pair_open_hold(&p, 4096);
    uint64_t total = 2u << 20;
    struct hold_side a = { .w = { .c = p.cli, .stream = 21, .total = total, .seed = 7, .min_write = 1, .max_write = 9000 },
                           .rx = p.cli, .in_stream = 22, .in_total = total };
    struct hold_side b = { .w = { .c = p.srv, .stream = 22, .total = total, .seed = 8, .min_write = 1, .max_write = 9000 },
                           .rx = p.srv, .in_stream = 21, .in_total = total };
    pthread_t ta, tb;
    CHECK(pthread_create(&ta, NULL, hold_side_run, &a) == 0, "pthread_create");
    CHECK(pthread_create(&tb, NULL, hold_side_run, &b) == 0, "pthread_create");
    CHECK(pthread_join(ta, NULL) == 0 && pthread_join(tb, NULL) == 0, "pthread_join");
    CHECK(a.in_cks == b.w.cks && b.in_cks == a.w.cks, "stream checksums differ");
    printf("  hold: %llu and %llu of %llu bytes went through the holds\n", (unsigned long long)p.cli->rx.held,
           (unsigned long long)p.srv->rx.held, (unsigned long long)total);
    /* whichever side finished writing first read the rest as it came: at least one of the
     * two streams went through a hold, all but what a ring took */
    CHECK(p.cli->rx.held + p.srv->rx.held >= total - 8192, "too little held");
    CHECK(p.cli->rx.hold == NULL && p.srv->rx.hold == NULL, "an empty hold keeps its buffer");
    CHECK_EQ(p.cli->fb, 0);
    CHECK_EQ(p.srv->fb, 0);
    CHECK_RING_ZERO(p.cli);
    CHECK_RING_ZERO(p.srv);
    pair_close(&p);
}

/* Held bytes come before a move: the peer's MOVED record and what it then sends over TCP
 * are read after them, and the socket is not plain TCP (for the preload's hooks) while
 * any are left. */
static void t_hold_then_move(void)
{
    struct pair p;
    pair_open_hold(&p, 4096);
    /* The server's side does not hold (it is another process's, in truth): a waiting
     * writer fills every such connection of its process (t_hold_for_others). */
    p.srv->ops = &rs_transport_shm;
    uint64_t wpos = 0, spos = 0, rpos = 0;
    fill_ring(p.cli, 1000, 23, &wpos);               /* the client's ring to the server: full */
    fill_ring(p.srv, 700, 24, &spos);                /* the server's to the client: full too */
    uint8_t buf[1000];
    fill_pat(buf, 23, wpos, sizeof buf);
    CHECK_EQ(rs_send(p.cli, buf, sizeof buf, 0, 100), -EAGAIN);     /* waits, holds, times out */
    CHECK_EQ(p.cli->rx.hold_len, spos);
    CHECK_EQ(rs_rx_available(p.cli), (ssize_t)spos);
    uint8_t pk[100];
    CHECK_EQ(rs_recv(p.cli, pk, sizeof pk, RS_MSG_PEEK, 1000), (ssize_t)sizeof pk);
    VERIFY_PAT(pk, 24, 0, sizeof pk);
    CHECK_EQ(rs_rx_ready(p.cli), 1);
    /* a wait that arms (poll for POLLOUT in another thread) finds data and leaves the
     * doorbells on the socket for a reader asleep there */
    int bells_before = 0, bells_after = 0;
    CHECK(ioctl(p.fd[1], FIONREAD, &bells_before) == 0, "FIONREAD");
    CHECK(bells_before > 0, "no doorbell announced the held bytes");
    CHECK_EQ(rs_rx_go_idle(p.cli), 1);
    CHECK(ioctl(p.fd[1], FIONREAD, &bells_after) == 0, "FIONREAD");
    CHECK_EQ(bells_after, bells_before);
    fill_pat(buf, 24, spos, 500);
    send_all_nb(p.srv, buf, 500);                    /* room again: after the held bytes */
    spos += 500;
    CHECK_EQ(rs_fb_move_tx(p.srv, RS_REASON_URGENT_DATA, 1000), 0);
    fill_pat(buf, 24, spos, 300);
    CHECK_EQ(rs_send(p.srv, buf, 300, 0, 1000), 300);   /* over TCP now */
    spos += 300;
    CHECK_EQ(rs_rx_reach_tcp(p.cli), 0);
    expect_pat(p.cli, 24, &rpos, (size_t)spos);
    CHECK_EQ(p.cli->rx.hold_len, 0);
    CHECK_EQ(p.cli->fb, 1);
    expect_pat(p.srv, 23, &(uint64_t){ 0 }, (size_t)wpos);
    pair_close(&p);
}

/* After the peer's direction moved to TCP, a reader thread asleep on the socket in recv
 * and a writer thread of the same program waiting for room (whose wait fills the hold):
 * what the peer sends over TCP must reach the reader, in order.  Taken into the hold by
 * the writer, it woke nobody: the reader slept on, read the next bytes first, or saw the
 * end of the stream before held bytes.  The peer sends byte by byte, so that each byte
 * is a race between the two threads.  (The window of that bug, between the reader's
 * last look and its sleep, is too narrow to hit from here: this checks the behaviour,
 * it does not reproduce the bug.) */
#define FB_RACE_BYTES 40
struct fb_reader { rs_conn *c; uint8_t buf[FB_RACE_BYTES]; size_t got; ssize_t err; };

static void *fb_reader_run(void *arg)
{
    struct fb_reader *r = arg;
    while (r->got < sizeof r->buf) {
        ssize_t n = rs_recv(r->c, r->buf + r->got, sizeof r->buf - r->got, 0, 3000);
        if (n <= 0) { r->err = n; break; }
        r->got += (size_t)n;
    }
    return NULL;
}

struct fb_writer { rs_conn *c; uint64_t pos; ssize_t n; };

static void *fb_writer_run(void *arg)
{
    struct fb_writer *w = arg;
    uint8_t buf[1000];
    fill_pat(buf, 23, w->pos, sizeof buf);
    w->n = rs_send(w->c, buf, sizeof buf, 0, 1000);  /* no room: waits, fills the hold, times out */
    return NULL;
}

static void t_fb_reader_keeps_its_bytes(void)
{
    for (int i = 0; i < 2; i++) {
        struct pair p;
        pair_open_hold(&p, 4096);
        p.srv->ops = &rs_transport_shm;              /* the peer's side does not hold */
        CHECK_EQ(rs_fb_move_tx(p.srv, RS_REASON_URGENT_DATA, 1000), 0);
        CHECK_EQ(rs_rx_reach_tcp(p.cli), 1);         /* the client read the MOVED record */
        uint64_t wpos = 0;
        fill_ring(p.cli, 1000, 23, &wpos);           /* its ring to the server: full */
        struct fb_reader r = { .c = p.cli };
        struct fb_writer w = { .c = p.cli, .pos = wpos };
        pthread_t tr, tw;
        CHECK_EQ(pthread_create(&tr, NULL, fb_reader_run, &r), 0);
        CHECK_EQ(pthread_create(&tw, NULL, fb_writer_run, &w), 0);
        usleep(2 * RS_HOLD_AFTER_MS * 1000);         /* the writer waiting, holding */
        uint8_t b[FB_RACE_BYTES];
        fill_pat(b, 25, 0, sizeof b);
        for (size_t k = 0; k < sizeof b; k++) {
            CHECK_EQ(rs_send(p.srv, b + k, 1, 0, 1000), 1);
            usleep(3000);
        }
        CHECK_EQ(pthread_join(tr, NULL), 0);
        CHECK_EQ(pthread_join(tw, NULL), 0);
        CHECK(r.got == sizeof b, "round %d: the reader got %zu of %zu bytes (%s), hold %u", i, r.got, sizeof b,
              r.err < 0 ? strerror((int)-r.err) : "", (unsigned)p.cli->rx.hold_len);
        VERIFY_PAT(r.buf, 25, 0, r.got);
        CHECK_EQ(w.n, -EAGAIN);
        expect_pat(p.srv, 23, &(uint64_t){ 0 }, (size_t)wpos);
        pair_close(&p);
    }
}

/* A program that waits writing to one connection fills the holds of its others: P sends
 * 1 MiB on A, whose reader Y reads only once X has sent 1 MiB to P on B; P reads B only
 * after its send on A.  Over TCP the kernel takes X's bytes meanwhile.  X writes without
 * ever waiting in a send (non-blocking, with pauses), so only P's wait can fill B's
 * hold; without it P's send times out. */
struct others { rs_conn *x; int done; };

static void *others_x_run(void *arg)
{
    struct others *o = arg;
    uint8_t *buf = malloc(8192);
    CHECK(buf, "malloc");
    uint64_t pos = 0, total = 1u << 20;
    double end = now_ms() + 20000;
    while (pos < total) {
        CHECK(now_ms() < end, "X is stuck after %llu bytes", (unsigned long long)pos);
        size_t n = total - pos < 8192 ? (size_t)(total - pos) : 8192;
        fill_pat(buf, 32, pos, n);
        ssize_t r = rs_send(o->x, buf, n, 1, 0);
        if (r == -EAGAIN) { usleep(200); continue; }
        CHECK(r > 0, "X's send returned %zd", r);
        pos += (uint64_t)r;
    }
    __atomic_store_n(&o->done, 1, __ATOMIC_RELEASE);
    free(buf);
    return NULL;
}

struct others_y { rs_conn *y; struct others *o; };

static void *others_y_run(void *arg)
{
    struct others_y *y = arg;
    double end = now_ms() + 20000;
    while (!__atomic_load_n(&y->o->done, __ATOMIC_ACQUIRE)) {
        CHECK(now_ms() < end, "X never finished");
        usleep(1000);
    }
    uint64_t rpos = 0;
    expect_pat(y->y, 31, &rpos, 1u << 20);
    return NULL;
}

static void t_hold_for_others(void)
{
    struct pair a, b;                                /* A: P (cli) -> Y (srv); B: X (srv) -> P (cli) */
    pair_open_hold(&a, 4096);
    pair_open_hold(&b, 4096);
    never_held(a.srv);                               /* Y: only its own reads take P's bytes */
    rs_conn *all[] = { a.cli, a.srv, b.cli, b.srv };  /* what socket objects do when they adopt a ring */
    for (int i = 0; i < 4; i++) rs_hold_list(all[i]);
    struct others o = { .x = b.srv };
    struct others_y y = { .y = a.srv, .o = &o };
    pthread_t tx, ty;
    CHECK(pthread_create(&tx, NULL, others_x_run, &o) == 0, "pthread_create");
    CHECK(pthread_create(&ty, NULL, others_y_run, &y) == 0, "pthread_create");
    uint8_t *buf = malloc(65536);
    CHECK(buf, "malloc");
    for (uint64_t pos = 0; pos < (1u << 20); pos += 65536) {
        fill_pat(buf, 31, pos, 65536);
        ssize_t r = rs_send(a.cli, buf, 65536, 0, 10000);
        CHECK(r == 65536, "P's send at %llu returned %zd", (unsigned long long)pos, r);
    }
    free(buf);
    uint64_t rpos = 0;
    expect_pat(b.cli, 32, &rpos, 1u << 20);         /* the hold first, then the ring */
    CHECK(pthread_join(tx, NULL) == 0 && pthread_join(ty, NULL) == 0, "pthread_join");
    printf("  hold_for_others: %llu of %llu bytes of B went through P's hold\n", (unsigned long long)b.cli->rx.held,
           (unsigned long long)(1u << 20));
    CHECK(b.cli->rx.held > (1u << 20) - 8192, "B's bytes did not go through the hold");
    CHECK(b.cli->rx.hold == NULL, "an empty hold keeps its buffer");
    CHECK_EQ(a.cli->fb, 0);
    CHECK_EQ(b.cli->fb, 0);
    pair_close(&a);
    pair_close(&b);
}

/* A program that does not call the socket library while its peer writes more than the
 * ring holds (it computes, sleeps, waits on something else): the holder thread takes the
 * bytes in, as TCP's kernel would, and the writer finishes while the program is away. */
struct holder_x { rs_conn *x; int done; };

static void *holder_x_run(void *arg)
{
    struct holder_x *h = arg;
    uint8_t *buf = malloc(65536);
    CHECK(buf, "malloc");
    for (uint64_t pos = 0; pos < (1u << 20); pos += 65536) {
        fill_pat(buf, 33, pos, 65536);
        ssize_t r = rs_send(h->x, buf, 65536, 0, 20000);
        CHECK(r == 65536, "the writer's send at %llu returned %zd", (unsigned long long)pos, r);
    }
    free(buf);
    __atomic_store_n(&h->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void t_holder(void)
{
    struct pair p;
    pair_open_hold(&p, 4096);
    never_held(p.srv);                               /* the writer's own waits hold nothing */
    /* The reader is a server whose client's SWITCH waits on the socket, unread: the
     * holder reads it off, then the ring. */
    p.cli->rx.pre.active = 1;
    uint8_t sw[RS_PRE_HDR] = { RS_PRE_SWITCH };
    CHECK(write(p.fd[0], sw, sizeof sw) == (ssize_t)sizeof sw, "writing SWITCH");
    rs_hold_list(p.cli);
    rs_hold_list(p.srv);
    struct holder_x h = { .x = p.srv };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, holder_x_run, &h) == 0, "pthread_create");
    double end = now_ms() + 20000;
    while (!__atomic_load_n(&h.done, __ATOMIC_ACQUIRE)) {   /* away from the library */
        CHECK(now_ms() < end, "the writer is stuck: nobody took its bytes in");
        usleep(1000);
    }
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    printf("  holder: %llu of %llu bytes went through the hold\n", (unsigned long long)p.cli->rx.held,
           (unsigned long long)(1u << 20));
    uint64_t rpos = 0;
    expect_pat(p.cli, 33, &rpos, 1u << 20);
    CHECK(p.cli->rx.held >= (1u << 20) - 4096, "too little held");
    CHECK(p.cli->rx.hold == NULL, "an empty hold keeps its buffer");
    CHECK_EQ(p.cli->rx.pre.active, 0);
    CHECK_EQ(p.cli->fb, 0);
    CHECK_EQ(p.srv->fb, 0);
    pair_close(&p);
}

/* ---- the descriptor map (shim/rs_fdmap.c) --------------------------------------------- */

static void fdmap_count(int fd, void *p, void *arg)
{
    int *seen = arg;
    CHECK((intptr_t)p == fd + 1, "entry %d holds %p", fd, p);
    seen[0]++;
    CHECK(fd > seen[1], "rs_fdmap_each went from %d back to %d", seen[1], fd);
    seen[1] = fd;
}

/* Any descriptor number: entries up to 1,048,575 (and on to the map's limit) are stored
 * and found, numbers never stored cost no memory and read empty, and what cannot be held
 * says so. */
static void t_fdmap(void)
{
    static struct rs_fdmap m = RS_FDMAP_INIT;
    static const int fds[] = { 0, 1, 1023, 1024, 1025, 65535, 65536, 65537, 19999, 524287, 1048575, 1048576,
                               (int)RS_FDMAP_MAX - 1 };
    int n = (int)(sizeof fds / sizeof fds[0]);
    for (int i = 0; i < n; i++) CHECK(rs_fdmap_get(&m, fds[i]) == NULL, "fd %d set before any store", fds[i]);
    for (int i = 0; i < n; i++)
        CHECK(rs_fdmap_swap(&m, fds[i], (void *)(intptr_t)(fds[i] + 1)) == NULL, "storing at fd %d", fds[i]);
    for (int i = 0; i < n; i++) {
        CHECK((intptr_t)rs_fdmap_get(&m, fds[i]) == fds[i] + 1, "fd %d reads %p", fds[i], rs_fdmap_get(&m, fds[i]));
        int next = fds[i] + 3;                       /* a neighbour never stored (none of fds[] is 3 apart) */
        CHECK(rs_fdmap_get(&m, next) == NULL, "fd %d, never stored, reads %p", next, rs_fdmap_get(&m, next));
    }
    int seen[2] = { 0, -1 };
    rs_fdmap_each(&m, fdmap_count, seen);
    CHECK_EQ(seen[0], n);
    /* a lookup of a number in a range never stored does not allocate */
    CHECK(rs_fdmap_get(&m, 700000) == NULL && rs_fdmap_slot(&m, 700000) == NULL, "an unstored range has a leaf");
    CHECK(rs_fdmap_swap(&m, 700000, NULL) == NULL && rs_fdmap_slot(&m, 700000) == NULL, "clearing allocated");
    CHECK(rs_fdmap_swap(&m, (int)RS_FDMAP_MAX, (void *)1) == RS_FDMAP_FAIL, "a number past the map");
    CHECK(rs_fdmap_swap(&m, -1, (void *)1) == RS_FDMAP_FAIL, "a negative number");
    CHECK(rs_fdmap_get(&m, -1) == NULL && rs_fdmap_get(&m, (int)RS_FDMAP_MAX) == NULL, "reads outside the map");
    for (int i = 0; i < n; i++)
        CHECK((intptr_t)rs_fdmap_swap(&m, fds[i], NULL) == fds[i] + 1, "removing fd %d", fds[i]);
    seen[0] = 0, seen[1] = -1;
    rs_fdmap_each(&m, fdmap_count, seen);
    CHECK_EQ(seen[0], 0);
}

/* The peer that spills is not trusted: a SPILL record with a bad count, garbage where its
 * mark should be, a mark with a wrong check, and a socket that ends inside the spilled
 * bytes are each EPROTO, after the bytes that came intact before them. */
static void spill_bad_case(int kind)
{
    struct pair p;
    pair_open_spill(&p, 4096);
    send_str(p.cli, "before");
    uint32_t off = (uint32_t)(p.cli->tx.pos & p.cli->mask);
    uint32_t count = kind == 0 ? 0 : kind == 1 ? RS_SPILL_MAX + 1 : 5;
    if (kind >= 2) {                                  /* the socket's part */
        uint8_t mark[RS_SPILL_MARK_LEN + 5] = { RS_BELL_SPILL, RS_SPILL_VERSION, 0, 0 };
        uint32_t check = rs_footer(p.cli->salt, p.cli->tx.bytes, RS_SPILL_TAG);
        memcpy(mark + 4, &check, 4);
        memcpy(mark + 8, "SPILL", 5);
        if (kind == 2) mark[0] = 0x41;                /* garbage before the mark */
        if (kind == 3) mark[5] ^= 1;                  /* wrong check */
        raw_write(p.fd[1], mark, kind == 4 ? sizeof mark - 2 : sizeof mark);
        if (kind == 4) close_fd(&p, 1);               /* ends inside the spilled bytes */
    }
    rs_tx_put_spill(p.cli, count);
    if (kind == 5) *(uint32_t *)(p.srv->rx.ring + off + 8) = 7;   /* the reserved word */
    rs_tx_flush_bell(p.cli);
    expect_str(p.srv, "before");
    uint8_t b[64];
    ssize_t r = rs_recv(p.srv, b, sizeof b, 0, 1000);
    if (kind == 4 && r == 3) r = rs_recv(p.srv, b, sizeof b, 0, 1000);   /* "SPI" came intact */
    CHECK(r == -EPROTO, "bad SPILL (case %d): rs_recv returned %zd; errmsg \"%s\"", kind, r, rs_conn_errmsg(p.srv));
    CHECK_MSG(p.srv, kind == 2 ? "garbage" : kind == 3 ? "mark" : kind == 4 ? "ended" : "SPILL");
    expect_recv_rc(p.srv, -EPROTO, 0, 100);                       /* sticky */
    pair_close(&p);
}

static void t_spill_hostile(void)
{
    for (int kind = 0; kind < 6; kind++) spill_bad_case(kind);
}

/* ---- 10. peer gone ----------------------------------------------------------------- */

static void t_peer_gone(void)
{
    struct pair p;
    /* empty ring, no FIN, peer's socket closed: EOF (as TCP shows a closed peer) long before the timeout */
    pair_open(&p, 4096, 0);
    send_str(p.srv, "x");
    expect_str(p.cli, "x");
    expect_recv_rc(p.cli, -EAGAIN, RS_MSG_DONTWAIT, 0);
    close_fd(&p, 0);
    double t0 = now_ms();
    expect_recv_rc(p.cli, 0, 0, 2000);
    double dt = now_ms() - t0;
    CHECK(dt < 1000, "EOF took %.0f ms", dt);
    pair_close(&p);

    /* the same with spinning enabled and without any earlier traffic */
    pair_open(&p, 4096, 50000);
    close_fd(&p, 1);
    t0 = now_ms();
    expect_recv_rc(p.srv, 0, 0, 2000);
    dt = now_ms() - t0;
    CHECK(dt < 1000, "EOF took %.0f ms", dt);
    pair_close(&p);

    /* what the peer wrote before dying is delivered first */
    pair_open(&p, 4096, 0);
    send_str(p.srv, "last words");
    close_fd(&p, 0);
    expect_str(p.cli, "last words");
    expect_recv_rc(p.cli, 0, 0, 2000);
    pair_close(&p);

    /* data and FIN, then gone: an orderly EOF, not a reset */
    pair_open(&p, 4096, 0);
    send_str(p.srv, "bye");
    CHECK_EQ(rs_send_fin(p.srv), 0);
    close_fd(&p, 0);
    expect_str(p.cli, "bye");
    expect_recv_rc(p.cli, 0, 0, 2000);
    pair_close(&p);

    /* a producer blocked on a full ring whose consumer dies: EPIPE, not the full timeout */
    pair_open(&p, 4096, 0);
    uint64_t pos = 0;
    fill_ring(p.cli, 100, 95, &pos);
    close_fd(&p, 0);
    uint8_t buf[100] = { 0 };
    t0 = now_ms();
    ssize_t r = rs_send(p.cli, buf, sizeof buf, 0, 2000);
    dt = now_ms() - t0;
    CHECK(r == -EPIPE, "rs_send to a dead peer returned %zd", r);
    CHECK(dt < 1000, "EPIPE took %.0f ms", dt);
    pair_close(&p);
}

/* ---- 11. garbage on the doorbell channel ------------------------------------------- */

static void send_raw_byte(int fd, uint8_t b)
{
    CHECK(send(fd, &b, 1, MSG_NOSIGNAL) == 1, "send: %s", strerror(errno));
}

/* The peer's process died with doorbell bytes of its own still unread on our socket
 * (credit doorbells for writes that had already finished): a reader that never waits,
 * under the preload library (lazy_tidy), must see the end behind them, not EAGAIN for
 * ever (a level-triggered epoll loop would spin on the socket's hang-up). */
static void t_peer_gone_behind_bells(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    p.srv->rx.lazy_tidy = 1;
    send_str(p.cli, "last");
    expect_str(p.srv, "last");
    for (int i = 0; i < 12; i++) send_raw_byte(p.fd[1], RS_BELL_CREDIT);
    close_fd(&p, 1);
    ssize_t r = -EAGAIN;
    for (int i = 0; i < 200 && r == -EAGAIN; i++) {
        uint8_t b[16];
        r = rs_recv(p.srv, b, sizeof b, RS_MSG_DONTWAIT, 0);
        if (r == -EAGAIN) sleep_ms(2);
    }
    CHECK(r == 0, "nonblocking recv after the peer died behind doorbell bytes returned %zd", r);
    pair_close(&p);
}

/* Under the preload library a receive leaves the doorbell of what it consumed on the socket
 * (lazy_tidy), and a level-triggered epoll reports the socket at every call until it is
 * read.  rs_rx_drop_stale_bells reads it off without asking for another: the next record
 * rings no bell (the hook arms before it sleeps).  A bell whose record is still in the
 * ring stays. */
static void t_drop_stale_bells(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    p.srv->rx.lazy_tidy = 1;
    int q = -1;
    expect_recv_rc(p.srv, -EAGAIN, 0, 0);                   /* idle: wants a doorbell */
    CHECK_EQ(rs_rx_go_idle(p.srv), 0);
    send_str(p.cli, "one");
    CHECK_EQ(p.cli->tx.ctl->data_bells, 1);
    rs_rx_drop_stale_bells(p.srv);                          /* its record is unread: the bell stays */
    CHECK(ioctl(p.fd[0], FIONREAD, &q) == 0 && q == 1, "FIONREAD %d with the record unread", q);
    expect_str(p.srv, "one");
    CHECK(ioctl(p.fd[0], FIONREAD, &q) == 0 && q == 1, "set-up: the receive took the bell (FIONREAD %d)", q);
    rs_rx_drop_stale_bells(p.srv);
    CHECK(ioctl(p.fd[0], FIONREAD, &q) == 0 && q == 0, "FIONREAD %d after dropping the stale bell", q);
    send_str(p.cli, "two");                                 /* no bell asked for */
    CHECK_EQ(p.cli->tx.ctl->data_bells, 1);
    expect_str(p.srv, "two");
    CHECK_EQ(rs_rx_go_idle(p.srv), 0);                      /* a wait arms again */
    send_str(p.cli, "three");
    CHECK_EQ(p.cli->tx.ctl->data_bells, 2);
    expect_str(p.srv, "three");
    /* a socket some wait of the program may watch without our hooks (not lazy_tidy): its
     * bell stays for the tidy that arms again */
    p.srv->rx.lazy_tidy = 0;
    rs_rx_drop_stale_bells(p.srv);
    CHECK(ioctl(p.fd[0], FIONREAD, &q) == 0 && q == 1, "FIONREAD %d: a bell was dropped without lazy_tidy", q);
    pair_close(&p);
}

/* Both ends of a pair get event bells as a handshake hands them out: the server's own is
 * the client's peer bell and the other way round. */
static void pair_bells(struct pair *p)
{
    int fds[2];
    CHECK_EQ(rs_bells_create(fds), 0);
    int cli_own = dup(fds[1]), cli_peer = dup(fds[0]);
    CHECK_EQ(rs_conn_set_bells(p->srv, fds[0], fds[1]), 0);
    CHECK_EQ(rs_conn_set_bells(p->cli, cli_own, cli_peer), 0);
}

/* The eventfd's counter, without changing it (/proc/self/fdinfo). */
static uint64_t bell_counter(int fd)
{
    char path[64], line[128];
    snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
    FILE *f = fopen(path, "r");
    uint64_t v = (uint64_t)-1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "eventfd-count: %" SCNx64, &v) == 1) break;
    if (f) fclose(f);
    return v;
}

/* Event bells (PROTOCOL 6.12): a consumer that goes idle for a wait its eventfd wakes asks
 * for RS_WANT_EVENT; the producer raises the eventfd (a write of 0: the counter stays 1)
 * and sends no byte.  A wait that needs the socket (go_idle) still gets its byte; a
 * producer without a bell answers RS_WANT_EVENT with a byte.  The bell wakes an epoll
 * instance it was added to (edge-triggered, never read) once per raise, even with its file
 * made blocking and its counter at the maximum (what a hostile peer sharing it can do),
 * and a descriptor that is not an eventfd is refused (left to the caller to close). */
static void t_event_bells(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    pair_bells(&p);
    p.srv->rx.lazy_tidy = 1;
    int ep = epoll_create1(EPOLL_CLOEXEC);
    uint64_t named = RS_BELL_EPOLL_DATA(p.fd[0]);      /* the bell's events name the socket */
    CHECK_EQ(rs_bell_in_epoll(p.srv, ep, 7, p.fd[0]), 1);
    CHECK_EQ(rs_bell_in_epoll(p.srv, ep, 7, p.fd[0]), 1);        /* once per instance */
    CHECK_EQ(p.srv->rx.bell_nsets, 1);
    struct epoll_event ev;
    CHECK(epoll_wait(ep, &ev, 1, 0) == 1 && ev.data.u64 == named && RS_IS_BELL(ev.data.u64) &&
          RS_BELL_FD(ev.data.u64) == p.fd[0], "adding the bell reports it once, naming the socket");
    int q = -1;
    send_str(p.cli, "x");                   /* the segment starts with a byte asked for: it goes */
    expect_str(p.srv, "x");
    for (int round = 0; round < 3; round++) {
        CHECK_EQ(rs_rx_go_idle_event(p.srv), 0);
        CHECK(p.srv->rx.ctl->want_bell & RS_WANT_EVENT, "want_bell %#x", p.srv->rx.ctl->want_bell);
        CHECK_EQ(epoll_wait(ep, &ev, 1, 0), 0);
        send_str(p.cli, "evt");
        CHECK(epoll_wait(ep, &ev, 1, 1000) == 1 && ev.data.u64 == named, "the event bell did not wake the instance");
        CHECK_EQ(epoll_wait(ep, &ev, 1, 0), 0);                      /* edge-triggered: once */
        CHECK(ioctl(p.fd[0], FIONREAD, &q) == 0 && q == 0, "a doorbell byte was sent too (FIONREAD %d)", q);
        CHECK_EQ(p.cli->tx.event_bells, (uint64_t)round + 1);
        CHECK_EQ(bell_counter(p.srv->rx.bell_fd), 1);               /* a write of 0 */
        send_str(p.cli, "more");                                    /* not asked for again: nothing */
        CHECK_EQ(epoll_wait(ep, &ev, 1, 0), 0);
        expect_str(p.srv, "evtmore");
    }
    /* the same connection waited on under another number (a dup): the bell is renamed (2),
     * and its events name the new number */
    CHECK_EQ(rs_bell_in_epoll(p.srv, ep, 7, 1234), 2);
    CHECK_EQ(rs_bell_in_epoll(p.srv, ep, 7, 1234), 1);
    CHECK_EQ(rs_rx_go_idle_event(p.srv), 0);
    send_str(p.cli, "dup");
    CHECK(epoll_wait(ep, &ev, 1, 1000) == 1 && ev.data.u64 == RS_BELL_EPOLL_DATA(1234), "the renamed bell's data %#llx",
          (unsigned long long)ev.data.u64);
    expect_str(p.srv, "dup");
    CHECK_EQ(rs_bell_in_epoll(p.srv, ep, 7, p.fd[0]), 2);
    /* a fork's child that frees its copy of the connection leaves the parent's bell in the
     * epoll instance they share */
    pid_t child = fork();
    if (child == 0) {
        rs_conn_after_fork_child(p.srv);
        int gone = p.srv->rx.bell_fd < 0 && p.srv->tx.bell_fd < 0;
        rs_conn_free(p.srv);
        _exit(gone ? 0 : 1);
    }
    int status = -1;
    CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "the child kept its bells (status %d)", status);
    CHECK_EQ(rs_rx_go_idle_event(p.srv), 0);
    send_str(p.cli, "fork");
    CHECK(epoll_wait(ep, &ev, 1, 1000) == 1 && ev.data.u64 == named, "the child's free took the bell out of the instance");
    expect_str(p.srv, "fork");
    /* a wait that needs the socket's byte */
    CHECK_EQ(rs_rx_go_idle(p.srv), 0);
    send_str(p.cli, "byte");
    CHECK(ioctl(p.fd[0], FIONREAD, &q) == 0 && q == 1, "no doorbell byte for go_idle (FIONREAD %d)", q);
    expect_str(p.srv, "byte");
    /* the other direction, into the client, by its bell, which the server (a hostile peer,
     * say) made blocking and filled up: the raise neither blocks nor fails */
    int ep2 = epoll_create1(EPOLL_CLOEXEC);
    CHECK_EQ(rs_bell_in_epoll(p.cli, ep2, 8, p.fd[1]), 1);
    CHECK_EQ(epoll_wait(ep2, &ev, 1, 0), 1);
    CHECK(fcntl(p.srv->tx.bell_fd, F_SETFL, 0) == 0, "F_SETFL");
    uint64_t big = 0xfffffffffffffffdull;
    CHECK(write(p.srv->tx.bell_fd, &big, sizeof big) == (ssize_t)sizeof big, "filling the counter");
    CHECK_EQ(epoll_wait(ep2, &ev, 1, 0), 1);
    CHECK_EQ(rs_rx_go_idle_event(p.cli), 0);
    send_str(p.srv, "back");
    CHECK(epoll_wait(ep2, &ev, 1, 1000) == 1 && ev.data.u64 == RS_BELL_EPOLL_DATA(p.fd[1]), "the client's bell did not wake it");
    CHECK_EQ(p.srv->tx.event_bells, 1);
    expect_str(p.cli, "back");
    close(ep2);
    /* a producer that cannot raise the bell rings the socket instead */
    close(p.cli->tx.bell_fd);
    p.cli->tx.bell_fd = -1;
    while (ioctl(p.fd[0], FIONREAD, &q) == 0 && q > 0) { uint8_t b[64]; (void)!read(p.fd[0], b, sizeof b); }
    p.srv->rx.bells_drained = p.cli->tx.ctl->data_bells + p.srv->tx.ctl->credit_bells;
    CHECK_EQ(rs_rx_go_idle_event(p.srv), 0);
    send_str(p.cli, "fallback");
    CHECK(ioctl(p.fd[0], FIONREAD, &q) == 0 && q == 1, "no doorbell byte in place of the bell (FIONREAD %d)", q);
    expect_str(p.srv, "fallback");
    close(ep);
    pair_close(&p);

    /* what a hostile peer might pass instead of an eventfd: refused, and closed */
    pair_open(&p, 4096, 0);
    int pp[2];
    CHECK(pipe(pp) == 0, "pipe");
    int efd = eventfd(0, EFD_CLOEXEC);
    CHECK_EQ(rs_conn_set_bells(p.cli, efd, pp[1]), -EBADF);
    CHECK(fcntl(pp[1], F_GETFD) >= 0 && fcntl(efd, F_GETFD) >= 0, "refused descriptors closed: they are the caller's");
    CHECK(p.cli->rx.bell_fd < 0 && p.cli->tx.bell_fd < 0, "bells kept");
    close(pp[0]);
    close(pp[1]);
    close(efd);
    CHECK_EQ(rs_rx_go_idle_event(p.cli), 0);                        /* without a bell: the byte */
    CHECK_EQ(p.cli->rx.ctl->want_bell & (RS_WANT_EVENT | RS_WANT_NEXT), RS_WANT_NEXT);
    pair_close(&p);
}

/* Producer and consumer on two threads, the consumer asleep in epoll on its event bell and
 * socket between records: every record wakes it (no lost wake-up), bounded in time. */
struct bell_run { rs_conn *c; int n; };
static void *bell_producer_run(void *arg)
{
    struct bell_run *b = arg;
    for (int i = 0; i < b->n; i++) {
        uint32_t v = (uint32_t)i;
        ssize_t r = rs_send(b->c, &v, sizeof v, 0, 10000);          /* blocking: the ring may fill */
        CHECK(r == (ssize_t)sizeof v, "rs_send returned %zd", r);
        if (i % 64 == 0) sched_yield();
    }
    return NULL;
}

static void t_event_bells_threads(void)
{
    struct pair p;
    pair_open(&p, 65536, 0);
    pair_bells(&p);
    p.srv->rx.lazy_tidy = 1;
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event sock = { .events = EPOLLIN, .data.u64 = 1 };
    CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, p.fd[0], &sock) == 0, "epoll_ctl");
    CHECK_EQ(rs_bell_in_epoll(p.srv, ep, 1, p.fd[0]), 1);
    struct bell_run b = { p.cli, 20000 };
    pthread_t t;
    pthread_create(&t, NULL, bell_producer_run, &b);
    double t0 = now_ms();
    int sleeps = 0;
    for (uint32_t want = 0; want < (uint32_t)b.n;) {
        uint32_t v;
        ssize_t r = rs_recv(p.srv, &v, sizeof v, RS_MSG_DONTWAIT, 0);
        if (r == (ssize_t)sizeof v) {
            CHECK_EQ(v, want);
            want++;
            continue;
        }
        CHECK(r == -EAGAIN, "rs_recv %zd", r);
        if (rs_rx_go_idle_event(p.srv)) continue;
        struct epoll_event ev[2];
        CHECK(epoll_wait(ep, ev, 2, 5000) > 0, "asleep 5 s with record %u not woken (lost wake-up)", want);
        sleeps++;
        CHECK(now_ms() - t0 < 60000, "too slow");
    }
    pthread_join(t, NULL);
    fprintf(stderr, "  %d records, %d sleeps, %llu event bells, %llu doorbell bytes\n", b.n, sleeps,
            (unsigned long long)p.cli->tx.event_bells, (unsigned long long)p.cli->tx.ctl->data_bells);
    close(ep);
    pair_close(&p);
}

/* A garbage byte followed by real traffic: the consumer reads the garbage in place of a
 * doorbell it was told about, delivers the data, then reports EPROTO. */
static void t_doorbell_garbage_traffic(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    expect_recv_rc(p.cli, -EAGAIN, RS_MSG_DONTWAIT, 0);     /* idle: wants a doorbell */
    send_raw_byte(p.fd[0], 0x41);
    send_str(p.srv, "data");                                /* rings a real doorbell */
    CHECK(p.srv->tx.ctl->data_bells >= 1, "no doorbell sent");
    expect_str(p.cli, "data");
    ssize_t r = -EAGAIN;
    for (int i = 0; i < 200 && r == -EAGAIN; i++) {
        uint8_t buf[16];
        r = rs_recv(p.cli, buf, sizeof buf, RS_MSG_DONTWAIT, 0);
        if (r == -EAGAIN) sleep_ms(5);
    }
    CHECK(r == -EPROTO, "rs_recv returned %zd, expected -EPROTO", r);
    CHECK_MSG(p.cli, "doorbell");
    CHECK_MSG(p.cli, "0x41");
    pair_close(&p);
}

/* A garbage byte on an idle connection, nothing else sent: the consumer must notice it.
 * Known shim bug (tests/test_ring_c.py KNOWN_SHIM_BUGS): rs_rx_go_idle drains only as many
 * bytes as the peer counted in data_bells + credit_bells, so an uncounted byte is never
 * read, never validated, and keeps the socket readable: nonblocking recv says EAGAIN
 * forever and a blocking recv busy-polls (poll returns at once) until its timeout. */
static void t_doorbell_garbage_idle(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    expect_recv_rc(p.cli, -EAGAIN, RS_MSG_DONTWAIT, 0);
    send_raw_byte(p.fd[0], 0x41);
    ssize_t r = -EAGAIN;
    double t0 = now_ms();
    for (int i = 0; i < 200 && r == -EAGAIN; i++) {
        uint8_t buf[16];
        r = rs_recv(p.cli, buf, sizeof buf, RS_MSG_DONTWAIT, 0);
        if (r == -EAGAIN) sleep_ms(5);
    }
    CHECK(r == -EPROTO, "nonblocking rs_recv on an idle ring with a garbage byte pending still returned %zd "
          "after %.0f ms (expected -EPROTO); the byte was never read: socket still readable = %d",
          r, now_ms() - t0, poll(&(struct pollfd){ .fd = p.fd[1], .events = POLLIN }, 1, 0));
    CHECK_MSG(p.cli, "doorbell");
    CHECK_MSG(p.cli, "0x41");
    /* and a blocking recv reports it too, without waiting for its timeout */
    t0 = now_ms();
    expect_recv_rc(p.cli, -EPROTO, 0, 1000);
    CHECK(now_ms() - t0 < 500, "error not reported at once");
    pair_close(&p);

    /* blocking recv first */
    pair_open(&p, 4096, 0);
    send_raw_byte(p.fd[0], 0x41);
    t0 = now_ms();
    uint8_t buf[16];
    r = rs_recv(p.cli, buf, sizeof buf, 0, 1000);
    CHECK(r == -EPROTO, "blocking rs_recv with a garbage byte pending returned %zd after %.0f ms (expected -EPROTO)",
          r, now_ms() - t0);
    CHECK_MSG(p.cli, "doorbell");
    pair_close(&p);
}

/* ---- 12. peek / waitall ------------------------------------------------------------ */

struct trickle { rs_conn *c; uint32_t stream; int chunks; size_t chunk; int gap_ms; };

static void *trickle_run(void *arg)
{
    struct trickle *t = arg;
    uint8_t buf[4096];
    uint64_t pos = 0;
    for (int i = 0; i < t->chunks; i++) {
        sleep_ms(t->gap_ms);
        fill_pat(buf, t->stream, pos, t->chunk);
        ssize_t r = rs_send(t->c, buf, t->chunk, 0, 5000);
        CHECK(r == (ssize_t)t->chunk, "rs_send returned %zd", r);
        pos += t->chunk;
    }
    return NULL;
}

static void t_peek_waitall(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    char buf[16384];
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_PEEK | RS_MSG_DONTWAIT, 0);
    send_str(p.cli, "hello");
    send_str(p.cli, " ");
    send_str(p.cli, "world");
    uint8_t snap[4096];
    memcpy(snap, p.srv->rx.ring, sizeof snap);
    uint64_t head0 = head_of(p.srv);

    ssize_t r = rs_recv(p.srv, buf, 8, RS_MSG_PEEK, 1000);     /* across records */
    CHECK(r == 8 && memcmp(buf, "hello wo", 8) == 0, "peek 8 returned %zd", r);
    r = rs_recv(p.srv, buf, sizeof buf, RS_MSG_PEEK, 1000);
    CHECK(r == 11 && memcmp(buf, "hello world", 11) == 0, "peek all returned %zd", r);
    CHECK(memcmp(snap, p.srv->rx.ring, sizeof snap) == 0, "peek changed the ring");
    CHECK_EQ(head_of(p.srv), head0);
    CHECK_EQ(p.srv->rx.bytes, 0);
    expect_str(p.srv, "hel");
    r = rs_recv(p.srv, buf, sizeof buf, RS_MSG_PEEK, 1000);     /* mid-record */
    CHECK(r == 8 && memcmp(buf, "lo world", 8) == 0, "peek after partial read returned %zd", r);
    r = rs_recv(p.srv, buf, 2, RS_MSG_PEEK, 1000);
    CHECK(r == 2 && memcmp(buf, "lo", 2) == 0, "peek 2 returned %zd", r);
    expect_str(p.srv, "lo world");
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_PEEK | RS_MSG_DONTWAIT, 0);

    /* peek across a WRAP record */
    uint8_t out[3000];
    fill_pat(out, 80, 0, 3000);
    send_all_nb(p.cli, out, 3000);
    recv_exact(p.srv, buf, 3000, 1000);
    /* now at 3072: a record of 600 leaves 416 bytes, the next one of 500 wraps */
    uint64_t tx0 = p.cli->tx.pos, recs0 = p.cli->tx.records;
    CHECK_EQ(tx0, 3072);
    fill_pat(out, 81, 0, 1100);
    send_all_nb(p.cli, out, 600);
    send_all_nb(p.cli, out + 600, 500);
    CHECK_EQ(p.cli->tx.records - recs0, 3);                 /* data, WRAP, data */
    r = rs_recv(p.srv, buf, 1100, RS_MSG_PEEK, 1000);
    CHECK_EQ(r, 1100);
    VERIFY_PAT(buf, 81, 0, 1100);
    r = rs_recv(p.srv, buf, 1100, RS_MSG_PEEK | RS_MSG_WAITALL, 1000);   /* WAITALL ignored with PEEK */
    CHECK_EQ(r, 1100);
    VERIFY_PAT(buf, 81, 0, 1100);
    recv_exact(p.srv, buf, 1100, 1000);
    VERIFY_PAT(buf, 81, 0, 1100);
    CHECK_RING_ZERO(p.srv);

    /* WAITALL over records that are all there */
    fill_pat(out, 82, 0, 3000);
    send_all_nb(p.cli, out, 1000);
    send_all_nb(p.cli, out + 1000, 1000);
    send_all_nb(p.cli, out + 2000, 1000);
    r = rs_recv(p.srv, buf, 3000, RS_MSG_WAITALL, 1000);
    CHECK_EQ(r, 3000);
    VERIFY_PAT(buf, 82, 0, 3000);

    /* PEEK then EOF */
    send_str(p.cli, "ab");
    CHECK_EQ(rs_send_fin(p.cli), 0);
    r = rs_recv(p.srv, buf, 10, RS_MSG_PEEK, 1000);
    CHECK(r == 2 && memcmp(buf, "ab", 2) == 0, "peek before FIN returned %zd", r);
    expect_str(p.srv, "ab");
    expect_recv_rc(p.srv, 0, RS_MSG_PEEK, 1000);
    expect_recv_rc(p.srv, 0, 0, 1000);
    pair_close(&p);

    /* WAITALL across records that arrive one by one, larger than the ring */
    static const uint32_t spins[] = { 0, 20000 };
    for (int i = 0; i < 2; i++) {
        pair_open(&p, 4096, spins[i]);
        struct trickle t = { p.cli, 83, 10, 1000, 10 };
        pthread_t th;
        CHECK(pthread_create(&th, NULL, trickle_run, &t) == 0, "pthread_create");
        double t0 = now_ms();
        r = rs_recv(p.srv, buf, 10000, RS_MSG_WAITALL, 10000);
        double dt = now_ms() - t0;
        CHECK(r == 10000, "WAITALL returned %zd after %.0f ms", r, dt);
        VERIFY_PAT(buf, 83, 0, 10000);
        CHECK(dt >= 90, "WAITALL returned after %.0f ms, before the data was sent", dt);
        CHECK(pthread_join(th, NULL) == 0, "pthread_join");
        /* WAITALL with a timeout that passes: what arrived */
        struct trickle t2 = { p.cli, 84, 2, 100, 1 };
        CHECK(pthread_create(&th, NULL, trickle_run, &t2) == 0, "pthread_create");
        CHECK(pthread_join(th, NULL) == 0, "pthread_join");
        r = rs_recv(p.srv, buf, 1000, RS_MSG_WAITALL, 100);
        CHECK_EQ(r, 200);
        VERIFY_PAT(buf, 84, 0, 200);
        /* a blocking PEEK waits for data and leaves it in the ring */
        struct trickle t3 = { p.cli, 85, 1, 50, 50 };
        CHECK(pthread_create(&th, NULL, trickle_run, &t3) == 0, "pthread_create");
        r = rs_recv(p.srv, buf, 50, RS_MSG_PEEK, 5000);
        CHECK_EQ(r, 50);
        VERIFY_PAT(buf, 85, 0, 50);
        CHECK(pthread_join(th, NULL) == 0, "pthread_join");
        recv_exact(p.srv, buf, 50, 1000);
        VERIFY_PAT(buf, 85, 0, 50);
        pair_close(&p);
    }
}

/* ---- the doorbell invariant after a spinning recv ----------------------------------- */

struct late_send { rs_conn *c; const char *s; volatile int consumer_in_recv; };

/* Sends while the consumer is inside recv: as soon as it advertises that it busy-polls
 * (the producer sees `spinning`), or after 200 ms if it never does. */
static void *late_send_run(void *arg)
{
    struct late_send *l = arg;
    while (!__atomic_load_n(&l->consumer_in_recv, __ATOMIC_ACQUIRE)) sleep_ms(1);
    double t0 = now_ms();
    while (!__atomic_load_n(&l->c->tx.ctl->spinning, __ATOMIC_ACQUIRE) && now_ms() - t0 < 200) {}
    send_all_nb(l->c, l->s, strlen(l->s));
    return NULL;
}

/* Guards against a MSG_PEEK bug (in shim/ up to ba6ef1b): spin_for_data advertised
 * spinning/spin_limit for a peek too, so the producer skipped the doorbell for data the
 * peek then left in the ring.
 *
 * rs_doorbell.c promises: whenever records are unconsumed and nobody is inside recv, at
 * least one doorbell byte is pending, so select/poll/epoll on the socket (what event
 * loops wait on) report it readable.  A consumer that spins inside recv tells the
 * producer to skip the doorbell for data that recv is "sure to absorb". */
static void t_peek_doorbell(void)
{
    static const int flag_sets[] = { 0, RS_MSG_PEEK };
    for (int i = 0; i < 2; i++) {
        struct pair p;
        pair_open(&p, 4096, 2000u * 1000 * 1000);       /* spin up to 2 s: catches the send */
        expect_recv_rc(p.cli, -EAGAIN, RS_MSG_DONTWAIT, 0);  /* idle: wants a doorbell */
        struct late_send l = { .c = p.srv, .s = "xy" };
        pthread_t th;
        CHECK(pthread_create(&th, NULL, late_send_run, &l) == 0, "pthread_create");
        /* a plain recv of 1 byte leaves "y"; a peek with room for everything leaves "xy" */
        char buf[64];
        size_t want = flag_sets[i] ? sizeof buf : 1;
        __atomic_store_n(&l.consumer_in_recv, 1, __ATOMIC_RELEASE);
        ssize_t r = rs_recv(p.cli, buf, want, flag_sets[i], 5000);
        CHECK(pthread_join(th, NULL) == 0, "pthread_join");
        CHECK(r == (flag_sets[i] ? 2 : 1) && buf[0] == 'x', "rs_recv(flags 0x%x) returned %zd", flag_sets[i], r);
        CHECK_EQ(rs_rx_available(p.cli) > 0, 1);
        struct pollfd pf = { .fd = p.fd[1], .events = POLLIN };
        int pr = poll(&pf, 1, 200);
        CHECK(pr == 1, "after rs_recv(flags 0x%x) returned with data left in the ring, the socket is not "
              "readable (poll -> %d, producer doorbells sent: %llu): select/epoll would never wake up",
              flag_sets[i], pr, (unsigned long long)p.srv->tx.ctl->data_bells);
        expect_str(p.cli, i ? "xy" : "y");
        pair_close(&p);
    }
}

/* ---- rs_rx_available (FIONREAD, socket.pending_bytes) ----------------------------- */

/* Known shim bug (tests/test_ring_c.py KNOWN_SHIM_BUGS): rs_rx_take leaves rx_cur_off at
 * the length of a record it finished when no next record is there yet, and
 * rs_rx_available computes cur_len - cur_off = 0 - len in 32 bits: about 4 GiB. */
static void t_rx_available(void)
{
    struct pair p;
    pair_open(&p, 4096, 0);
    char buf[4096];
    CHECK_EQ(rs_rx_available(p.srv), 0);
    send_str(p.cli, "0123456789");                         /* records of 10, 20, 30 */
    send_str(p.cli, "abcdefghijklmnopqrst");
    send_str(p.cli, "ABCDEFGHIJKLMNOPQRSTUVWXYZ!?.,");
    CHECK_EQ(rs_rx_available(p.srv), 60);
    expect_str(p.srv, "01234");                            /* inside the first record */
    CHECK_EQ(rs_rx_available(p.srv), 55);
    expect_str(p.srv, "56789");                            /* exactly the end of a record */
    CHECK_EQ(rs_rx_available(p.srv), 50);
    expect_str(p.srv, "abcdefghijklmnopqrstABCDEFGHIJKLMNOPQRSTUVWXYZ!?.,");
    CHECK_EQ(rs_rx_available(p.srv), 0);
    /* across a WRAP record and up to a FIN */
    uint64_t pos = 0;
    advance_to(p.cli, 4000, 86, &pos);
    recv_exact(p.srv, buf, (size_t)pos, 1000);
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
    send_all_nb(p.cli, buf, 100);                          /* 108 bytes left at the end */
    send_all_nb(p.cli, buf, 200);                          /* WRAP, then the record */
    CHECK_EQ(rs_send_fin(p.cli), 0);
    CHECK_EQ(rs_rx_available(p.srv), 300);
    recv_exact(p.srv, buf, 300, 1000);
    CHECK_EQ(rs_rx_available(p.srv), 0);
    expect_recv_rc(p.srv, 0, 0, 1000);
    CHECK_EQ(rs_rx_available(p.srv), 0);
    pair_close(&p);
}

/* ---- preamble frames (rs_preamble.c, docs/PROTOCOL.md 2.9) ------------------------ */

/* Between its HELLO and its processing of the server's answer, a client's writes travel on
 * the TCP stream as frames  u8 kind | u8 zero[3] | u32 length (big endian) | payload,
 * kind 0xDA DATA (1..65536 bytes) or 0x5A SWITCH (length 0, the last frame).  The server
 * (rx_pre = 1) unwraps them before it reads the ring (ACCEPT) or plain TCP (DECLINE:
 * rs_conn_new_tcp).  Here fd[1] plays the client's TCP socket, fd[0] the server's. */

static void put_pre_hdr(uint8_t h[RS_PRE_HDR], uint8_t kind, uint32_t len)
{
    h[0] = kind; h[1] = h[2] = h[3] = 0;
    h[4] = (uint8_t)(len >> 24); h[5] = (uint8_t)(len >> 16); h[6] = (uint8_t)(len >> 8); h[7] = (uint8_t)len;
}

/* Blocking write of all of [b, b+n) on a raw socket. */
static void raw_write(int fd, const void *b, size_t n)
{
    const uint8_t *p = b;
    while (n) {
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        if (r < 0 && errno == EINTR) continue;
        CHECK(r > 0, "send: %s", strerror(errno));
        p += r;
        n -= (size_t)r;
    }
}

static void raw_str(int fd, const char *s) { raw_write(fd, s, strlen(s)); }

/* Blocking read of exactly n bytes from a raw socket (fails on EOF or after timeout_ms). */
static void raw_read(int fd, void *b, size_t n, int timeout_ms)
{
    size_t got = 0;
    while (got < n) {
        struct pollfd pf = { .fd = fd, .events = POLLIN };
        int pr = poll(&pf, 1, timeout_ms);
        CHECK(pr == 1, "raw_read: nothing readable after %d ms (%zu of %zu bytes)", timeout_ms, got, n);
        ssize_t r = recv(fd, (uint8_t *)b + got, n - got, MSG_DONTWAIT);
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        CHECK(r > 0, "raw_read: recv returned %zd (%s) after %zu of %zu bytes", r, r < 0 ? strerror(errno) : "EOF", got, n);
        got += (size_t)r;
    }
}

/* A DATA frame written by hand (not by rs_pre_send). */
static void raw_data_frame(int fd, const char *s)
{
    uint8_t h[RS_PRE_HDR];
    put_pre_hdr(h, RS_PRE_DATA, (uint32_t)strlen(s));
    raw_write(fd, h, sizeof h);
    raw_str(fd, s);
}

static void pre_send_str(int fd, const char *s)
{
    ssize_t r = rs_pre_send(fd, s, strlen(s), 0, -1, NULL);
    CHECK(r == (ssize_t)strlen(s), "rs_pre_send(\"%s\") returned %zd (%s)", s, r, r < 0 ? strerror((int)-r) : "short");
}

static void pre_switch(int fd)
{
    int r = rs_pre_switch(fd);
    CHECK(r == 0, "rs_pre_switch returned %d (%s)", r, strerror(-r));
}

/* One rs_recv(len, flags) must return exactly the bytes of `want`. */
static void expect_recv_str(rs_conn *c, size_t len, int flags, int timeout_ms, const char *want)
{
    char buf[512];
    CHECK(len <= sizeof buf, "len too large");
    size_t n = strlen(want);
    memset(buf, 0, sizeof buf);
    ssize_t r = rs_recv(c, buf, len, flags, timeout_ms);
    CHECK(r == (ssize_t)n && memcmp(buf, want, n) == 0,
          "rs_recv(%zu, flags 0x%x) returned %zd \"%.*s\", expected %zu \"%s\"; errmsg \"%s\"", len, flags, r,
          r > 0 ? (int)r : 0, buf, n, want, rs_conn_errmsg(c));
}

/* A peek must return a non-empty prefix of `rest` (the stream still to be read) and
 * consume nothing. */
static void expect_peek_prefix(rs_conn *c, const char *rest)
{
    char buf[512];
    size_t n = strlen(rest);
    ssize_t r = rs_recv(c, buf, sizeof buf, RS_MSG_PEEK, 1000);
    CHECK(r >= 1 && (size_t)r <= n && memcmp(buf, rest, (size_t)r) == 0,
          "peek returned %zd \"%.*s\", expected a prefix of \"%s\"; errmsg \"%s\"", r, r > 0 ? (int)r : 0, buf, rest,
          rs_conn_errmsg(c));
}

/* A server connection with rings whose client's preamble is still to come. */
static void pre_pair_open(struct pair *p, uint32_t ring)
{
    pair_open(p, ring, 0);
    p->srv->rx.pre.active = 1;
}

/* A server that declined: no rings, only the client's preamble to unwrap. */
static void pre_tcp_open(struct pair *p)
{
    memset(p, 0, sizeof *p);
    pair_sockets(p);
    p->srv = rs_conn_new_tcp(p->fd[0]);
    CHECK(p->srv, "rs_conn_new_tcp");
    CHECK_EQ(p->srv->rx.pre.active, 1);
    CHECK(p->srv->rx.ring == NULL && p->srv->tx.ring == NULL, "rs_conn_new_tcp made rings");
}

static int readable(int fd, int timeout_ms)
{
    struct pollfd pf = { .fd = fd, .events = POLLIN };
    return poll(&pf, 1, timeout_ms);
}

/* The client's TCP stream ends (its half-close after its ring moved, 6.8) while its
 * preamble is still unread in front of its SWITCH and RESYNC frame: a writer that finds
 * its own ring full must not take that end for the client's death (a peek at the socket
 * sees only preamble there), and the server then reads everything in order. */
static void t_pre_moved_behind_preamble(void)
{
    struct pair p;
    pre_pair_open(&p, 4096);
    pre_send_str(p.fd[1], "early");
    pre_switch(p.fd[1]);
    uint64_t wpos = 0, rpos = 0, spos = 0, crpos = 0;
    uint64_t in_ring = fill_and_move(p.cli, 7, &wpos);
    CHECK_EQ(rs_send_fin(p.cli), 0);                              /* a TCP FIN now */
    struct pollfd pf = { .fd = p.fd[0], .events = POLLRDHUP };
    CHECK(poll(&pf, 1, 2000) == 1 && (pf.revents & POLLRDHUP), "the client's FIN did not arrive");
    fill_ring(p.srv, 1000, 9, &spos);                             /* ends at a full ring: EAGAIN, not EPIPE */
    CHECK(spos > 0, "the server wrote nothing");
    CHECK_EQ(p.srv->tcp_eof, 0);
    expect_str(p.srv, "early");
    expect_pat(p.srv, 7, &rpos, in_ring);
    expect_pat(p.srv, 7, &rpos, (size_t)(wpos - in_ring));
    expect_recv_rc(p.srv, 0, 0, 1000);
    expect_pat(p.cli, 9, &crpos, spos);
    pair_close(&p);
}

/* The bytes rs_pre_send and rs_pre_switch put on the wire. */
static void t_pre_wire(void)
{
    struct pair p;
    pre_pair_open(&p, 4096);
    CHECK_EQ(rs_pre_send(p.fd[1], "x", 0, 0, -1, NULL), 0);              /* nothing to send: no frame */
    pre_send_str(p.fd[1], "hello");
    pre_switch(p.fd[1]);
    static const uint8_t want[] = { 0xDA, 0, 0, 0, 0, 0, 0, 5, 'h', 'e', 'l', 'l', 'o',
                                    0x5A, 0, 0, 0, 0, 0, 0, 0 };
    uint8_t raw[64];
    ssize_t n = recv(p.fd[0], raw, sizeof raw, MSG_PEEK | MSG_DONTWAIT);
    CHECK(n == (ssize_t)sizeof want && memcmp(raw, want, sizeof want) == 0,
          "wire bytes differ (%zd bytes, expected %zu)", n, sizeof want);
    expect_recv_str(p.srv, 64, 0, 1000, "hello");
    CHECK_EQ(p.srv->rx.pre.active, 1);                                     /* SWITCH not read yet */
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);            /* reads SWITCH, ring empty */
    CHECK_EQ(p.srv->rx.pre.active, 0);
    CHECK_EQ(readable(p.fd[0], 0), 0);
    /* the length is big endian: 0x1234 and the maximum, 65536 = 0x00010000 */
    static uint8_t big[RS_PRE_MAX + 100];
    fill_pat(big, 91, 0, sizeof big);
    CHECK_EQ(rs_pre_send(p.fd[1], big, 0x1234, 0, -1, NULL), 0x1234);
    uint8_t h[RS_PRE_HDR], payload[0x1234];
    raw_read(p.fd[0], h, sizeof h, 1000);
    CHECK(h[0] == 0xDA && h[1] == 0 && h[2] == 0 && h[3] == 0 && h[4] == 0 && h[5] == 0 && h[6] == 0x12 && h[7] == 0x34,
          "header of a 0x1234-byte frame: %02x %02x %02x %02x %02x %02x %02x %02x", h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
    raw_read(p.fd[0], payload, sizeof payload, 1000);
    VERIFY_PAT(payload, 91, 0, sizeof payload);
    /* a blocking send of more than the maximum takes exactly the maximum */
    CHECK_EQ(rs_pre_send(p.fd[1], big, sizeof big, 0, -1, NULL), RS_PRE_MAX);
    raw_read(p.fd[0], h, sizeof h, 1000);
    CHECK(h[0] == 0xDA && h[4] == 0 && h[5] == 1 && h[6] == 0 && h[7] == 0,
          "header of a 65536-byte frame: %02x .. %02x %02x %02x %02x", h[0], h[4], h[5], h[6], h[7]);
    static uint8_t back[RS_PRE_MAX];
    raw_read(p.fd[0], back, sizeof back, 1000);
    VERIFY_PAT(back, 91, 0, sizeof back);
    CHECK_EQ(readable(p.fd[0], 0), 0);
    pair_close(&p);
}

/* DATA frames, then SWITCH, then ring data: read in that order even though the ring
 * already holds data when the server starts reading. */
static void t_pre_order(void)
{
    struct pair p;
    pre_pair_open(&p, 4096);
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
    expect_recv_rc(p.srv, -EAGAIN, 0, 0);
    pre_send_str(p.fd[1], "abc");
    raw_data_frame(p.fd[1], "defgh");
    pre_switch(p.fd[1]);
    send_str(p.cli, "ring!");                                       /* first record: one doorbell */
    CHECK_EQ(p.cli->tx.ctl->data_bells, 1);
    CHECK_EQ(rs_rx_ready(p.srv), 1);                                /* preamble frames are data */
    CHECK_EQ(rs_rx_available(p.srv), 13);                           /* frames on the socket + ring */
    expect_recv_str(p.srv, 64, 0, 1000, "abc");
    CHECK_EQ(p.srv->rx.pre.active, 1);
    expect_recv_str(p.srv, 2, 0, 1000, "de");
    CHECK_EQ(rs_rx_available(p.srv), 8);                            /* rest of the frame + ring */
    expect_recv_str(p.srv, 64, 0, 1000, "fgh");
    expect_recv_str(p.srv, 64, 0, 1000, "ring!");
    CHECK_EQ(p.srv->rx.pre.active, 0);
    /* the byte after SWITCH was a doorbell, counted and drained as one */
    CHECK_EQ(p.srv->rx.bells_drained, 1);
    CHECK(readable(p.fd[0], 0) == 0, "doorbell left on the socket after the ring was emptied");
    /* from now on an ordinary ring connection, both ways */
    send_str(p.cli, "more");
    expect_str(p.srv, "more");
    send_str(p.srv, "back");
    expect_str(p.cli, "back");
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
    CHECK_EQ(rs_send_fin(p.cli), 0);
    expect_recv_rc(p.srv, 0, 0, 1000);
    pair_close(&p);

    /* an empty preamble: SWITCH alone, which readiness consumes (it is not data) */
    pre_pair_open(&p, 4096);
    pre_switch(p.fd[1]);
    CHECK_EQ(rs_rx_ready(p.srv), 0);
    CHECK_EQ(p.srv->rx.pre.active, 0);
    CHECK(readable(p.fd[0], 0) == 0, "SWITCH left on the socket");
    send_str(p.cli, "direct");
    CHECK_EQ(rs_rx_ready(p.srv), 1);
    expect_recv_str(p.srv, 64, 0, 1000, "direct");
    CHECK_EQ(p.srv->rx.pre.active, 0);
    pair_close(&p);
}

/* A server thread asleep in recv during the preamble, and another thread of the program
 * looking at the socket meanwhile (a poll, or the hold: rs_pre_settle_locked): the SWITCH
 * that wakes the reader must stay the reader's.  Taken by the other thread, nothing woke
 * the reader for the ring's data, and the socket's next byte (here the doorbell) was read
 * as a frame header: the receive failed with "garbage preamble frame" or waited out its
 * timeout (a VM write-first echo over rdma did, 1 run in 60). */
struct pre_reader { rs_conn *c; char buf[64]; ssize_t n; };

static void *pre_reader_run(void *arg)
{
    struct pre_reader *r = arg;
    r->n = rs_recv(r->c, r->buf, sizeof r->buf, 0, 3000);
    return NULL;
}

static void t_pre_switch_stays_the_readers(void)
{
    for (int i = 0; i < 30; i++) {
        struct pair p;
        pre_pair_open(&p, 4096);
        struct pre_reader r = { .c = p.srv };
        pthread_t t;
        CHECK_EQ(pthread_create(&t, NULL, pre_reader_run, &r), 0);
        usleep(i % 3 ? 5000 : 0);                      /* asleep on the socket, or not yet */
        pre_switch(p.fd[1]);
        for (int k = 0; k < 200 && RS_GET(p.srv->rx.pre.active); k++) rs_pre_settle(p.srv);
        send_str(p.cli, "ring");
        CHECK_EQ(pthread_join(t, NULL), 0);
        CHECK(r.n == 4 && memcmp(r.buf, "ring", 4) == 0, "round %d: the reader got %zd (%s)", i, r.n,
              r.n < 0 ? rs_conn_errmsg(p.srv) : "");
        CHECK_EQ(p.srv->rx.pre.active, 0);
        pair_close(&p);
    }
}

static void t_pre_peek(void)
{
    struct pair p;
    pre_pair_open(&p, 4096);
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_PEEK | RS_MSG_DONTWAIT, 0);
    pre_send_str(p.fd[1], "hello");
    pre_send_str(p.fd[1], "world");
    pre_switch(p.fd[1]);
    send_str(p.cli, "ring");
    expect_peek_prefix(p.srv, "helloworldring");
    expect_peek_prefix(p.srv, "helloworldring");                   /* nothing consumed */
    expect_recv_str(p.srv, 2, 0, 1000, "he");
    expect_peek_prefix(p.srv, "lloworldring");
    expect_recv_str(p.srv, 3, RS_MSG_WAITALL, 1000, "llo");          /* exactly the frame's end */
    expect_peek_prefix(p.srv, "worldring");                          /* the next header is read, */
    expect_peek_prefix(p.srv, "worldring");
    expect_recv_str(p.srv, 5, RS_MSG_WAITALL, 1000, "world");        /* ... its payload is not */
    CHECK_EQ(p.srv->rx.pre.active, 1);
    expect_peek_prefix(p.srv, "ring");                               /* through SWITCH into the ring */
    CHECK_EQ(p.srv->rx.pre.active, 0);
    expect_peek_prefix(p.srv, "ring");
    expect_recv_str(p.srv, 64, 0, 1000, "ring");
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_PEEK | RS_MSG_DONTWAIT, 0);
    pair_close(&p);

    /* the same on a connection without rings */
    pre_tcp_open(&p);
    raw_data_frame(p.fd[1], "pre");
    pre_switch(p.fd[1]);
    raw_str(p.fd[1], "plain");
    expect_peek_prefix(p.srv, "preplain");
    expect_recv_str(p.srv, 3, RS_MSG_WAITALL, 1000, "pre");
    expect_peek_prefix(p.srv, "plain");
    CHECK_EQ(p.srv->rx.pre.active, 0);
    expect_recv_str(p.srv, 5, RS_MSG_WAITALL, 1000, "plain");
    pair_close(&p);
}

struct pre_later { struct pair *p; int ms; };

/* 50 ms later: the rest of the preamble, SWITCH, then ring data. */
static void *pre_later_run(void *arg)
{
    struct pre_later *l = arg;
    sleep_ms(l->ms);
    pre_send_str(l->p->fd[1], "defg");
    sleep_ms(20);
    pre_switch(l->p->fd[1]);
    sleep_ms(20);
    send_str(l->p->cli, "hijkl");
    return NULL;
}

static void t_pre_waitall(void)
{
    struct pair p;
    pre_pair_open(&p, 4096);
    pre_send_str(p.fd[1], "abc");
    struct pre_later l = { &p, 50 };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, pre_later_run, &l) == 0, "pthread_create");
    char buf[16] = { 0 };
    double t0 = now_ms();
    ssize_t r = rs_recv(p.srv, buf, 12, RS_MSG_WAITALL, 5000);
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    CHECK(r == 12 && memcmp(buf, "abcdefghijkl", 12) == 0, "MSG_WAITALL across frames and into the ring returned "
          "%zd \"%.*s\"; errmsg \"%s\"", r, r > 0 ? (int)r : 0, buf, rs_conn_errmsg(p.srv));
    CHECK(now_ms() - t0 >= 80, "returned before the data was sent");
    CHECK_EQ(p.srv->rx.pre.active, 0);
    pair_close(&p);

    /* all there at once, on a connection with and one without rings */
    pre_pair_open(&p, 4096);
    raw_data_frame(p.fd[1], "a");
    raw_data_frame(p.fd[1], "bc");
    pre_switch(p.fd[1]);
    send_str(p.cli, "def");
    send_str(p.cli, "gh");
    expect_recv_str(p.srv, 8, RS_MSG_WAITALL, 1000, "abcdefgh");
    pair_close(&p);
    pre_tcp_open(&p);
    raw_data_frame(p.fd[1], "ab");
    pre_switch(p.fd[1]);
    raw_str(p.fd[1], "cd");
    expect_recv_str(p.srv, 4, RS_MSG_WAITALL, 1000, "abcd");
    pair_close(&p);
    /* a timeout inside the preamble returns what arrived */
    pre_tcp_open(&p);
    raw_data_frame(p.fd[1], "xy");
    expect_recv_str(p.srv, 4, RS_MSG_WAITALL, 30, "xy");
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_WAITALL, 30);
    pair_close(&p);
}

/* A server that declined: after SWITCH the stream is plain TCP bytes. */
static void t_pre_tcp(void)
{
    struct pair p;
    pre_tcp_open(&p);
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
    pre_send_str(p.fd[1], "pre");
    pre_send_str(p.fd[1], "amble");
    pre_switch(p.fd[1]);
    raw_str(p.fd[1], "plain");
    CHECK_EQ(rs_rx_ready(p.srv), 0);
    expect_recv_str(p.srv, 64, 0, 1000, "pre");
    expect_recv_str(p.srv, 8, RS_MSG_WAITALL, 1000, "amblepla");
    CHECK_EQ(p.srv->rx.pre.active, 0);
    expect_recv_str(p.srv, 64, 0, 1000, "in");
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
    expect_recv_rc(p.srv, -EAGAIN, 0, 20);
    /* bytes that look like frame headers are data now */
    static const uint8_t fake[RS_PRE_HDR] = { 0xDA, 0, 0, 0, 0, 0, 0, 1 };
    raw_write(p.fd[1], fake, sizeof fake);
    uint8_t buf[16];
    CHECK_EQ(rs_recv(p.srv, buf, sizeof fake, RS_MSG_WAITALL, 1000), sizeof fake);
    CHECK(memcmp(buf, fake, sizeof fake) == 0, "plain bytes changed");
    raw_str(p.fd[1], "tail");
    close_fd(&p, 1);
    expect_recv_str(p.srv, 64, 0, 1000, "tail");
    expect_recv_rc(p.srv, 0, 0, 1000);
    CHECK_EQ(p.srv->err, 0);
    pair_close(&p);
}

/* Headers a client never writes: a sticky EPROTO with a message, on both kinds of
 * server connection, after the bytes of the frames before them. */
static void t_pre_garbage(void)
{
    static const struct { uint8_t h[RS_PRE_HDR]; const char *what; } bad[] = {
        { { 'G', 'E', 'T', ' ', '/', ' ', 'H', 'T' }, "text" },
        { { 0xDA, 0, 0, 0, 0, 0, 0, 0 }, "DATA of length 0" },
        { { 0xDA, 0, 0, 0, 0, 1, 0, 1 }, "DATA of length 65537" },
        { { 0xDA, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF }, "DATA of length 2^32-1" },
        { { 0xDA, 0, 0, 0, 0x01, 0, 0, 0x01 }, "DATA of length 2^24+1" },
        { { 0xDA, 1, 0, 0, 0, 0, 0, 1 }, "non-zero byte 1" },
        { { 0xDA, 0, 0x80, 0, 0, 0, 0, 1 }, "non-zero byte 2" },
        { { 0xDA, 0, 0, 1, 0, 0, 0, 1 }, "non-zero byte 3" },
        { { 0x5A, 0, 0, 0, 0, 0, 0, 1 }, "SWITCH of length 1" },
        { { 0x5A, 0, 0, 0, 1, 0, 0, 0 }, "SWITCH of length 2^24" },
        { { RS_BELL_DATA, 0, 0, 0, 0, 0, 0, 0 }, "a doorbell byte" },
        { { 0, 0, 0, 0, 0, 0, 0, 1 }, "kind 0" },
        { { 0xDB, 0, 0, 0, 0, 0, 0, 1 }, "kind 0xDB" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        for (int rings = 0; rings < 2; rings++) {
            struct pair p;
            if (rings) pre_pair_open(&p, 4096); else pre_tcp_open(&p);
            raw_data_frame(p.fd[1], "ok");
            raw_write(p.fd[1], bad[i].h, RS_PRE_HDR);
            raw_str(p.fd[1], "payload");
            char buf[64];
            ssize_t r = rs_recv(p.srv, buf, 10, RS_MSG_WAITALL, 1000);
            CHECK(r == 2 && memcmp(buf, "ok", 2) == 0, "%s: the frame before it: rs_recv returned %zd", bad[i].what, r);
            r = rs_recv(p.srv, buf, sizeof buf, 0, 1000);
            CHECK(r == -EPROTO, "%s (rings %d): rs_recv returned %zd, expected -EPROTO", bad[i].what, rings, r);
            CHECK_MSG(p.srv, "garbage preamble frame");
            CHECK_EQ(p.srv->err, EPROTO);
            expect_recv_rc(p.srv, -EPROTO, RS_MSG_DONTWAIT, 0);      /* sticky */
            expect_recv_rc(p.srv, -EPROTO, RS_MSG_PEEK, 0);
            pair_close(&p);
        }
    }
    /* the message names the kind and the length */
    struct pair p;
    pre_tcp_open(&p);
    static const uint8_t h[RS_PRE_HDR] = { 0xDA, 0, 0, 0, 0, 1, 0, 1 };
    raw_write(p.fd[1], h, sizeof h);
    expect_recv_rc(p.srv, -EPROTO, 0, 1000);
    CHECK_MSG(p.srv, "0xda");
    CHECK_MSG(p.srv, "65537");
    pair_close(&p);
    /* the limits themselves are fine: 1 and 65536 bytes */
    pre_tcp_open(&p);
    static uint8_t big[RS_PRE_MAX], back[RS_PRE_MAX];
    fill_pat(big, 92, 0, sizeof big);
    uint8_t hdr[RS_PRE_HDR];
    put_pre_hdr(hdr, RS_PRE_DATA, RS_PRE_MAX);
    raw_write(p.fd[1], hdr, sizeof hdr);
    raw_write(p.fd[1], big, sizeof big);
    raw_data_frame(p.fd[1], "!");
    pre_switch(p.fd[1]);
    CHECK_EQ(rs_recv(p.srv, back, sizeof back, RS_MSG_WAITALL, 1000), RS_PRE_MAX);
    VERIFY_PAT(back, 92, 0, sizeof back);
    expect_recv_str(p.srv, 64, 0, 1000, "!");
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
    CHECK_EQ(p.srv->rx.pre.active, 0);
    pair_close(&p);
}

static void t_pre_eof(void)
{
    for (int rings = 0; rings < 2; rings++) {
        struct pair p;
        uint8_t h[RS_PRE_HDR];
        char buf[64];
        /* EOF inside a frame's payload (a client whose non-blocking write left the frame
         * open, then closed): the bytes that came, then the end of the stream, as TCP */
        for (int waitall = 0; waitall < 2; waitall++) {
            if (rings) pre_pair_open(&p, 4096); else pre_tcp_open(&p);
            put_pre_hdr(h, RS_PRE_DATA, 10);
            raw_write(p.fd[1], h, sizeof h);
            raw_str(p.fd[1], "abcd");
            close_fd(&p, 1);
            expect_recv_str(p.srv, waitall ? 10 : 64, waitall ? RS_MSG_WAITALL : 0, 1000, "abcd");
            expect_recv_rc(p.srv, 0, 0, 1000);
            expect_recv_rc(p.srv, 0, RS_MSG_DONTWAIT, 0);
            CHECK_EQ(p.srv->err, 0);
            pair_close(&p);
        }
        /* EOF inside a header, seen by a blocking and by a nonblocking read: the end */
        for (int nb = 0; nb < 2; nb++) {
            if (rings) pre_pair_open(&p, 4096); else pre_tcp_open(&p);
            put_pre_hdr(h, RS_PRE_DATA, 10);
            raw_write(p.fd[1], h, 5);
            close_fd(&p, 1);
            ssize_t r = rs_recv(p.srv, buf, sizeof buf, nb ? RS_MSG_DONTWAIT : 0, nb ? 0 : 1000);
            CHECK(r == 0, "EOF after 5 header bytes (nonblocking %d): rs_recv returned %zd", nb, r);
            CHECK_EQ(p.srv->err, 0);
            pair_close(&p);
        }
        /* EOF at a frame boundary: end of stream, like TCP */
        for (int waitall = 0; waitall < 2; waitall++) {
            if (rings) pre_pair_open(&p, 4096); else pre_tcp_open(&p);
            raw_data_frame(p.fd[1], "xy");
            close_fd(&p, 1);
            expect_recv_str(p.srv, waitall ? 10 : 64, waitall ? RS_MSG_WAITALL : 0, 1000, "xy");
            expect_recv_rc(p.srv, 0, 0, 1000);
            expect_recv_rc(p.srv, 0, RS_MSG_DONTWAIT, 0);
            CHECK_EQ(p.srv->err, 0);
            pair_close(&p);
        }
        /* EOF before any frame */
        if (rings) pre_pair_open(&p, 4096); else pre_tcp_open(&p);
        close_fd(&p, 1);
        expect_recv_rc(p.srv, 0, 0, 1000);
        CHECK_EQ(p.srv->err, 0);
        pair_close(&p);
    }
}

struct pre_trickle { int fd; const uint8_t *b; size_t n; int ms; };

static void *pre_trickle_run(void *arg)
{
    struct pre_trickle *t = arg;
    sleep_ms(t->ms);
    raw_write(t->fd, t->b, t->n);
    return NULL;
}

/* A header or payload that has partly arrived: EAGAIN, not an error.  The header's first
 * bytes are taken off the socket at once (by a read, or by a readiness check): a kernel
 * whose receive buffer is full sends the rest only after a read, and bytes left there
 * would make every poll on the socket return at once. */
static void t_pre_partial(void)
{
    struct pair p;
    uint8_t frame[RS_PRE_HDR + 5];
    put_pre_hdr(frame, RS_PRE_DATA, 5);
    memcpy(frame + RS_PRE_HDR, "hello", 5);
    /* the header split at every offset */
    for (int k = 1; k < RS_PRE_HDR; k++) {
        pre_tcp_open(&p);
        raw_write(p.fd[1], frame, (size_t)k);
        expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
        CHECK(readable(p.fd[0], 0) == 0, "%d header bytes left on the socket by a read", k);
        expect_recv_rc(p.srv, -EAGAIN, 0, 0);
        expect_recv_rc(p.srv, -EAGAIN, RS_MSG_PEEK | RS_MSG_DONTWAIT, 0);
        if (k == 3) {
            double t0 = now_ms();
            expect_recv_rc(p.srv, -EAGAIN, 0, 50);              /* a timeout while it lasts */
            double el = now_ms() - t0;
            CHECK(el >= 40 && el < 1000, "timeout of 50 ms took %.0f ms", el);
        }
        CHECK_EQ(p.srv->err, 0);
        raw_write(p.fd[1], frame + k, sizeof frame - (size_t)k);
        expect_recv_str(p.srv, 64, 0, 1000, "hello");
        pair_close(&p);
    }
    /* ... and with rings, a readiness check takes them (a waiting hook then sleeps) */
    for (int k = 1; k < RS_PRE_HDR; k++) {
        pre_pair_open(&p, 4096);
        raw_write(p.fd[1], frame, (size_t)k);
        CHECK_EQ(rs_rx_ready(p.srv), 0);
        CHECK(readable(p.fd[0], 0) == 0, "%d header bytes left on the socket by a readiness check", k);
        CHECK_EQ(rs_rx_available(p.srv), 0);
        raw_write(p.fd[1], frame + k, sizeof frame - (size_t)k);
        CHECK_EQ(rs_rx_ready(p.srv), 1);
        CHECK_EQ(rs_rx_available(p.srv), 5);
        expect_recv_str(p.srv, 64, 0, 1000, "hello");
        CHECK_EQ(p.srv->err, 0);
        pair_close(&p);
    }
    /* a SWITCH in parts ends the preamble once whole, with the ring's records behind it */
    for (int k = 1; k < RS_PRE_HDR; k++) {
        pre_pair_open(&p, 4096);
        uint8_t sw[RS_PRE_HDR];
        put_pre_hdr(sw, RS_PRE_SWITCH, 0);
        raw_write(p.fd[1], sw, (size_t)k);
        CHECK_EQ(rs_pre_settle(p.srv), 0);
        raw_write(p.fd[1], sw + k, sizeof sw - (size_t)k);
        CHECK_EQ(rs_send(p.cli, "ring", 4, 0, 1000), 4);
        CHECK_EQ(rs_rx_ready(p.srv), 1);
        CHECK_EQ(p.srv->rx.pre.active, 0);
        expect_recv_str(p.srv, 64, 0, 1000, "ring");
        pair_close(&p);
    }
    /* a payload split: what is there, then EAGAIN, then the rest */
    pre_pair_open(&p, 4096);
    put_pre_hdr(frame, RS_PRE_DATA, 6);
    raw_write(p.fd[1], frame, RS_PRE_HDR);
    raw_str(p.fd[1], "ab");
    expect_recv_str(p.srv, 64, 0, 1000, "ab");
    expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
    expect_recv_rc(p.srv, -EAGAIN, 0, 20);
    CHECK_EQ(rs_rx_available(p.srv), 0);            /* like FIONREAD: only bytes already there */
    raw_str(p.fd[1], "cd");
    CHECK_EQ(rs_rx_available(p.srv), 2);
    raw_str(p.fd[1], "ef");
    expect_recv_str(p.srv, 4, RS_MSG_WAITALL, 1000, "cdef");
    pair_close(&p);
    /* a blocking read waits for the rest of a header */
    pre_pair_open(&p, 4096);
    put_pre_hdr(frame, RS_PRE_DATA, 4);
    memcpy(frame + RS_PRE_HDR, "late", 4);
    raw_write(p.fd[1], frame, 4);
    struct pre_trickle t = { p.fd[1], frame + 4, RS_PRE_HDR, 50 };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, pre_trickle_run, &t) == 0, "pthread_create");
    double t0 = now_ms();
    expect_recv_str(p.srv, 64, 0, 5000, "late");
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    CHECK(now_ms() - t0 >= 40, "returned before the header was complete");
    pair_close(&p);
}

/* Fills the socket fd (nonblocking sends of `byte`) until it takes nothing more; returns
 * the bytes that went in. */
static size_t fill_socket(int fd, uint8_t byte, size_t chunk)
{
    uint8_t junk[4096];
    CHECK(chunk <= sizeof junk, "chunk too large");
    memset(junk, byte, sizeof junk);
    size_t filled = 0;
    for (;;) {
        ssize_t r = send(fd, junk, chunk, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) {
            CHECK(errno == EAGAIN || errno == EWOULDBLOCK, "send: %s", strerror(errno));
            return filled;
        }
        filled += (size_t)r;
        CHECK(filled < (64u << 20), "socket never fills");
    }
}

/* Reads everything readable now from fd; checks every byte is `byte`; returns the count. */
static size_t drain_socket(int fd, uint8_t byte)
{
    uint8_t buf[4096];
    size_t total = 0;
    for (;;) {
        ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return total;
        for (ssize_t i = 0; i < r; i++)
            CHECK(buf[i] == byte, "byte %zu read back is 0x%02x, expected filler 0x%02x", total + (size_t)i, buf[i], byte);
        total += (size_t)r;
    }
}

/* rs_pre_send never starts a frame a full socket cannot take: nothing is written. */
static void t_pre_send_full(void)
{
    struct pair p;
    struct rs_pre_open o = { 0 };
    memset(&p, 0, sizeof p);
    pair_sockets(&p);
    static uint8_t big[100000];
    fill_pat(big, 93, 0, sizeof big);
    size_t filled = fill_socket(p.fd[1], 0xEE, 4096);
    CHECK_EQ(rs_pre_send(p.fd[1], "abc", 3, 1, 0, &o), -EAGAIN);
    CHECK_EQ(rs_pre_send(p.fd[1], big, sizeof big, 1, 0, &o), -EAGAIN);
    CHECK(!rs_pre_is_open(&o), "a frame of which nothing was written is open");
    double t0 = now_ms();
    CHECK_EQ(rs_pre_send(p.fd[1], "abc", 3, 0, 50, NULL), -EAGAIN);       /* blocking with a timeout */
    double el = now_ms() - t0;
    CHECK(el >= 40 && el < 1000, "timeout of 50 ms took %.0f ms", el);
    size_t got = drain_socket(p.fd[0], 0xEE);
    CHECK(got == filled, "the reader found %zu bytes, %zu were filler: a full socket took part of a frame", got, filled);
    /* with room again: a nonblocking send is one frame of at most 16384 bytes */
    ssize_t r = rs_pre_send(p.fd[1], big, sizeof big, 1, 0, &o);
    CHECK_EQ(r, RS_PRE_NONBLOCK_MAX);
    CHECK(!rs_pre_is_open(&o), "a frame written whole is open");
    uint8_t h[RS_PRE_HDR];
    static uint8_t back[RS_PRE_NONBLOCK_MAX];
    raw_read(p.fd[0], h, sizeof h, 1000);
    CHECK(h[0] == 0xDA && h[1] == 0 && h[2] == 0 && h[3] == 0 && h[4] == 0 && h[5] == 0 && h[6] == 0x40 && h[7] == 0,
          "header of a 16384-byte frame: %02x %02x %02x %02x %02x %02x %02x %02x", h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
    raw_read(p.fd[0], back, sizeof back, 1000);
    VERIFY_PAT(back, 93, 0, sizeof back);
    CHECK_EQ(readable(p.fd[0], 0), 0);
    /* a closed peer: an error, not a frame */
    close_fd(&p, 0);
    r = rs_pre_send(p.fd[1], "abc", 3, 0, -1, NULL);
    CHECK(r == -EPIPE || r == -ECONNRESET, "rs_pre_send to a closed peer returned %zd", r);
    CHECK(rs_pre_switch(p.fd[1]) < 0, "rs_pre_switch to a closed peer succeeded");
    pair_close(&p);
}

/* A nonblocking frame the socket takes in part stays open: the call returns the payload
 * taken and never waits; the next calls owe the frame's tail.  The reader, which takes a
 * little at a time, sees whole valid frames carrying every byte in order. */
static void t_pre_send_partial(void)
{
    struct pair p;
    struct rs_pre_open o = { 0 };
    memset(&p, 0, sizeof p);
    pair_sockets(&p);
    int small = 4096;
    CHECK(setsockopt(p.fd[1], SOL_SOCKET, SO_SNDBUF, &small, sizeof small) == 0, "SO_SNDBUF: %s", strerror(errno));
    static uint8_t big[200000], wire[300000];
    fill_pat(big, 96, 0, sizeof big);
    size_t sent = 0, got = 0;
    int in_part = 0;
    while (sent < sizeof big) {
        double t0 = now_ms();
        ssize_t r = rs_pre_send(p.fd[1], big + sent, sizeof big - sent, 1, 0, &o);
        CHECK(now_ms() - t0 < 200, "a nonblocking rs_pre_send took %.0f ms", now_ms() - t0);
        if (r > 0) {
            sent += (size_t)r;
            in_part += rs_pre_is_open(&o);
            continue;
        }
        CHECK(r == -EAGAIN, "rs_pre_send returned %zd (%s)", r, strerror((int)-r));
        ssize_t n = recv(p.fd[0], wire + got, 3000, MSG_DONTWAIT);
        if (n > 0) got += (size_t)n;
        CHECK(got < sizeof wire, "the frames take %zu bytes for %zu of payload", got, sent);
    }
    CHECK(!rs_pre_is_open(&o), "a frame is open after the last byte");
    CHECK(in_part > 0, "no frame was taken in part: nothing was tested");
    CHECK(shutdown(p.fd[1], SHUT_WR) == 0, "shutdown: %s", strerror(errno));
    for (;;) {
        ssize_t n = recv(p.fd[0], wire + got, sizeof wire - got, 0);
        CHECK(n >= 0, "recv: %s", strerror(errno));
        if (n == 0) break;
        got += (size_t)n;
    }
    size_t pos = 0, out = 0;
    while (pos < got) {
        CHECK(pos + RS_PRE_HDR <= got, "a header cut at %zu of %zu", pos, got);
        const uint8_t *h = wire + pos;
        uint32_t len = (uint32_t)h[4] << 24 | (uint32_t)h[5] << 16 | (uint32_t)h[6] << 8 | h[7];
        CHECK(h[0] == RS_PRE_DATA && !h[1] && !h[2] && !h[3] && len >= 1 && len <= RS_PRE_NONBLOCK_MAX,
              "frame at %zu: kind 0x%02x length %u", pos, h[0], len);
        CHECK(pos + RS_PRE_HDR + len <= got, "frame at %zu cut", pos);
        VERIFY_PAT(h + RS_PRE_HDR, 96, out, len);
        out += len;
        pos += RS_PRE_HDR + len;
    }
    CHECK_EQ(out, sizeof big);
    pair_close(&p);
}

/* ---- large preambles ---- */

#define PRE_LARGE (1u << 20)
#define PRE_MAX_CALLS 4096

struct pre_writer {
    int fd, nonblock;
    const uint8_t *src;
    size_t n;
    rs_conn *ring;              /* after SWITCH: this many ring bytes (stream 95) ... */
    size_t ring_n;
    const char *plain;          /* ... or these plain bytes */
    ssize_t sizes[PRE_MAX_CALLS];
    int calls;
    struct rs_pre_open open;    /* nonblocking: the frame a call left open */
};

static void *pre_writer_run(void *arg)
{
    struct pre_writer *w = arg;
    size_t off = 0;
    while (off < w->n) {
        ssize_t r = rs_pre_send(w->fd, w->src + off, w->n - off, w->nonblock, -1, w->nonblock ? &w->open : NULL);
        if (r == -EAGAIN && w->nonblock) {
            struct pollfd pf = { .fd = w->fd, .events = POLLOUT };
            poll(&pf, 1, 1000);
            continue;
        }
        size_t cap = w->nonblock ? RS_PRE_NONBLOCK_MAX : RS_PRE_MAX;
        CHECK(r > 0 && (size_t)r <= cap, "rs_pre_send(%zu bytes, nonblocking %d) returned %zd (%s)", w->n - off,
              w->nonblock, r, r < 0 ? strerror((int)-r) : "");
        CHECK(w->calls < PRE_MAX_CALLS, "too many calls");
        w->sizes[w->calls++] = r;
        off += (size_t)r;
    }
    pre_switch(w->fd);
    if (w->ring) {
        static uint8_t buf[65536];
        uint64_t pos = 0;
        while (pos < w->ring_n) {
            size_t k = w->ring_n - pos < sizeof buf ? (size_t)(w->ring_n - pos) : sizeof buf;
            fill_pat(buf, 95, pos, k);
            ssize_t r = rs_send(w->ring, buf, k, 0, 10000);
            CHECK(r > 0, "rs_send after SWITCH returned %zd", r);
            pos += (uint64_t)r;
        }
    }
    if (w->plain) raw_str(w->fd, w->plain);
    return NULL;
}

/* 1 MiB through rs_pre_send: at most 65536 bytes per call (16384 nonblocking), one frame
 * per call, and the frames reassemble exactly. */
static void t_pre_send_large(void)
{
    uint8_t *src = malloc(PRE_LARGE), *dst = malloc(PRE_LARGE + 8);
    CHECK(src && dst, "malloc");
    fill_pat(src, 94, 0, PRE_LARGE);
    struct pre_writer *w = calloc(1, sizeof *w);
    CHECK(w, "calloc");

    /* 1. blocking writer; the frames parsed by hand */
    struct pair p;
    memset(&p, 0, sizeof p);
    pair_sockets(&p);
    *w = (struct pre_writer){ .fd = p.fd[1], .src = src, .n = PRE_LARGE };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, pre_writer_run, w) == 0, "pthread_create");
    size_t pos = 0;
    int frames = 0;
    uint32_t lens[PRE_MAX_CALLS];
    for (;;) {
        uint8_t h[RS_PRE_HDR];
        raw_read(p.fd[0], h, sizeof h, 5000);
        uint32_t len = (uint32_t)h[4] << 24 | (uint32_t)h[5] << 16 | (uint32_t)h[6] << 8 | h[7];
        CHECK(h[1] == 0 && h[2] == 0 && h[3] == 0, "frame %d: bytes 1..3 not zero", frames);
        if (h[0] == RS_PRE_SWITCH) { CHECK_EQ(len, 0); break; }
        CHECK(h[0] == RS_PRE_DATA, "frame %d: kind 0x%02x", frames, h[0]);
        CHECK(len >= 1 && len <= RS_PRE_MAX && pos + len <= PRE_LARGE, "frame %d: length %u at %zu", frames, len, pos);
        raw_read(p.fd[0], dst + pos, len, 5000);
        CHECK(frames < PRE_MAX_CALLS, "too many frames");
        lens[frames++] = len;
        pos += len;
    }
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    CHECK_EQ(pos, PRE_LARGE);
    VERIFY_PAT(dst, 94, 0, PRE_LARGE);
    CHECK_EQ(frames, w->calls);
    for (int i = 0; i < frames; i++) CHECK(lens[i] == (uint32_t)w->sizes[i], "frame %d: %u bytes, call took %zd", i, lens[i], w->sizes[i]);
    CHECK_EQ(frames, PRE_LARGE / RS_PRE_MAX);
    CHECK_EQ(readable(p.fd[0], 0), 0);
    pair_close(&p);

    /* 2. nonblocking writer, then ring data; rs_recv with mixed sizes and flags */
    struct rng g = { 0x9E3779B97F4A7C15ull };
    for (int rings = 1; rings >= 0; rings--) {
        if (rings) pre_pair_open(&p, 65536); else pre_tcp_open(&p);
        size_t ring_n = rings ? 300000 : 0;
        *w = (struct pre_writer){ .fd = p.fd[1], .nonblock = 1, .src = src, .n = PRE_LARGE,
                                  .ring = rings ? p.cli : NULL, .ring_n = ring_n, .plain = rings ? NULL : "tail" };
        CHECK(pthread_create(&th, NULL, pre_writer_run, w) == 0, "pthread_create");
        size_t want = PRE_LARGE + (rings ? ring_n : 4);
        uint8_t *all = malloc(want);
        CHECK(all, "malloc");
        size_t got = 0;
        while (got < want) {
            size_t k = (size_t)rnd_range(&g, 1, 100000);
            if (k > want - got) k = want - got;
            int flags = rnd(&g) & 1 ? RS_MSG_WAITALL : 0;
            ssize_t r = rs_recv(p.srv, all + got, k, flags, 5000);
            CHECK(r > 0, "rs_recv(%zu, flags 0x%x) returned %zd after %zu of %zu bytes; errmsg \"%s\"", k, flags, r, got,
                  want, rs_conn_errmsg(p.srv));
            CHECK((size_t)r <= k, "rs_recv returned more than asked");
            if (flags & RS_MSG_WAITALL) CHECK((size_t)r == k, "MSG_WAITALL returned %zd of %zu", r, k);
            got += (size_t)r;
        }
        CHECK(pthread_join(th, NULL) == 0, "pthread_join");
        for (int i = 0; i < w->calls; i++) CHECK(w->sizes[i] <= (ssize_t)RS_PRE_NONBLOCK_MAX, "nonblocking call %d took %zd", i, w->sizes[i]);
        VERIFY_PAT(all, 94, 0, PRE_LARGE);
        if (rings) VERIFY_PAT(all + PRE_LARGE, 95, 0, ring_n);
        else CHECK(memcmp(all + PRE_LARGE, "tail", 4) == 0, "plain bytes after SWITCH");
        CHECK_EQ(p.srv->rx.pre.active, 0);
        expect_recv_rc(p.srv, -EAGAIN, RS_MSG_DONTWAIT, 0);
        free(all);
        pair_close(&p);
    }
    free(w);
    free(src);
    free(dst);
}

/* ---- known shim bugs (tests/test_ring_c.py KNOWN_SHIM_BUGS) ---- */

/* rs_pre_switch on a nonblocking socket (Python sockets with a timeout, or nonblocking,
 * are O_NONBLOCK) whose send buffer is full of preamble the server has not read yet:
 * send_frame's first sendmsg returns EAGAIN with nothing sent and rs_pre_switch returns
 * -EAGAIN.  api.py ignores the result ("failure shows later"), so the SWITCH is lost: the
 * client's doorbells follow its last DATA frame and the server fails with "garbage
 * preamble frame (kind 0xd7 ...)".  A frame must be written whole, here: wait for room. */
static void *drain_later_run(void *arg)
{
    int fd = *(int *)arg;
    sleep_ms(100);
    uint8_t buf[4096];
    for (;;) {
        if (readable(fd, 1000) != 1) return NULL;
        ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (r <= 0 && !(r < 0 && (errno == EAGAIN || errno == EINTR))) return NULL;
    }
}

static void t_pre_switch_full_nonblocking(void)
{
    struct pair p;
    memset(&p, 0, sizeof p);
    pair_sockets(&p);
    int fl = fcntl(p.fd[1], F_GETFL);
    CHECK(fl >= 0 && fcntl(p.fd[1], F_SETFL, fl | O_NONBLOCK) == 0, "fcntl: %s", strerror(errno));
    uint8_t h[RS_PRE_HDR];
    put_pre_hdr(h, RS_PRE_DATA, 4096);
    static uint8_t frame[RS_PRE_HDR + 4096];
    memcpy(frame, h, sizeof h);
    for (;;) {                         /* whole DATA frames until the socket is full */
        ssize_t r = send(p.fd[1], frame, sizeof frame, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) break;
        CHECK(r == (ssize_t)sizeof frame, "short send while filling");
    }
    pthread_t th;
    CHECK(pthread_create(&th, NULL, drain_later_run, &p.fd[0]) == 0, "pthread_create");
    int r = rs_pre_switch(p.fd[1]);
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    CHECK(r == 0, "rs_pre_switch on a full nonblocking socket returned %d (%s): the SWITCH frame was not sent "
          "(api.py ignores this result, so the server later reads doorbell bytes as a frame header)", r, strerror(-r));
    pair_close(&p);
}

/* Tiny preamble DATA frames ('p', one socket buffer each) until the client's socket fd
 * is full; returns how many. */
static int fill_with_preamble(int fd)
{
    uint8_t frame[RS_PRE_HDR + 1];
    put_pre_hdr(frame, RS_PRE_DATA, 1);
    frame[RS_PRE_HDR] = 'p';
    int n = 0;
    for (;; n++) {
        ssize_t r = send(fd, frame, sizeof frame, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r < 0) { CHECK(errno == EAGAIN, "send: %s", strerror(errno)); break; }
        CHECK(r == (ssize_t)sizeof frame, "short send");
        CHECK(n < 1000000, "socket never fills");
    }
    return n;
}

/* The client's first doorbell goes out right after SWITCH, while its TCP socket may still
 * be full of preamble the server has not read: send_bell gets EAGAIN, takes the counter
 * back, but leaves want_bell at 0.  No doorbell is pending and none will be sent (the
 * producer believes one is), so once the server has read the preamble and the first
 * record, a new record arrives with the socket not readable: a server in select/epoll
 * never wakes up (the invariant of docs/PROTOCOL.md 6.7 is broken).  The client's send
 * runs in a thread, so a fix that waits for room for the doorbell passes too. */
static void *send_x_run(void *arg)
{
    send_str(arg, "x");
    return NULL;
}

static void t_pre_bell_behind_full_preamble(void)
{
    struct pair p;
    pre_pair_open(&p, 4096);
    int n = fill_with_preamble(p.fd[1]);
    /* the server reads one frame: room for the SWITCH, none left after it */
    expect_recv_str(p.srv, 64, 0, 1000, "p");
    n--;
    pre_switch(p.fd[1]);
    struct pollfd pf = { .fd = p.fd[1], .events = POLLOUT };
    CHECK(poll(&pf, 1, 0) == 0, "set-up: the client's socket should be full after the SWITCH");
    pthread_t th;
    CHECK(pthread_create(&th, NULL, send_x_run, p.cli) == 0, "pthread_create");
    sleep_ms(50);
    /* the server reads the whole preamble and the record */
    static char buf[1 << 20];
    CHECK((size_t)n + 1 <= sizeof buf, "too many frames");
    ssize_t r = rs_recv(p.srv, buf, (size_t)n + 1, RS_MSG_WAITALL, 5000);
    CHECK(r == n + 1 && buf[n] == 'x', "reading the preamble and the record returned %zd; errmsg \"%s\"", r, rs_conn_errmsg(p.srv));
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    /* a new record while nobody is inside recv: the socket must be readable */
    send_str(p.cli, "y");
    int pr = readable(p.fd[0], 200);
    CHECK(pr == 1, "a record is unconsumed and nobody is in recv, but the socket is not readable (poll -> %d; client "
          "data_bells %llu, want_bell %u): the doorbell that hit a full socket was dropped and never resent", pr,
          (unsigned long long)p.cli->tx.ctl->data_bells, p.cli->tx.ctl->want_bell);
    expect_str(p.srv, "y");
    pair_close(&p);
}

/* A lazy client whose preamble filled its socket (the server has not read it yet) and
 * that then reads: its SWITCH has no room.  The read must not wait for room (the server
 * may read nothing until it has our reply): it takes what the ring has, keeps its timeout
 * when there is nothing, and the SWITCH goes out at a later call once there is room, so
 * the server then reads the client's records. */
static void t_lazy_switch_behind_full_preamble(void)
{
    struct pair p;
    pre_pair_open(&p, 4096);
    p.srv->rx.pre.lazy = 1;
    rs_pre_switch_later(p.cli);
    int n = fill_with_preamble(p.fd[1]);
    send_str(p.srv, "hello");                         /* the server writes before it reads */
    char buf[64];
    double t0 = now_ms();
    ssize_t r = rs_recv(p.cli, buf, sizeof buf, 0, 2000);
    double dt = now_ms() - t0;
    CHECK(r == 5 && !memcmp(buf, "hello", 5) && dt < 1000, "the client's read returned %zd after %.0f ms; "
          "errmsg \"%s\"", r, dt, rs_conn_errmsg(p.cli));
    t0 = now_ms();
    r = rs_recv(p.cli, buf, sizeof buf, 0, 200);
    dt = now_ms() - t0;
    CHECK(r == -EAGAIN && dt >= 150 && dt < 1000, "a read with a 200 ms timeout and nothing to read returned %zd "
          "after %.0f ms", r, dt);
    CHECK(p.cli->switch_due == 1, "set-up: the SWITCH should still be due (switch_due %d)", p.cli->switch_due);
    /* the server reads the whole preamble; then the client's next write carries the SWITCH */
    static char pre[1 << 20];
    CHECK((size_t)n <= sizeof pre, "too many frames");
    r = rs_recv(p.srv, pre, (size_t)n, RS_MSG_WAITALL, 5000);
    CHECK(r == n, "the server read %zd of %d preamble bytes; errmsg \"%s\"", r, n, rs_conn_errmsg(p.srv));
    send_str(p.cli, "x");
    CHECK(p.cli->switch_due == 0, "the SWITCH did not go out with the first write after room came");
    expect_str(p.srv, "x");
    pair_close(&p);
}

/* A lazy client's SWITCH against the server's close (PROTOCOL 2.10).  A SWITCH that
 * reached the closed socket would be answered with a reset, which throws away what the
 * server's socket still holds for the client.  Told that the server closes, the client
 * sends none; a SWITCH the client announced is waited for (20 ms at most) and read off. */
static void t_lazy_switch_after_server_close(void)
{
    struct pair p;
    pre_pair_open(&p, 4096);
    p.srv->rx.pre.lazy = 1;
    rs_pre_switch_later(p.cli);
    double t0 = now_ms();
    rs_quiesce_bells(p.srv);                          /* the server's close, before any SWITCH */
    CHECK(now_ms() - t0 < 15, "the close waited %.0f ms for a SWITCH nobody announced", now_ms() - t0);
    CHECK_EQ(p.cli->tx.ctl->closing, 1);
    CHECK_EQ(rs_tx_switch_now(p.cli), 1);
    CHECK(p.cli->switch_due == 0 && p.cli->switch_sent == 0 && p.cli->tx.ctl->switching == 2,
          "the client should give its SWITCH up (due %d, sent %d, switching %u)", p.cli->switch_due,
          p.cli->switch_sent, p.cli->tx.ctl->switching);
    CHECK(readable(p.fd[0], 0) == 0, "a byte reached the server's socket after its close");
    pair_close(&p);

    /* The client announced its SWITCH before it could see the close: the close reads it. */
    pre_pair_open(&p, 4096);
    p.srv->rx.pre.lazy = 1;
    rs_pre_switch_later(p.cli);
    __atomic_store_n(&p.cli->tx.ctl->switching, 1, __ATOMIC_SEQ_CST);
    CHECK_EQ(rs_pre_switch(p.fd[1]), 0);              /* it is on its way */
    rs_quiesce_bells(p.srv);
    CHECK(!p.srv->rx.pre.active, "the close did not read the SWITCH that was on its way");
    CHECK(readable(p.fd[0], 0) == 0, "the SWITCH stayed unread on the server's socket");
    pair_close(&p);

    /* Announced, but it never comes (a client that stopped in between): the close waits
     * for it no longer than 20 ms. */
    pre_pair_open(&p, 4096);
    p.srv->rx.pre.lazy = 1;
    __atomic_store_n(&p.cli->tx.ctl->switching, 1, __ATOMIC_SEQ_CST);
    t0 = now_ms();
    rs_quiesce_bells(p.srv);
    double dt = now_ms() - t0;
    CHECK(dt >= 15 && dt < 500, "the close waited %.0f ms for an announced SWITCH (20 ms expected)", dt);
    pair_close(&p);
}

/* A signal while rs_pre_send waits to finish a frame it has started: write_rest's
 * wait_event returns -EINTR and write_rest turns it into -EIO, leaving half a frame on
 * the stream.  The caller gets EIO for bytes the server will partly receive, and the
 * next frame's header lands inside this frame's payload (silent corruption on the
 * server).  write_rest should retry on EINTR. */
static void on_usr1(int sig) { (void)sig; }

struct pre_sig { int fd; const uint8_t *b; size_t n; ssize_t r; volatile int done; };

static void *pre_sig_run(void *arg)
{
    struct pre_sig *s = arg;
    s->r = rs_pre_send(s->fd, s->b, s->n, 0, -1, NULL);
    __atomic_store_n(&s->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void t_pre_send_signal(void)
{
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;                                   /* no SA_RESTART */
    sigemptyset(&sa.sa_mask);
    CHECK(sigaction(SIGUSR1, &sa, &old) == 0, "sigaction");
    struct pair p;
    memset(&p, 0, sizeof p);
    pair_sockets(&p);
    int sb = 4096;
    CHECK(setsockopt(p.fd[1], SOL_SOCKET, SO_SNDBUF, &sb, sizeof sb) == 0, "SO_SNDBUF");
    static uint8_t big[RS_PRE_MAX];
    fill_pat(big, 96, 0, sizeof big);
    struct pre_sig s = { .fd = p.fd[1], .b = big, .n = sizeof big };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, pre_sig_run, &s) == 0, "pthread_create");
    for (int i = 0; i < 5 && !__atomic_load_n(&s.done, __ATOMIC_ACQUIRE); i++) {
        sleep_ms(30);
        pthread_kill(th, SIGUSR1);
    }
    /* now read: the whole frame must arrive, and the call must have taken all of it */
    static uint8_t got[RS_PRE_HDR + RS_PRE_MAX];
    size_t n = 0;
    while (n < sizeof got) {
        if (readable(p.fd[0], 500) != 1) break;
        ssize_t r = recv(p.fd[0], got + n, sizeof got - n, MSG_DONTWAIT);
        if (r > 0) n += (size_t)r;
    }
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    sigaction(SIGUSR1, &old, NULL);
    CHECK(s.r == RS_PRE_MAX, "rs_pre_send interrupted by signals returned %zd (%s) after %zu frame bytes left: "
          "half a frame is on the stream", s.r, s.r < 0 ? strerror((int)-s.r) : "", n);
    CHECK_EQ(n, sizeof got);
    VERIFY_PAT(got + RS_PRE_HDR, 96, 0, RS_PRE_MAX);
    pair_close(&p);
}

/* An untimed sleep on a socket (the preamble, a connection on TCP) ends on a signal by
 * that signal's own handler, as the kernel's recv would: restarted after SA_RESTART even
 * while another caught signal lacks it, EINTR without it even while another has it, and
 * not at all for a signal whose default action ignores it.  The program's mask is back
 * afterwards. */
static volatile sig_atomic_t g_sig_seen;
static void on_sig_count(int sig) { (void)sig; g_sig_seen++; }

struct sig_after { pthread_t target; int sig; };
static void *sig_after_run(void *arg)
{
    struct sig_after *a = arg;
    sleep_ms(50);
    pthread_kill(a->target, a->sig);
    return NULL;
}

static int sleep_with_signal(int fd, int sig, double *ms)
{
    struct sig_after a = { pthread_self(), sig };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, sig_after_run, &a) == 0, "pthread_create");
    double t0 = now_ms();
    int r = rs_sleep_fd(fd, POLLIN, RS_NEVER);
    *ms = now_ms() - t0;
    CHECK(pthread_join(th, NULL) == 0, "pthread_join");
    return r;
}

static void t_sleep_signal_rules(void)
{
    struct sigaction restart, plain, old1, old2;
    memset(&restart, 0, sizeof restart);
    restart.sa_handler = on_sig_count;
    restart.sa_flags = SA_RESTART;
    sigemptyset(&restart.sa_mask);
    plain = restart;
    plain.sa_flags = 0;
    sigset_t before, after;
    pthread_sigmask(SIG_SETMASK, NULL, &before);
    struct pair p;
    memset(&p, 0, sizeof p);
    pair_sockets(&p);
    double ms;

    CHECK(sigaction(SIGUSR1, &restart, &old1) == 0 && sigaction(SIGUSR2, &plain, &old2) == 0, "sigaction");
    g_sig_seen = 0;
    int r = sleep_with_signal(p.fd[0], SIGUSR1, &ms);
    CHECK(r == 1 && g_sig_seen == 1, "SA_RESTART handler (another caught signal without it): rs_sleep_fd "
          "returned %d after %.0f ms, handler ran %d time(s); want 1 (restart)", r, ms, (int)g_sig_seen);

    sigaction(SIGUSR1, &plain, NULL);
    sigaction(SIGUSR2, &restart, NULL);
    g_sig_seen = 0;
    r = sleep_with_signal(p.fd[0], SIGUSR1, &ms);
    CHECK(r == -EINTR && g_sig_seen == 1 && ms < 900, "handler without SA_RESTART (another with it): rs_sleep_fd "
          "returned %d after %.0f ms, handler ran %d time(s); want -EINTR at once", r, ms, (int)g_sig_seen);

    r = sleep_with_signal(p.fd[0], SIGWINCH, &ms);            /* default action: ignore */
    CHECK(r == 1, "a default-ignored signal: rs_sleep_fd returned %d after %.0f ms; want 1", r, ms);

    pthread_sigmask(SIG_SETMASK, NULL, &after);
    int same = 1;
    for (int sig = 1; sig < NSIG; sig++)
        if (sigismember(&before, sig) != sigismember(&after, sig)) same = 0;
    CHECK(same, "the signal mask changed across rs_sleep_fd");
    sigaction(SIGUSR1, &old1, NULL);
    sigaction(SIGUSR2, &old2, NULL);
    pair_close(&p);
}

/* ---- main -------------------------------------------------------------------------- */

/* The ring memory budget: mapping takes from it, freeing gives back, and a mapping that
 * would go over it fails with ENOBUFS and takes nothing. */
static void t_ring_memory_budget(void)
{
    uint64_t before = rs_ring_memory_in_use(), max = rs_ring_memory_max();
    struct pair p;
    pair_open(&p, 4096, 0);
    CHECK_EQ(rs_ring_memory_in_use() - before, 2 * (uint64_t)(RS_SEG_HDR_SIZE + 2 * 4096));
    pair_close(&p);
    CHECK_EQ(rs_ring_memory_in_use(), before);

    size_t len = 0;
    int memfd = rs_shm_create(4096, 7, &len);
    CHECK(memfd >= 0, "rs_shm_create: %s", strerror(-memfd));
    uint64_t rest = max - before;
    CHECK(rs_ring_memory_reserve(rest) == 0, "reserving the rest of the budget");
    CHECK(rs_ring_memory_reserve(1) == -ENOBUFS, "one byte over the budget");
    struct rs_seg seg;
    CHECK_EQ(rs_shm_map(memfd, &seg, 0), -ENOBUFS);
    CHECK_EQ(rs_ring_memory_in_use(), max);
    rs_ring_memory_release(rest);
    /* bytes reserved ahead (the client's way) are used up by the mapping, not counted twice */
    CHECK(rs_ring_memory_reserve(len) == 0, "reserve ahead");
    CHECK_EQ(rs_shm_map(memfd, &seg, len), 0);
    CHECK_EQ(rs_ring_memory_in_use(), before + len);
    close(memfd);
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, "socketpair");
    rs_conn *c = rs_conn_attach_shm(&seg, sv[0], 1, 0);
    CHECK(c, "rs_conn_attach_shm");
    rs_conn_free(c);
    CHECK_EQ(rs_ring_memory_in_use(), before);
    close(sv[0]);
    close(sv[1]);
}


/* ---- wake-ups through the shared word (FUTEX_WAKE, PROTOCOL 6.11) ------------------------ */

static void pair_open_words(struct pair *p)
{
    pair_open(p, 1 << 16, 0);                  /* no spinning: every wait for data sleeps */
    p->srv->word_wake_ok = p->cli->word_wake_ok = 1;
    p->srv->rx.lazy_tidy = p->cli->rx.lazy_tidy = 1;   /* as under the preload library */
}

struct word_echo { rs_conn *c; int rounds; };
static void *word_echo_run(void *arg)
{
    struct word_echo *e = arg;
    uint8_t buf[64];
    for (int i = 0; i < e->rounds; i++) {
        recv_exact(e->c, buf, sizeof buf, 10000);
        send_all_nb(e->c, buf, sizeof buf);
    }
    return NULL;
}

static void word_pingpong(struct pair *p, int rounds)
{
    pthread_t th;
    struct word_echo e = { p->srv, rounds };
    CHECK(pthread_create(&th, NULL, word_echo_run, &e) == 0, "pthread_create");
    uint8_t out[64], in[64];
    for (int i = 0; i < rounds; i++) {
        memset(out, (int)(i * 7 + 1), sizeof out);
        send_all_nb(p->cli, out, sizeof out);
        recv_exact(p->cli, in, sizeof in, 10000);
        CHECK(memcmp(in, out, sizeof in) == 0, "round %d: wrong echo", i);
    }
    pthread_join(th, NULL);
}

/* Both ends speak FUTEX_WAKE: 20,000 round trips with every wait asleep on the word.  No
 * doorbell byte is sent after the first, and no sleep ran out its window: a wake-up lost between a
 * receiver's arming and its sleep would have left it asleep until the window ended. */
static void t_word_wake(void)
{
    struct pair p;
    pair_open_words(&p);
    word_pingpong(&p, 20000);
    uint64_t sleeps = p.srv->rx.word_sleeps + p.cli->rx.word_sleeps;
    CHECK(sleeps > 0, "no receive slept on the word");
    CHECK_EQ(p.srv->rx.word_timeouts + p.cli->rx.word_timeouts, 0);
    /* only each direction's first record rings: a new segment asks for that doorbell */
    CHECK(__atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED) <= 1 && __atomic_load_n(&p.cli->bells_sent, __ATOMIC_RELAXED) <= 1,
          "doorbell bytes sent: %llu by the server, %llu by the client", (unsigned long long)p.srv->bells_sent,
          (unsigned long long)p.cli->bells_sent);
    CHECK_EQ(p.srv->rx.sleeps + p.cli->rx.sleeps, 0);
    pair_close(&p);
}

/* One end without the feature (an older peer, or RDMASOCK_WORD_WAKE=0 anywhere: the
 * handshake then agrees on none): its waits sleep on the socket and are rung there. */
static void t_word_wake_one_sided(void)
{
    struct pair p;
    pair_open_words(&p);
    p.cli->word_wake_ok = 0;
    word_pingpong(&p, 2000);
    CHECK_EQ(p.cli->rx.word_sleeps, 0);
    CHECK(__atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED) > 0, "the server never rang the client");
    CHECK_EQ(p.srv->rx.word_timeouts, 0);
    pair_close(&p);
}

struct word_blocked { rs_conn *c; ssize_t r; double ms; volatile int done; };
static void *word_blocked_run(void *arg)
{
    struct word_blocked *b = arg;
    uint8_t buf[64];
    double t0 = now_ms();
    b->r = rs_recv(b->c, buf, sizeof buf, 0, -1);
    b->ms = now_ms() - t0;
    b->done = 1;
    return NULL;
}

/* A pair whose client has a thread blocked in an untimed recv, asleep on the word. */
static void blocked_on_word(struct pair *p, struct word_blocked *b, pthread_t *th)
{
    pair_open_words(p);
    *b = (struct word_blocked){ p->cli, -1, 0, 0 };
    CHECK(pthread_create(th, NULL, word_blocked_run, b) == 0, "pthread_create");
    rs_conn *c = p->cli;
    for (int i = 0; i < 2000 && !__atomic_load_n(&c->rx.word_sleeps, __ATOMIC_RELAXED); i++) sleep_ms(1);
    CHECK(__atomic_load_n(&c->rx.word_sleeps, __ATOMIC_RELAXED) > 0, "the receive never slept on the word");
    sleep_ms(5);
}

/* The blocked recv returns within 5 s; its result. */
static ssize_t blocked_result(struct word_blocked *b, pthread_t th, const char *what)
{
    for (int i = 0; i < 5000 && !b->done; i++) sleep_ms(1);
    CHECK(b->done, "recv still asleep 5 s after %s", what);
    pthread_join(th, NULL);
    return b->r;
}

/* The peer dies while we sleep on the word: nothing raises it, the kernel only closes the
 * peer's socket.  The window ends the word sleep and the socket says the peer is gone:
 * an untimed recv returns the end of the stream, as over TCP. */
static void t_word_peer_death(void)
{
    struct pair p;
    struct word_blocked b;
    pthread_t th;
    blocked_on_word(&p, &b, &th);
    close_fd(&p, 0);                          /* the server process "dies": no FIN record */
    CHECK_EQ(blocked_result(&b, th, "the peer died"), 0);
    pair_close(&p);
}

/* shutdown(SHUT_RD) in another thread wakes a recv asleep on the word at once, not at
 * the end of its window: a TCP recv returns 0 then. */
static void t_word_shutdown_rd(void)
{
    struct pair p;
    struct word_blocked b;
    pthread_t th;
    blocked_on_word(&p, &b, &th);
    rs_shutdown_rd(p.cli);
    CHECK_EQ(blocked_result(&b, th, "shutdown(SHUT_RD)"), 0);
    CHECK_EQ(p.cli->rx.word_timeouts, 0);
    pair_close(&p);
}

/* A peer that raises the word without writing (hostile, or a stray wake-up) only makes the
 * receive look again: it goes back to sleep and takes the record that comes later. */
static void t_word_spurious(void)
{
    struct pair p;
    struct word_blocked b;
    pthread_t th;
    blocked_on_word(&p, &b, &th);
    for (int i = 0; i < 100; i++) rs_word_raise(&p.cli->rx.ctl->data_seq);
    sleep_ms(20);
    CHECK(!b.done, "a raised word with no record ended the recv");
    send_str(p.srv, "late");
    CHECK_EQ(blocked_result(&b, th, "the record came"), 4);
    pair_close(&p);
}

/* ---- quiet wake-ups (QUIET_WAKE, PROTOCOL 6.13) ----------------------------------------- */

/* A pair as the Python API has it: its program may wait for the descriptor in the kernel
 * (not lazy_tidy), both ends speak FUTEX_WAKE and QUIET_WAKE. */
static void pair_open_quiet(struct pair *p)
{
    pair_open_words(p);
    p->srv->rx.lazy_tidy = p->cli->rx.lazy_tidy = 0;
    p->srv->quiet_wake_ok = p->cli->quiet_wake_ok = 1;
    send_str(p->srv, "warm");                 /* a new segment asks for one byte: spend it */
    expect_str(p->cli, "warm");
}

struct quiet_recv { rs_conn *c; size_t room; int timeout_ms; ssize_t r; uint8_t buf[256]; volatile int done; };
static void *quiet_recv_run(void *arg)
{
    struct quiet_recv *q = arg;
    q->r = rs_recv(q->c, q->buf, q->room, 0, q->timeout_ms);
    q->done = 1;
    return NULL;
}

/* A client thread in a blocking recv of `room` bytes, asleep on the word. */
static void quiet_sleeper(struct pair *p, struct quiet_recv *q, pthread_t *th, size_t room, int timeout_ms)
{
    uint64_t sleeps = __atomic_load_n(&p->cli->rx.word_sleeps, __ATOMIC_RELAXED);
    *q = (struct quiet_recv){ .c = p->cli, .room = room, .timeout_ms = timeout_ms, .r = -1 };
    CHECK(pthread_create(th, NULL, quiet_recv_run, q) == 0, "pthread_create");
    for (int i = 0; i < 2000 && __atomic_load_n(&p->cli->rx.word_sleeps, __ATOMIC_RELAXED) == sleeps; i++) sleep_ms(1);
    CHECK(__atomic_load_n(&p->cli->rx.word_sleeps, __ATOMIC_RELAXED) > sleeps, "the receive never slept on the word");
    CHECK(p->cli->rx.ctl->want_bell & RS_WANT_QUIET, "asleep without asking quietly: want_bell %u", p->cli->rx.ctl->want_bell);
    CHECK(!(p->cli->rx.ctl->want_bell & RS_WANT_NEXT), "asleep quietly, a byte still asked for");
}

static ssize_t quiet_result(struct quiet_recv *q, pthread_t th)
{
    for (int i = 0; i < 5000 && !q->done; i++) sleep_ms(1);
    CHECK(q->done, "recv still asleep after 5 s");
    pthread_join(th, NULL);
    return q->r;
}

/* 1 if the client's socket is readable within ms (a doorbell byte is there). */
static int cli_readable(struct pair *p, int ms)
{
    struct pollfd pf = { p->fd[1], POLLIN, 0 };
    return poll(&pf, 1, ms) == 1 && (pf.revents & POLLIN);
}

/* A record the sleeping receive takes whole wakes it through the word alone: no byte.
 * Once the receive returns its program may poll the descriptor, so the next record rings
 * (PROTOCOL 6.7), and a record while it sleeps again is quiet again. */
static void t_quiet_wake(void)
{
    struct pair p;
    pair_open_quiet(&p);
    for (int round = 0; round < 3; round++) {
        struct quiet_recv q;
        pthread_t th;
        quiet_sleeper(&p, &q, &th, 64, -1);
        uint64_t bells = __atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED);
        send_str(p.srv, "quiet");
        CHECK_EQ(quiet_result(&q, th), 5);
        CHECK(memcmp(q.buf, "quiet", 5) == 0, "wrong bytes");
        CHECK_EQ(__atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED), bells);
        CHECK(!cli_readable(&p, 0), "a stale byte on the socket");
        CHECK(p.cli->rx.ctl->want_bell & RS_WANT_NEXT, "out of recv, no byte asked for: want_bell %u",
              p.cli->rx.ctl->want_bell);
        CHECK(!(p.cli->rx.ctl->want_bell & RS_WANT_QUIET), "quiet request outlived the receive");
        send_str(p.srv, "loud");
        CHECK_EQ(__atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED), bells + 1);
        CHECK(cli_readable(&p, 1000), "a record while out of recv did not make the socket readable");
        expect_str(p.cli, "loud");
        CHECK(!cli_readable(&p, 0), "its byte was not read off");
    }
    pair_close(&p);
}

/* More than the sleeping receive takes: the producer rings a byte as well, so that what the
 * receive leaves in the ring keeps the socket readable. */
static void t_quiet_wake_more_than_room(void)
{
    struct pair p;
    pair_open_quiet(&p);
    struct quiet_recv q;
    pthread_t th;
    quiet_sleeper(&p, &q, &th, 16, -1);
    uint64_t bells = __atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED);
    send_str(p.srv, "0123456789abcdefghijklmnopqrstuvwxyzABCD");
    CHECK_EQ(quiet_result(&q, th), 16);
    CHECK_EQ(__atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED), bells + 1);
    CHECK(cli_readable(&p, 0), "24 bytes left in the ring, socket not readable");
    expect_str(p.cli, "ghijklmnopqrstuvwxyzABCD");
    CHECK(!cli_readable(&p, 0), "its byte was not read off");
    pair_close(&p);
}

/* A timed receive that nothing wakes withdraws its quiet request: the record that comes
 * after it gave up rings, and the socket tells the program. */
static void t_quiet_wake_timeout(void)
{
    struct pair p;
    pair_open_quiet(&p);
    struct quiet_recv q;
    pthread_t th;
    quiet_sleeper(&p, &q, &th, 64, 30);
    CHECK_EQ(quiet_result(&q, th), -EAGAIN);
    CHECK(!(p.cli->rx.ctl->want_bell & (RS_WANT_QUIET | RS_WANT_FUTEX)), "request outlived the receive: want_bell %u",
          p.cli->rx.ctl->want_bell);
    send_str(p.srv, "after");
    CHECK(cli_readable(&p, 1000), "the record after the timeout did not make the socket readable");
    expect_str(p.cli, "after");
    pair_close(&p);
}

/* Two threads asleep quietly: the record wakes both, one takes it, the other sleeps
 * again; the request stays while either sleeps, and once both are out, records ring. */
static void t_quiet_wake_two_sleepers(void)
{
    struct pair p;
    pair_open_quiet(&p);
    struct quiet_recv a, b;
    pthread_t ta, tb;
    quiet_sleeper(&p, &a, &ta, 64, -1);
    quiet_sleeper(&p, &b, &tb, 8, -1);
    CHECK_EQ(p.cli->rx.ctl->quiet_limit, p.cli->rx.bytes + 8);
    uint64_t bells = __atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED);
    send_str(p.srv, "one");
    for (int i = 0; i < 5000 && !a.done && !b.done; i++) sleep_ms(1);
    CHECK(a.done != b.done, "one receive should have the record");
    CHECK_EQ(__atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED), bells);
    /* the other one went round and is asleep quietly again (in between it asks for a byte) */
    for (int i = 0; i < 2000 && !(__atomic_load_n(&p.cli->rx.ctl->want_bell, __ATOMIC_SEQ_CST) & RS_WANT_QUIET); i++)
        sleep_ms(1);
    CHECK(p.cli->rx.ctl->want_bell & RS_WANT_QUIET, "the other receive did not sleep again");
    send_str(p.srv, "two");
    CHECK_EQ(quiet_result(&a, ta), 3);
    CHECK_EQ(quiet_result(&b, tb), 3);
    CHECK_EQ(__atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED), bells);
    CHECK(p.cli->rx.ctl->want_bell & RS_WANT_NEXT, "both out, no byte asked for");
    CHECK_EQ(p.cli->rx.quiet_sleepers, 0);
    pair_close(&p);
}

/* One end without QUIET_WAKE (an older peer): its receives keep asking for bytes. */
static void t_quiet_wake_one_sided(void)
{
    struct pair p;
    pair_open_quiet(&p);
    p.cli->quiet_wake_ok = 0;
    struct word_blocked b;
    pthread_t th;
    b = (struct word_blocked){ p.cli, -1, 0, 0 };
    uint64_t sleeps = p.cli->rx.word_sleeps;
    CHECK(pthread_create(&th, NULL, word_blocked_run, &b) == 0, "pthread_create");
    for (int i = 0; i < 2000 && p.cli->rx.word_sleeps == sleeps; i++) sleep_ms(1);
    CHECK(!(p.cli->rx.ctl->want_bell & RS_WANT_QUIET), "asked quietly without the feature");
    uint64_t bells = __atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED);
    send_str(p.srv, "old");
    CHECK_EQ(blocked_result(&b, th, "the record came"), 3);
    CHECK_EQ(__atomic_load_n(&p.srv->bells_sent, __ATOMIC_RELAXED), bells + 1);
    pair_close(&p);
}

/* ---- spinning on a busy machine ------------------------------------------------------ */

static volatile int hog_stop;
static int hog_cpu = -1;           /* where the hogs run: -1 anywhere */
static void *hog_run(void *arg)
{
    (void)arg;
    while (!hog_stop) rs_relax();
    return NULL;
}

/* Spins in this thread for about a second while n hogs run, asking rs_cpus_busy every
 * 11 ms: how often it said busy, out of how many looks (after the first skip_ms, whose
 * answers are not counted), and what rs_spin_allow gave. */
static double thread_cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* The time this thread has waited on a run queue (ns; the kernel's own count). */
static uint64_t thread_wait_ns(void)
{
    char buf[96];
    FILE *f = fopen("/proc/thread-self/schedstat", "r");
    if (!f) return 0;
    unsigned long long run = 0, wait = 0;
    if (!fgets(buf, sizeof buf, f) || sscanf(buf, "%llu %llu", &run, &wait) != 2) wait = 0;
    fclose(f);
    return wait;
}

/* *share: the part of the time this thread ran (1: it had its CPU to itself).  *excused:
 * busy answers given within 600 ms (a busy answer holds for 500) of an 11 ms stretch in
 * which this thread did wait for its CPU, more than 1 ms: another task (a kernel worker,
 * another program) ran there, and "busy" was the truth. */
static int busy_looks(int n, int skip_ms, int *looks, uint64_t *allowed, double *share, int *excused)
{
    pthread_t th[64];
    hog_stop = 0;
    /* pinned from their start: a hog that pinned itself first ran where its creator runs */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    if (hog_cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(hog_cpu, &set);
        CHECK(pthread_attr_setaffinity_np(&attr, sizeof set, &set) == 0, "pthread_attr_setaffinity_np");
    }
    for (int i = 0; i < n; i++) CHECK(pthread_create(&th[i], &attr, hog_run, NULL) == 0, "pthread_create");
    pthread_attr_destroy(&attr);
    int busy = 0;
    double t0 = now_ms() + skip_ms, c0 = thread_cpu_ms(), crowded_at = -1e9;
    uint64_t waited = thread_wait_ns();
    *excused = 0;
    for (*looks = 0; *looks < 100 && now_ms() - t0 < 5000;) {
        double t = now_ms();
        while (now_ms() - t < 11) rs_relax();              /* a spinner of our own */
        uint64_t w = thread_wait_ns();
        if (w - waited > 1000000) crowded_at = now_ms();
        waited = w;
        int b = rs_cpus_busy();
        if (now_ms() < t0) { c0 = thread_cpu_ms(); continue; }   /* not counted yet */
        if (!*looks) t0 = t;
        ++*looks;
        busy += b;
        if (b && now_ms() - crowded_at < 600) ++*excused;
    }
    *share = (thread_cpu_ms() - c0) / (now_ms() - t0);
    struct rs_spin sp;
    rs_spin_init(&sp, 1000000);
    *allowed = rs_spin_allow(&sp);
    hog_stop = 1;
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    return busy;
}

/* A thread whose CPU is crowded waits for it: rs_cpus_busy says so, and its waits get
 * no spin budget, whatever they wait for (a spin the scheduler cuts short leaves the
 * peer's answer unannounced for another task's slice).  A thread on a CPU of its own
 * spins, however crowded the others are. */
static void t_spin_when_busy(void)
{
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int n = (int)(ncpu > 0 ? ncpu : 1) * 2 + 1, looks, excused;
    if (n > 64) n = 64;
    uint64_t allowed;
    double share;
    hog_cpu = -1;
    int busy = busy_looks(n, 0, &looks, &allowed, &share, &excused);
    printf("  spin_when_busy: %d hogs on %ld CPUs: busy at %d of %d looks\n", n, ncpu, busy, looks);
    CHECK(busy > looks / 2, "%d spinning threads on %ld CPUs, and rs_cpus_busy said so only %d times in %d",
          n, ncpu, busy, looks);
    CHECK_EQ(allowed, 0);

    cpu_set_t mine, old;
    if (ncpu < 2 || sched_getaffinity(0, sizeof old, &old) != 0 || !CPU_ISSET(0, &old) || !CPU_ISSET(1, &old)) {
        printf("  spin_when_busy: CPUs 0 and 1 not both ours, the placement half is skipped\n");
        return;
    }
    CPU_ZERO(&mine);
    CPU_SET(1, &mine);
    CHECK(sched_setaffinity(0, sizeof mine, &mine) == 0, "sched_setaffinity");
    hog_cpu = 0;
    /* A busy answer holds for 500 ms (rs_wait.c) unless the thread changes CPUs, which it
     * may not have (it may have run on CPU 1 already); the look that ends the hold starts
     * a 10 ms count afresh.  So 600 ms pass before the looks are counted. */
    busy = busy_looks(3, 600, &looks, &allowed, &share, &excused);
    printf("  spin_when_busy: 3 hogs on CPU 0, this thread on CPU 1: busy at %d of %d looks (%d after this thread "
           "did wait for CPU 1), ran %.0f%% of the time\n", busy, looks, excused, share * 100);
    sched_setaffinity(0, sizeof old, &old);
    hog_cpu = -1;
    if (share < 0.8) {
        /* another program ran on CPU 1 meanwhile: "busy" was the right answer there */
        printf("  spin_when_busy: CPU 1 was not ours alone, the placement half is inconclusive\n");
        return;
    }
    CHECK(busy - excused < looks / 10, "rs_cpus_busy said busy %d times in %d on an idle CPU (%d after a wait of its own)",
          busy, looks, excused);
    CHECK(allowed > 0, "no spin budget on an idle CPU");
}

/* ---- a doorbell waits for a consumer between receives (PROTOCOL 6.3, 4a) -------------- */

struct taker { rs_conn *c; int cpu; volatile int ready; ssize_t got; int timeout_ms; };

static void pin_thread(int cpu)
{
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
}

/* A consumer between two receives, which asked for a doorbell before (want_bell 1) and
 * comes back at once: it looks at the ring without a receive (one that finds nothing goes
 * idle, saying it sleeps), then takes the record. */
static void *taker_run(void *arg)
{
    struct taker *t = arg;
    pin_thread(t->cpu);
    char b[64];
    rs_cpu_note(&t->c->rx.ctl->rx_cpu);          /* as its credit would: another CPU */
    t->ready = 1;
    double end = now_ms() + 2000;
    while (!rs_rx_maybe_ready(t->c) && now_ms() < end) rs_relax();
    t->got = rs_recv(t->c, b, sizeof b, RS_MSG_DONTWAIT, 0);
    return NULL;
}

/* A consumer asleep in a blocking receive (go-idle, then the socket). */
static void *sleeper_run(void *arg)
{
    struct taker *t = arg;
    pin_thread(t->cpu);
    char b[64];
    t->ready = 1;
    t->got = rs_recv(t->c, b, sizeof b, 0, t->timeout_ms);
    return NULL;
}

static void t_bell_grace(void)
{
    cpu_set_t old;
    if (sysconf(_SC_NPROCESSORS_ONLN) < 2 || sched_getaffinity(0, sizeof old, &old) != 0 ||
        !CPU_ISSET(0, &old) || !CPU_ISSET(1, &old)) {
        printf("  bell_grace: CPUs 0 and 1 not both ours, skipped\n");
        return;
    }
    pin_thread(0);
    struct pair p;
    pair_open(&p, 4096, 100000);
    int q, paid = 0, rounds = 20;
    /* A consumer that takes the record within the wait costs no doorbell, and its request
     * stays for the next one.  The wait is skipped while this thread waits for its CPU, so
     * only some rounds need to show it; none may lose the record. */
    for (int i = 0; i < rounds; i++) {
        struct taker t = { p.srv, 1, 0, -EAGAIN, 0 };
        pthread_t th;
        CHECK(pthread_create(&th, NULL, taker_run, &t) == 0, "pthread_create");
        while (!t.ready) rs_relax();
        CHECK_EQ(p.srv->rx.ctl->want_bell, RS_WANT_NEXT);
        uint64_t bells = p.cli->tx.ctl->data_bells;
        send_str(p.cli, "ping");
        CHECK(pthread_join(th, NULL) == 0, "pthread_join");
        CHECK(t.got == 4, "round %d: the consumer got %zd", i, t.got);
        if (p.cli->tx.ctl->data_bells == bells) {
            paid++;
            CHECK_EQ(p.srv->rx.ctl->want_bell, RS_WANT_NEXT);
            CHECK(ioctl(p.fd[1], FIONREAD, &q) == 0 && q == 0, "FIONREAD %d with no doorbell counted", q);
        }
        rs_rx_tidy(p.srv);                   /* a doorbell rung anyway is read off */
    }
    printf("  bell_grace: %d of %d records taken without a doorbell\n", paid, rounds);
    CHECK(paid > 0, "no record of %d was taken without a doorbell", rounds);
    /* A consumer asleep on the socket says so: the doorbell rings at once, and wakes it. */
    for (int i = 0; i < rounds; i++) {
        struct taker t = { p.srv, 1, 0, -EAGAIN, 5000 };
        pthread_t th;
        CHECK(pthread_create(&th, NULL, sleeper_run, &t) == 0, "pthread_create");
        while (!t.ready) rs_relax();
        usleep(2000);                        /* asleep by now, and said so */
        CHECK_EQ(p.srv->rx.ctl->want_bell, RS_WANT_NEXT | RS_WANT_SLEEPS);
        double t0 = now_ms();
        send_str(p.cli, "pong");
        CHECK(pthread_join(th, NULL) == 0, "pthread_join");
        CHECK(t.got == 4, "round %d: the sleeping consumer got %zd after %.0f ms", i, t.got, now_ms() - t0);
        CHECK(now_ms() - t0 < 2000, "round %d: the sleeper woke after %.0f ms", i, now_ms() - t0);
    }
    pair_close(&p);
    sched_setaffinity(0, sizeof old, &old);
}

/* ---- ring windows ------------------------------------------------------------------- */

/* Pages of a ring that memory holds (mincore on the memfd mapping: a page nobody wrote
 * was never allocated). */
static unsigned ring_pages_resident(const uint8_t *ring, uint32_t size)
{
    static unsigned char vec[1024];
    size_t pages = size / 4096;
    CHECK(pages <= sizeof vec, "ring too large for the test");
    CHECK(mincore((void *)ring, size, vec) == 0, "mincore: %s", strerror(errno));
    unsigned n = 0;
    for (size_t i = 0; i < pages; i++) n += vec[i] & 1;
    return n;
}

static void small_pingpong(struct pair *p, int rounds, int old_consumer)
{
    uint8_t out[64], in[64];
    for (int i = 0; i < rounds; i++) {
        memset(out, (int)(i * 13 + 5), sizeof out);
        send_all_nb(p->cli, out, sizeof out);
        if (old_consumer) p->srv->rx.credit_lag = p->srv->ring_size / 4;
        recv_exact(p->srv, in, sizeof in, 5000);
        CHECK(memcmp(in, out, sizeof in) == 0, "round %d: request garbled", i);
        send_all_nb(p->srv, in, sizeof in);
        if (old_consumer) p->cli->rx.credit_lag = p->cli->ring_size / 4;
        recv_exact(p->cli, in, sizeof in, 5000);
        CHECK(memcmp(in, out, sizeof in) == 0, "round %d: reply garbled", i);
    }
}

/* Small messages never need more than the first window: 20,000 round trips of 64 bytes go
 * round a 256 KiB ring's first 16 KiB some 100 times, and the rest of it is never touched,
 * so memory holds only those pages. */
static void t_window_small(void)
{
    struct pair p;
    uint32_t ring = 256u << 10;
    pair_open(&p, ring, 0);
    small_pingpong(&p, 20000, 0);
    CHECK_EQ(p.cli->tx.window, RS_WINDOW_MIN);
    CHECK_EQ(p.srv->tx.window, RS_WINDOW_MIN);
    CHECK(p.cli->tx.pos / ring >= 50, "only %llu laps", (unsigned long long)(p.cli->tx.pos / ring));
    unsigned r0 = ring_pages_resident(p.srv->rx.ring, ring), r1 = ring_pages_resident(p.cli->rx.ring, ring);
    printf("  window_small: %llu laps, resident ring pages %u and %u of %u\n",
           (unsigned long long)(p.cli->tx.pos / ring), r0, r1, ring / 4096);
    CHECK(r0 <= RS_WINDOW_MIN / 4096 && r1 <= RS_WINDOW_MIN / 4096, "resident ring pages %u and %u, window %u pages",
          r0, r1, RS_WINDOW_MIN / 4096);
    CHECK_RING_ZERO(p.cli);
    CHECK_RING_ZERO(p.srv);
    pair_close(&p);
}

/* A stream widens the window, with a writer thread and a reader taking random sizes at
 * once, every byte checked.  A reader that takes nothing for a while lets the writer fill
 * the whole ring: the window grows to it rather than stop the writer at 16 KiB. */
static void t_window_grows(void)
{
    struct pair p;
    uint32_t ring = 256u << 10;
    pair_open(&p, ring, 20000);
    struct producer a = { .stream = 7, .total = 24u << 20, .seed = 4242, .min_write = 1, .max_write = 100000 };
    stream_through(&p, &a, 90000, 4343);
    printf("  window_grows: %llu laps, window %u of %u\n", (unsigned long long)a.laps, p.srv->tx.window, ring);
    CHECK(p.srv->tx.window > RS_WINDOW_MIN, "a 24 MiB stream left the window at %u", p.srv->tx.window);
    pair_close(&p);

    pair_open(&p, ring, 0);
    small_pingpong(&p, 500, 0);                      /* laps in a small window first */
    CHECK_EQ(p.srv->tx.window, RS_WINDOW_MIN);
    static uint8_t buf[4000];
    uint64_t placed = 0;
    for (int i = 0; i < 1000; i++) {
        fill_pat(buf, 8, placed, sizeof buf);
        ssize_t r = rs_send(p.srv, buf, sizeof buf, 1, 0);
        if (r == -EAGAIN) break;
        CHECK(r > 0, "rs_send: %zd", r);
        placed += (uint64_t)r;
    }
    printf("  window_grows: a reader that takes nothing: %llu bytes placed, window %u\n",
           (unsigned long long)placed, p.srv->tx.window);
    CHECK_EQ(p.srv->tx.window, ring);
    CHECK(placed >= ring / 2, "only %llu bytes fit in a %u-byte ring", (unsigned long long)placed, ring);
    uint64_t pos = 0;
    expect_pat(p.cli, 8, &pos, placed);
    struct producer b = { .stream = 9, .total = 8u << 20, .seed = 77, .min_write = 1000, .max_write = 65536 };
    stream_through(&p, &b, 65536, 78);
    pair_close(&p);
}

/* Either side may be an implementation without windows: a producer that uses the whole
 * ring from the start, or a consumer that returns credit only every quarter ring (the
 * producer then finds no room at its first WRAP, and grows). */
static void t_window_interop(void)
{
    struct pair p;
    uint32_t ring = 256u << 10;
    pair_open(&p, ring, 20000);
    p.srv->tx.window = ring;
    struct producer a = { .stream = 10, .total = 4u << 20, .seed = 5, .min_write = 1, .max_write = 3000 };
    stream_through(&p, &a, 5000, 6);
    pair_close(&p);

    pair_open(&p, ring, 20000);
    small_pingpong(&p, 20000, 1);
    CHECK_RING_ZERO(p.cli);
    CHECK_RING_ZERO(p.srv);
    printf("  window_interop: windows %u and %u against consumers that return credit every quarter ring\n",
           p.cli->tx.window, p.srv->tx.window);
    pair_close(&p);
}

static const struct { const char *name; void (*fn)(void); } tests[] = {
    { "ring_memory_budget", t_ring_memory_budget },
    { "basic", t_basic },
    { "wrap", t_wrap },
    { "wrap_duplex", t_wrap_duplex },
    { "split", t_split },
    { "footer", t_footer },
    { "bogus_length", t_bogus_length },
    { "zeroing", t_zeroing },
    { "credits", t_credits },
    { "backpressure", t_backpressure },
    { "fin", t_fin },
    { "peer_gone", t_peer_gone },
    { "stall_move", t_stall_move },
    { "fin_after_peer_moved", t_fin_after_peer_moved },
    { "spill", t_spill },
    { "spill_hostile", t_spill_hostile },
    { "spill_concurrent", t_spill_concurrent },
    { "hold", t_hold },
    { "hold_then_move", t_hold_then_move },
    { "hold_for_others", t_hold_for_others },
    { "holder", t_holder },
    { "fdmap", t_fdmap },
    { "doorbell_garbage_traffic", t_doorbell_garbage_traffic },
    { "doorbell_garbage_idle", t_doorbell_garbage_idle },
    { "peer_gone_behind_bells", t_peer_gone_behind_bells },
    { "peek_waitall", t_peek_waitall },
    { "peek_doorbell", t_peek_doorbell },
    { "rx_available", t_rx_available },
    { "pre_wire", t_pre_wire },
    { "pre_order", t_pre_order },
    { "pre_peek", t_pre_peek },
    { "pre_switch_stays_the_readers", t_pre_switch_stays_the_readers },
    { "fb_reader_keeps_its_bytes", t_fb_reader_keeps_its_bytes },
    { "pre_waitall", t_pre_waitall },
    { "pre_tcp", t_pre_tcp },
    { "pre_garbage", t_pre_garbage },
    { "pre_eof", t_pre_eof },
    { "pre_partial", t_pre_partial },
    { "drop_stale_bells", t_drop_stale_bells },
    { "event_bells", t_event_bells },
    { "event_bells_threads", t_event_bells_threads },
    { "pre_send_full", t_pre_send_full },
    { "pre_send_partial", t_pre_send_partial },
    { "pre_send_large", t_pre_send_large },
    { "pre_switch_full_nonblocking", t_pre_switch_full_nonblocking },
    { "pre_bell_behind_full_preamble", t_pre_bell_behind_full_preamble },
    { "pre_send_signal", t_pre_send_signal },
    { "pre_moved_behind_preamble", t_pre_moved_behind_preamble },
    { "lazy_switch_behind_full_preamble", t_lazy_switch_behind_full_preamble },
    { "lazy_switch_after_server_close", t_lazy_switch_after_server_close },
    { "sleep_signal_rules", t_sleep_signal_rules },
    { "word_wake", t_word_wake },
    { "word_wake_one_sided", t_word_wake_one_sided },
    { "word_peer_death", t_word_peer_death },
    { "word_shutdown_rd", t_word_shutdown_rd },
    { "word_spurious", t_word_spurious },
    { "quiet_wake", t_quiet_wake },
    { "quiet_wake_more_than_room", t_quiet_wake_more_than_room },
    { "quiet_wake_timeout", t_quiet_wake_timeout },
    { "quiet_wake_two_sleepers", t_quiet_wake_two_sleepers },
    { "quiet_wake_one_sided", t_quiet_wake_one_sided },
    { "spin_when_busy", t_spin_when_busy },
    { "bell_grace", t_bell_grace },
    { "window_small", t_window_small },
    { "window_grows", t_window_grows },
    { "window_interop", t_window_interop },
};
#define NTESTS (int)(sizeof tests / sizeof tests[0])

int main(int argc, char **argv)
{
    int want[NTESTS], any_named = 0, skip[NTESTS];
    memset(want, 0, sizeof want);
    memset(skip, 0, sizeof skip);
    for (int i = 1; i < argc; i++) {
        int excl = 0;
        if (!strcmp(argv[i], "-l")) {
            for (int t = 0; t < NTESTS; t++) printf("%s\n", tests[t].name);
            return 0;
        }
        if (!strcmp(argv[i], "-x") && i + 1 < argc) { excl = 1; i++; }
        int found = 0;
        for (int t = 0; t < NTESTS; t++)
            if (!strcmp(argv[i], tests[t].name)) {
                found = 1;
                if (excl) skip[t] = 1; else { want[t] = 1; any_named = 1; }
            }
        if (!found) { fprintf(stderr, "unknown test %s (-l lists them)\n", argv[i]); return 2; }
    }
    signal(SIGPIPE, SIG_IGN);
    signal(SIGALRM, on_alarm);
    setvbuf(stdout, NULL, _IOLBF, 0);
    int ran = 0;
    for (int t = 0; t < NTESTS; t++) {
        if ((any_named && !want[t]) || skip[t]) continue;
        cur_test = tests[t].name;
        alarm(60);
        double t0 = now_ms();
        tests[t].fn();
        alarm(0);
        printf("ok %s (%.0f ms)\n", tests[t].name, now_ms() - t0);
        ran++;
    }
    printf("all %d tests passed\n", ran);
    return 0;
}
