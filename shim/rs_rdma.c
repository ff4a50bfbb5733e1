/* rs_rdma.c - the `rdma` transport: records reach the peer's ring by RDMA WRITE.
 *
 * rs_verbs.c makes the verbs objects (protection domain, CQ, RC queue pair, memory
 * regions).  This file only posts work requests and polls the send CQ, through the inline
 * dispatchers of <infiniband/verbs.h> (ibv_post_send and ibv_poll_cq call the provider
 * through qp->context->ops), so librdmasock.so needs no libibverbs at link time and
 * programs that never use RDMA never load it.
 *
 * Doorbells (docs/PROTOCOL.md 9.6).  A producer writes a doorbell byte on the TCP socket only
 * when the consumer's want_seq (mirrored into our memory by the consumer) differs from the
 * last one it answered.  A consumer going to sleep raises want_seq, pushes it, and READs the
 * producer's own words; the READ runs at the producer after the push landed, so either the
 * producer's check saw the new want_seq (and rings), or its tx_seq store came first and the
 * READ returns it (and the consumer waits for those records instead of sleeping).  Credit
 * works the same way the other way round (tx_wait_seq, rx_head).  While a consumer spins in
 * recv it has raised nothing, so a ping-pong makes no system call at all.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include "rs_conn.h"
#include "rs_rdma.h"
#include "rs_verbs.h"
#include "rs_sys.h"

#if defined(__has_include) && !defined(RS_NO_VERBS)       /* RS_NO_VERBS: RDMASOCK_BUILD_RDMA=0 */
#if __has_include(<infiniband/verbs.h>)
#include <infiniband/verbs.h>
#define RS_HAVE_VERBS 1
#endif
#endif

/* Registered memory is pinned, so it is populated at once (unlike shm's).  It counts
 * against the process's ring memory budget (rs_shm.c).  NULL with errno ENOBUFS: over the
 * budget. */
void *rs_rdma_alloc(uint32_t ring_size, size_t *len_out)
{
    if (ring_size < RS_RING_MIN || ring_size > RS_RING_MAX || (ring_size & (ring_size - 1))) { errno = EINVAL; return NULL; }
    size_t len = RS_RDMA_HDR + 2 * (size_t)ring_size;
    if (rs_ring_memory_reserve(len) < 0) { errno = ENOBUFS; return NULL; }
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) { int e = errno; rs_ring_memory_release(len); errno = e; return NULL; }
    *len_out = len;
    return p;
}

void rs_rdma_unalloc(void *base, size_t len)
{
    if (base) rs_ring_unmap(base, len);
}

#ifndef RS_HAVE_VERBS

int rs_rdma_supported(void) { return 0; }
rs_conn *rs_conn_attach_rdma(void *base, size_t len, uint32_t ring_size, uint64_t salt, int fd, uint32_t spin_ns,
                             const struct rs_rdma_params *p)
{
    (void)base; (void)len; (void)ring_size; (void)salt; (void)fd; (void)spin_ns; (void)p;
    errno = ENOTSUP;
    return NULL;
}
void rs_rdma_drain(rs_conn *c) { (void)c; }
int  rs_rdma_quiesce(rs_conn *c, int timeout_ms) { (void)c; (void)timeout_ms; return 0; }

#else

#define BATCH 32

struct rs_rdma {
    struct ibv_qp *qp;
    struct ibv_cq *cq;
    struct rs_rdma_params p;
    struct rs_rdma_words *own, *mirror, *sync;
    pthread_mutex_t lock;        /* the QP and CQ are shared by a sending and a receiving thread */
    uint64_t posted, completed;  /* work requests: posted, and known complete (in SQ order) */
    uint32_t sig_every, since_sig;
    uint64_t tx_posted;          /* ring position up to which records are posted */
    uint64_t want_answered;      /* producer: the consumer's want_seq last answered with a bell */
    uint64_t credit_answered;    /* consumer: the producer's tx_wait_seq last answered */
    uint8_t  data_armed;         /* consumer: a sync proved the producer rings for the next record */
    uint8_t  credit_armed;       /* producer: likewise for credit */
    uint64_t credit_probe_at;    /* producer, credit_armed: when the quiet wait probes the link */
    uint64_t credit_armed_at;    /* producer: the credit (tx.head_seen) it had when it armed */
    uint8_t  failed;
    uint8_t  silent;             /* a RESYNC frame is going out: no more doorbell bytes */
    struct ibv_send_wr wr[BATCH];
    struct ibv_sge sge[BATCH];
    int nwr;
};

int rs_rdma_supported(void) { return 1; }

static const char *wc_status_text(int s)
{
    switch (s) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_QP_OP_ERR: return "local QP operation error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "work request flushed (queue pair in error)";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_REM_OP_ERR: return "remote operation error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded (peer unreachable)";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    case IBV_WC_FATAL_ERR: return "fatal error";
    case IBV_WC_RESP_TIMEOUT_ERR: return "response timeout";
    default: return "error";
    }
}

/* RDMA cannot go on.  With the TCP socket still up, the connection moves to it
 * (rs_fallback.c) and the message stays as the reason; otherwise it is a sticky error.
 * Any thread, r->lock possibly held: this only sets flags. */
static void rdma_fail(rs_conn *c, int err, const char *fmt, ...)
{
    struct rs_rdma *r = c->rdma;
    char msg[RS_ERRMSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (r->failed) return;
    r->failed = 1;
    __atomic_store_n(&r->own->failed, 1, __ATOMIC_RELEASE);     /* a peer's READ sees it */
    rs_verbs_stop_qp(r->qp);                        /* nothing posted is waited for any more */
    if (RS_GET(c->tcp_eof) || RS_GET(c->err)) { rs_conn_set_error(c, err, "%s", msg); return; }
    if (!RS_GET(c->fb)) snprintf(c->errmsg, sizeof c->errmsg, "%s", msg);
    rs_fb_begin(c, RS_REASON_RDMA_FAILED);
}

/* The peer's RESYNC frame is on the socket: its transport failed, ours moves too. */
static void peer_failed(rs_conn *c)
{
    rdma_fail(c, ECONNRESET, "rdmasock: the peer's RDMA transport failed");
}

/* Our doorbells stop for good before a RESYNC frame (rs_fallback.c) goes out. */
static void rdma_silence(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    pthread_mutex_lock(&r->lock);
    r->silent = 1;
    if (!r->failed) rs_verbs_stop_qp(r->qp);
    r->failed = 1;
    pthread_mutex_unlock(&r->lock);
}

/* Caller holds r->lock. */
static void poll_cq_locked(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    struct ibv_wc wc[16];
    int n = ibv_poll_cq(r->cq, 16, wc);
    if (n < 0) { rdma_fail(c, ECONNABORTED, "rdmasock: RDMA completion queue failed (%d)", n); return; }
    for (int i = 0; i < n; i++) {
        uint64_t count = wc[i].wr_id >> 1;
        if (count > r->completed) r->completed = count;
        if (wc[i].status != IBV_WC_SUCCESS && !r->failed)
            rdma_fail(c, ECONNABORTED, "rdmasock: RDMA %s failed: %s (status %d)",
                      (wc[i].wr_id & 1) ? "READ" : "WRITE", wc_status_text(wc[i].status), wc[i].status);
    }
}

/* Caller holds r->lock.  Waits until n more work requests fit in the send queue. */
static int ensure_room_locked(rs_conn *c, uint32_t n)
{
    struct rs_rdma *r = c->rdma;
    uint64_t deadline = 0;
    while (r->posted - r->completed + n > r->p.sq_depth) {
        poll_cq_locked(c);
        if (r->failed) return -1;
        uint64_t now = rs_now_ns();
        if (!deadline) deadline = rs_deadline((int)r->p.sync_timeout_ms);
        else if (now > deadline) {
            rdma_fail(c, ETIMEDOUT, "rdmasock: RDMA send queue did not drain within %u ms", r->p.sync_timeout_ms);
            return -1;
        }
        rs_relax();
    }
    return 0;
}

/* Caller holds r->lock.  Queues one work request; `signal` forces a completion. */
static void add_wr_locked(struct rs_rdma *r, enum ibv_wr_opcode op, uint64_t laddr, uint32_t len, uint32_t lkey,
                          uint64_t raddr, uint32_t rkey, int signal, int is_sync)
{
    struct ibv_send_wr *w = &r->wr[r->nwr];
    struct ibv_sge *s = &r->sge[r->nwr];
    s->addr = laddr; s->length = len; s->lkey = lkey;
    memset(w, 0, sizeof *w);
    w->sg_list = s;
    w->num_sge = 1;
    w->opcode = op;
    w->wr.rdma.remote_addr = raddr;
    w->wr.rdma.rkey = rkey;
    if (op == IBV_WR_RDMA_WRITE && len <= r->p.max_inline) w->send_flags |= IBV_SEND_INLINE;
    if (++r->since_sig >= r->sig_every) signal = 1;
    if (signal) { w->send_flags |= IBV_SEND_SIGNALED; r->since_sig = 0; }
    r->posted++;
    w->wr_id = r->posted << 1 | (uint64_t)(is_sync != 0);
    if (r->nwr) r->wr[r->nwr - 1].next = w;
    r->nwr++;
}

/* Caller holds r->lock. */
static int post_locked(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    if (!r->nwr) return 0;
    struct ibv_send_wr *bad = NULL;
    r->nwr = 0;
    int rc = ibv_post_send(r->qp, &r->wr[0], &bad);
    if (rc) {
        rdma_fail(c, ECONNABORTED, "rdmasock: RDMA post failed: %s", strerror(rc));
        return -1;
    }
    return 0;
}

/* Caller holds r->lock.  Our words into the peer's mirror. */
static void push_own_locked(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    add_wr_locked(r, IBV_WR_RDMA_WRITE, (uint64_t)(uintptr_t)r->own, sizeof *r->own, r->p.lkey_own,
                  r->p.raddr_mirror, r->p.rkey_mirror, 0, 0);
}

static void push_own(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    pthread_mutex_lock(&r->lock);
    if (!r->failed && ensure_room_locked(c, 1) == 0) {
        push_own_locked(c);
        post_locked(c);
    }
    pthread_mutex_unlock(&r->lock);
}

static void check_cq(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    pthread_mutex_lock(&r->lock);
    poll_cq_locked(c);
    pthread_mutex_unlock(&r->lock);
}

/* Push our words, then READ the peer's into r->sync; waits for the READ.  0 or -1 (failed). */
static int sync_peer(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    pthread_mutex_lock(&r->lock);
    if (r->failed || ensure_room_locked(c, 2) < 0) { pthread_mutex_unlock(&r->lock); return -1; }
    push_own_locked(c);
    add_wr_locked(r, IBV_WR_RDMA_READ, (uint64_t)(uintptr_t)r->sync, sizeof *r->sync, r->p.lkey_sync,
                  r->p.raddr_words, r->p.rkey_words, 1, 1);
    uint64_t target = r->posted;
    int rc = post_locked(c);
    pthread_mutex_unlock(&r->lock);
    if (rc < 0) return -1;
    uint64_t start = rs_now_ns(), deadline = rs_deadline((int)r->p.sync_timeout_ms);
    for (unsigned i = 0;; i++) {
        pthread_mutex_lock(&r->lock);
        poll_cq_locked(c);
        uint64_t done = r->completed;
        pthread_mutex_unlock(&r->lock);
        if (r->failed) return -1;
        if (done >= target) break;
        uint64_t now = rs_now_ns();
        if (now > deadline) {
            rdma_fail(c, ETIMEDOUT, "rdmasock: RDMA READ of the peer's counters got no answer within %u ms",
                      r->p.sync_timeout_ms);
            return -1;
        }
        /* Soft-RoCE does its work in kernel threads: give them the CPU after a short spin. */
        if (now - start > 20000) sched_yield(); else rs_relax();
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&r->sync->failed, __ATOMIC_RELAXED)) peer_failed(c);
    return r->failed ? -1 : 0;
}

rs_conn *rs_conn_attach_rdma(void *base, size_t len, uint32_t ring_size, uint64_t salt, int fd, uint32_t spin_ns,
                             const struct rs_rdma_params *p)
{
    if (!base || len != RS_RDMA_HDR + 2 * (size_t)ring_size || !p->qp || !p->cq || p->sq_depth < 8) {
        errno = EINVAL;
        return NULL;
    }
    rs_conn *c = rs_conn_alloc();
    struct rs_rdma *r = calloc(1, sizeof *r);
    if (!c || !r) { free(c); free(r); errno = ENOMEM; return NULL; }
    uint8_t *b = base;
    c->fd = fd;
    rs_conn_set_ring(c, ring_size, 0);
    c->salt = salt;
    c->rx.ring = b + RS_RDMA_HDR;
    c->tx.ring = b + RS_RDMA_HDR + ring_size;           /* the shadow of the peer's ring */
    c->rx.ctl = (struct rs_dir_ctl *)(b + RS_RDMA_OFF_CTL);
    c->tx.ctl = c->rx.ctl + 1;                          /* private: nobody else reads them */
    c->spin_ns = spin_ns;
    rs_spin_init(&c->rx.spin, spin_ns);
    c->map_base = base;
    c->map_len = len;
    r->qp = p->qp;
    r->cq = p->cq;
    r->p = *p;
    if (!r->p.sync_timeout_ms) r->p.sync_timeout_ms = 5000;
    if (r->p.sync_timeout_ms > 0x7fffffffu) r->p.sync_timeout_ms = 0x7fffffffu;     /* a bound, as an int */
    r->own = (struct rs_rdma_words *)(b + RS_RDMA_OFF_OWN);
    r->mirror = (struct rs_rdma_words *)(b + RS_RDMA_OFF_MIRROR);
    r->sync = (struct rs_rdma_words *)(b + RS_RDMA_OFF_SYNC);
    r->sig_every = p->sq_depth / 4;
    pthread_mutex_init(&r->lock, NULL);
    c->rdma = r;
    c->ops = &rs_transport_rdma;
    return c;
}

static void post_records(rs_conn *c);

/* Before the queue pair is destroyed: every posted WRITE (the FIN record last) must have
 * left, or destroying the QP would flush it and the peer would miss the stream's end. */
int rs_rdma_quiesce(rs_conn *c, int timeout_ms)
{
    struct rs_rdma *r = c->rdma;
    if (!r) return 0;
    if (RS_GET(c->fb)) return rs_fb_finish_tx(c, timeout_ms);   /* the resend goes by TCP */
    post_records(c);
    pthread_mutex_lock(&r->lock);
    if (!r->failed && r->posted > r->completed && r->since_sig && ensure_room_locked(c, 1) == 0) {
        /* the last WRs were unsignaled: a signaled empty WRITE completes after them */
        add_wr_locked(r, IBV_WR_RDMA_WRITE, 0, 0, 0, r->p.raddr_ring, r->p.rkey_ring, 1, 0);
        r->wr[r->nwr - 1].num_sge = 0;
        post_locked(c);
    }
    uint64_t target = r->posted, deadline = rs_deadline(timeout_ms);
    while (!r->failed && r->completed < target) {
        poll_cq_locked(c);
        if (rs_now_ns() > deadline) break;
        pthread_mutex_unlock(&r->lock);
        sched_yield();
        pthread_mutex_lock(&r->lock);
    }
    int rc = r->failed ? -RS_GET(c->err) : r->completed < target ? -ETIMEDOUT : 0;
    pthread_mutex_unlock(&r->lock);
    return rc;
}

static void rdma_after_fork_child(rs_conn *c)
{
    pthread_mutex_init(&c->rdma->lock, NULL);
}

static void rdma_free(rs_conn *c)
{
    pthread_mutex_destroy(&c->rdma->lock);
    free(c->rdma);
    c->rdma = NULL;
}

/* Producer: one RDMA WRITE per record written since the last call (a WRAP record is one
 * too), posted as one chain; then the counters the peer's READ may look at. */
static void post_records(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    if (r->tx_posted == c->tx.pos) return;
    pthread_mutex_lock(&r->lock);
    while (!r->failed && r->tx_posted < c->tx.pos) {
        uint32_t off = (uint32_t)(r->tx_posted & c->mask);
        uint32_t lw = *(uint32_t *)(c->tx.ring + off), rec = rs_rec_size(lw);
        if (r->nwr == BATCH) post_locked(c);
        if (ensure_room_locked(c, (uint32_t)r->nwr + 1) < 0) break;
        add_wr_locked(r, IBV_WR_RDMA_WRITE, (uint64_t)(uintptr_t)(c->tx.ring + off), rec, r->p.lkey_shadow,
                      r->p.raddr_ring + off, r->p.rkey_ring, 0, 0);
        r->tx_posted += rs_rec_span(c, r->tx_posted, lw);
    }
    if (!r->failed) post_locked(c);
    else r->nwr = 0;
    pthread_mutex_unlock(&r->lock);
    __atomic_store_n(&r->own->tx_bytes, c->tx.bytes, __ATOMIC_RELEASE);
    __atomic_store_n(&r->own->tx_seq, c->tx.seq, __ATOMIC_RELEASE);
}

/* One doorbell byte answering the peer's request `seq`; only a byte that left counts as
 * the answer (on EAGAIN the next chance tries again). */
static void answer(rs_conn *c, uint8_t kind, uint64_t *answered, uint64_t seq)
{
    struct rs_rdma *r = c->rdma;
    if (!rs_tx_switch(c)) return;                     /* not under the lock: it may wait for another sender */
    pthread_mutex_lock(&r->lock);                     /* never after a RESYNC frame's first byte */
    int sent = !r->silent && rs_bell_send(c, kind);
    pthread_mutex_unlock(&r->lock);
    if (sent) {
        *answered = seq;
        __atomic_fetch_add(&r->own->bells_sent, 1, __ATOMIC_RELAXED);
    }
}

/* Producer, after posting: ring if the consumer went idle since our last bell. */
static void rdma_flush(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    post_records(c);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);          /* tx_seq store before the want_seq load */
    uint64_t w = __atomic_load_n(&r->mirror->want_seq, __ATOMIC_ACQUIRE);
    if ((w == r->want_answered && !(w & RS_WANT_SEQ_EVERY)) || r->failed) return;
    answer(c, RS_BELL_DATA, &r->want_answered, w);
}

static void rdma_refresh_credit(rs_conn *c)
{
    rs_take_credit(c, __atomic_load_n(&c->rdma->mirror->rx_head, __ATOMIC_ACQUIRE));
}

/* Producer with a full ring: make sure the consumer sends a credit bell when it frees room.
 * Returns 1 if there is room after all.
 *
 * An armed producer waits for credit that arrives by the consumer's RDMA WRITE.  If the
 * link dies, that WRITE may never complete or fail (Soft-RoCE retries a send on a downed
 * port indefinitely), while the consumer, its ring empty, sleeps armed too: nobody would
 * ever look.  So a quiet wait probes every CREDIT_PROBE_MS: a READ of the consumer's words
 * that must come back within sync_timeout (it also brings any credit whose WRITE was lost),
 * or the connection moves to TCP. */
#define CREDIT_PROBE_MS 1000
static int rdma_arm_credit(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    rdma_refresh_credit(c);
    if (r->failed) return 0;
    /* Armed, and no credit since: the request stands.  Credit that came (its bell may sit
     * unread on the socket while we only write) ends that episode: a new one asks again,
     * with our words, so the consumer (or its holder, rs_hold.c) sees that we wait. */
    if (r->credit_armed && c->tx.head_seen == r->credit_armed_at) {
        check_cq(c);                                  /* a producer that only waits notices failures */
        if (r->failed || rs_now_ns() < r->credit_probe_at) return 0;
    } else {
        __atomic_fetch_add(&r->own->tx_wait_seq, 1, __ATOMIC_SEQ_CST);
    }
    if (sync_peer(c) < 0) return 1;                   /* the write reports the error */
    rs_take_credit(c, __atomic_load_n(&r->sync->rx_head, __ATOMIC_ACQUIRE));
    r->credit_armed = 1;
    r->credit_armed_at = c->tx.head_seen;
    r->credit_probe_at = rs_now_ns() + CREDIT_PROBE_MS * 1000000ull;
    return 0;
}

/* Consumer: hand consumed ring bytes back (every quarter window, when the producer waits for
 * them, or with force whenever anything is unpublished), and answer a waiting producer. */
static void rdma_publish_credit(rs_conn *c, int force)
{
    struct rs_rdma *r = c->rdma;
    uint64_t lag = c->rx.pos - c->rx.head_pub;
    uint64_t tw = __atomic_load_n(&r->mirror->tx_wait_seq, __ATOMIC_ACQUIRE);
    int waiting = tw != r->credit_answered;
    if (!lag && !waiting) return;
    if (!force && !waiting && lag < c->rx.credit_lag) return;
    if (lag) {
        __atomic_store_n(&r->own->rx_head, c->rx.pos, __ATOMIC_RELEASE);
        c->rx.head_pub = c->rx.pos;
        push_own(c);
    }
    if (!waiting || r->failed) return;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);          /* rx_head store before the tx_wait_seq load */
    tw = __atomic_load_n(&r->mirror->tx_wait_seq, __ATOMIC_ACQUIRE);
    answer(c, RS_BELL_CREDIT, &r->credit_answered, tw);
}

static uint64_t rdma_peer_posted(rs_conn *c)
{
    return __atomic_load_n(&c->rdma->mirror->tx_bytes, __ATOMIC_RELAXED);
}

/* Reads the doorbell bytes that are there, up to a RESYNC frame: that and what follows
 * are the stream, for rs_fallback.c.  A drained bell disarms what it answered.  Peeks
 * first and takes exactly the bells seen, under rx_lock, so two threads never split a
 * frame between them. */
static void drain_locked(rs_conn *c);

void rs_rdma_drain(rs_conn *c)
{
    if (!c->rdma) return;
    rs_lock(&c->rx.lock);
    drain_locked(c);
    rs_unlock(&c->rx.lock);
}

static void drain_locked(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    uint8_t buf[256];
    if (c->rx.move.state) return;
    for (int i = 0; i < 64 && !c->rx.move.state; i++) {     /* also after EOF: a frame may precede it */
        long n = rs_c_recv(c, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
        if (n == -ECONNRESET)           /* a reset discards what was queued, a frame too */
            rs_conn_set_error(c, ECONNRESET, "rdmasock: the peer reset the connection "
                              "(its process or its RDMA transport failed)");
        if (n == 0 || n == -ECONNRESET || n == -ENOTCONN) { RS_SET(c->tcp_eof, 1); break; }
        if (n < 0) break;
        uint64_t kinds[2] = { 0, 0 };
        int next;
        long k = rs_bell_scan(buf, n, &next, kinds);
        if (kinds[0]) r->data_armed = 0;
        if (kinds[1]) r->credit_armed = 0;
        if (k) {
            rs_c_recv(c, buf, (size_t)k, MSG_DONTWAIT);
            c->rx.bells_drained += (uint64_t)k;
        }
        if (next >= 0) {
            if (next == RS_BELL_RESYNC) peer_failed(c);
            else rs_bell_garbage(c, next);
            break;
        }
        if ((size_t)n < sizeof buf) break;
    }
}

/* A producer that only waits for credit looks at the socket without taking anything:
 * a RESYNC frame behind the doorbells means the peer moved to TCP. */
static void rdma_check_peer(rs_conn *c)
{
    uint8_t buf[64];
    if (RS_GET(c->fb)) return;
    long n = rs_c_recv(c, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    int next;
    if (n > 0 && (rs_bell_scan(buf, n, &next, NULL), next == RS_BELL_RESYNC)) peer_failed(c);
}

/* rs_rx_bell_every (caller holds rx_lock): the bit rides in want_seq, pushed now so the
 * producer sees it. */
static void rdma_bell_every(rs_conn *c, int on)
{
    struct rs_rdma *r = c->rdma;
    if (on) __atomic_fetch_or(&r->own->want_seq, RS_WANT_SEQ_EVERY, __ATOMIC_SEQ_CST);
    else __atomic_fetch_and(&r->own->want_seq, ~RS_WANT_SEQ_EVERY, __ATOMIC_SEQ_CST);
    if (!RS_GET(c->fb) && !RS_GET(c->err) && !RS_GET(c->tcp_eof)) sync_peer(c);
}

/* Consumer found its ring empty: 1 if a record is there after all, 0 if idle (armed). */
static int rdma_go_idle(rs_conn *c)
{
    struct rs_rdma *r = c->rdma;
    if (RS_GET(c->fb)) return rs_rx_ready_locked(c);                  /* the socket tells (rs_fallback.c) */
    drain_locked(c);
    if (rs_rx_ready_locked(c)) return 1;
    if (r->data_armed) check_cq(c);                   /* before sleeping: our QP may have failed */
    if (RS_GET(c->fb)) return rs_rx_ready_locked(c);
    if (RS_GET(c->err) || RS_GET(c->tcp_eof) || r->data_armed) return 0;
    rdma_publish_credit(c, 1);                      /* all credit back before sleeping */
    __atomic_fetch_add(&r->own->want_seq, 1, __ATOMIC_SEQ_CST);
    if (sync_peer(c) < 0) return RS_GET(c->fb) ? rs_rx_ready_locked(c) : 0;
    rs_take_credit(c, __atomic_load_n(&r->sync->rx_head, __ATOMIC_ACQUIRE));
    uint64_t posted = __atomic_load_n(&r->sync->tx_seq, __ATOMIC_ACQUIRE);
    if (RS_GET(c->fb)) return rs_rx_ready_locked(c);
    if (posted <= c->rx.seq) { r->data_armed = 1; return 0; }
    /* Records are posted but still on the wire: they land within a round trip. */
    uint64_t start = rs_now_ns(), deadline = rs_deadline((int)r->p.sync_timeout_ms);
    while (!rs_rx_ready_locked(c)) {
        uint64_t now = rs_now_ns();
        if (now > deadline) {
            rdma_fail(c, ETIMEDOUT, "rdmasock: records the peer posted did not arrive within %u ms",
                      r->p.sync_timeout_ms);
            return RS_GET(c->fb) ? rs_rx_ready_locked(c) : 0;
        }
        if (now - start > 20000) sched_yield(); else rs_relax();
    }
    return 1;
}

static int rdma_describe(rs_conn *c, char *buf, size_t n)
{
    struct rs_rdma *r = c->rdma;
    int k = snprintf(buf, n, "; ours: head=%llu want=%llu wait=%llu posted=%llu/%llu bytes; peer's (mirror): head=%llu "
                     "want=%llu wait=%llu posted=%llu/%llu bytes; answered want=%llu wait=%llu; armed data=%u "
                     "credit=%u; work requests posted=%llu completed=%llu; failed=%u silent=%u",
                     RS_SEEN(r->own->rx_head), RS_SEEN(r->own->want_seq), RS_SEEN(r->own->tx_wait_seq), RS_SEEN(r->own->tx_seq),
                     RS_SEEN(r->own->tx_bytes), RS_SEEN(r->mirror->rx_head), RS_SEEN(r->mirror->want_seq),
                     RS_SEEN(r->mirror->tx_wait_seq), RS_SEEN(r->mirror->tx_seq), RS_SEEN(r->mirror->tx_bytes),
                     RS_SEEN(r->want_answered), RS_SEEN(r->credit_answered), r->data_armed, r->credit_armed,
                     RS_SEEN(r->posted), RS_SEEN(r->completed), r->failed, r->silent);
    return k < 0 ? 0 : (size_t)k >= n ? (int)n - 1 : k;
}

static void nothing(rs_conn *c) { (void)c; }
static int no_word(rs_conn *c, const uint32_t **w, uint32_t *v, size_t room) { (void)c; (void)w; (void)v; (void)room; return -1; }

const struct rs_transport rs_transport_rdma = {
    .name = "rdma",
    .id = RS_TRANSPORT_RDMA,
    .torn_records = 1,
    .lossy_failure = 1,
    .silent_failure = 1,
    .host_objects = 1,
    .stall_ms = 0,      /* no move on a stall: the TCP connection, cold after carrying only
                         * doorbells, would hold too little to help (README) */
    .room_recheck_ms = CREDIT_PROBE_MS,
    .refresh_credit = rdma_refresh_credit,
    .flush = rdma_flush,
    .arm_credit = rdma_arm_credit,
    .unread_at_peer = rs_tx_credit_unread,
    .peer_posted = rdma_peer_posted,
    .check_peer = rdma_check_peer,
    .silence = rdma_silence,
    .publish_credit = rdma_publish_credit,
    .arm_word = no_word,
    .go_idle = rdma_go_idle,
    .nonblock_empty = rdma_go_idle,             /* arm as for a wait: bell counts are not shared */
    .tidy = nothing,                            /* the next go_idle drains */
    .drop_stale = nothing,                      /* ... since its bell counts are not shared */
    .bell_every = rdma_bell_every,
    .quiesce = nothing,
    .closed = rs_rdma_drain,
    .describe = rdma_describe,                    /* unread bells would make the close send RST */
    .after_fork_child = rdma_after_fork_child,
    .free = rdma_free,
};

#endif
