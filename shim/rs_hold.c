/* rs_hold.c - a writer that waits for room empties its own full receive ring into private
 * memory (the hold), as the kernel queues a TCP socket's incoming bytes while its program
 * writes.
 *
 * Two programs that both write more than a ring holds before they read (an echo client
 * with a large request, a pipelining client, an upload to a server that answers early)
 * would otherwise wait for each other forever: each blocked in send on a full ring,
 * neither reading the other's.  Over TCP they do not, because each kernel keeps taking
 * the peer's bytes.  Where the producer can lend the socket's buffers (SPILL, rs_spill.c)
 * or the transport moves a stalled ring to TCP (stall_ms), that is the remedy.  Where
 * neither is available (rdma: records in flight may be lost and resent, so none may
 * travel beside the ring), the waiting writer itself takes what its receive ring holds
 * into the hold and returns that credit, once it has waited RS_HOLD_AFTER_NS, up to what
 * TCP would queue for the direction (the tcp_wmem and tcp_rmem maxima).  Nothing changes
 * on the wire: to the peer this is a consumer that read.  Reads take the hold first; the
 * buffer is freed as soon as it is empty.
 *
 * A waiting writer fills the holds of the process's other such connections as well: a
 * program that waits writing to one connection (a single-threaded proxy, a client of two
 * servers) does not read its others meanwhile, and their peers may be waiting for room
 * for the very bytes that would let this write go on.  TCP's kernel takes those bytes
 * too, whatever the program is doing.
 *
 * And where the program does not call the socket library at all for a while (it computes,
 * sleeps, or waits on a pipe, a lock or a plain TCP socket), a thread of ours (the holder)
 * looks every 10 ms at the connections with half a ring or more unread (their producer
 * waits for credit, or soon will): one whose consumer has not moved since its last look
 * is filled.  It runs only while such connections exist, and looks less often (up to
 * every 200 ms) while no ring is that full.
 *
 * After the transport failed and the connection went on over its TCP socket (rs_fallback.c),
 * a waiting writer fills the hold from the socket instead: buffers that carried only
 * doorbells take in far less than the ring and the hold did, so the two programs would
 * wait for each other there.
 *
 * The hold belongs to the receive side (rx.lock).  The writer decides under tx.lock that
 * it is due and fills it after letting tx.lock go (the lock order is rx.lock first).
 * Other connections' receive sides are only tried (a reader there is making progress).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "rs_conn.h"
#include "rs_sys.h"

#define RS_HOLD_AFTER_NS (RS_HOLD_AFTER_MS * 1000000ull)   /* no room this long before the writer holds */
#define RS_HOLD_MIN      (64u << 10)      /* first allocation */
#define RS_HOLD_DEFAULT  (10ull << 20)    /* limit if the kernel's maxima cannot be read */
#define HOLDER_BUSY_MS   10u              /* the holder's look while a producer waits */
#define HOLDER_IDLE_MS   200u             /* ...and at most while none does */

/* Field k (0 min, 1 default, 2 max) of a net.ipv4.tcp_[rw]mem file, or 0. */
static uint64_t tcp_mem_field(const char *path, int k)
{
    char buf[128];
    int fd = (int)rs_syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    long n = rs_syscall(SYS_read, fd, buf, sizeof buf - 1);
    rs_syscall(SYS_close, fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = buf;
    unsigned long long v[3] = { 0, 0, 0 };
    for (int i = 0; i < 3; i++) {
        char *end;
        v[i] = strtoull(p, &end, 10);
        if (end == p) return 0;
        p = end;
    }
    return v[k];
}

/* What TCP queues for one direction whose receiver does not read: the sender's buffer
 * (it grows to the tcp_wmem maximum) and the receiver's: SO_RCVBUF as the kernel reports
 * it for our socket, which is the tcp_rmem default until the program reads (the window
 * grows only then) or what the program set. */
static uint64_t hold_limit(rs_conn *c)
{
    static uint64_t wmem;
    uint64_t w = __atomic_load_n(&wmem, __ATOMIC_RELAXED);
    if (!w) {
        w = tcp_mem_field("/proc/sys/net/ipv4/tcp_wmem", 2);
        if (!w) w = RS_HOLD_DEFAULT;
        __atomic_store_n(&wmem, w, __ATOMIC_RELAXED);
    }
    int rcvbuf = 0;
    socklen_t len = sizeof rcvbuf;
    int fd = rs_fd_enter(c);
    if (rs_syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &len) < 0 || rcvbuf < 0) rcvbuf = 0;
    rs_fd_leave(c);
    uint64_t l = w + (uint64_t)rcvbuf;
    return l > (1ull << 31) ? 1ull << 31 : l;
}

/* Room for `want` more bytes after the held ones (caller holds rx.lock): what fits. */
static size_t make_room(rs_conn *c, size_t want)
{
    struct rs_rx *x = &c->rx;
    if (x->hold_off && x->hold_off + x->hold_len + want > x->hold_cap) {
        memmove(x->hold, x->hold + x->hold_off, x->hold_len);
        x->hold_off = 0;
    }
    size_t need = x->hold_len + want;
    if (need > x->hold_cap) {
        size_t cap = x->hold_cap ? x->hold_cap : RS_HOLD_MIN;
        while (cap < need) cap *= 2;
        uint8_t *p = realloc(x->hold, cap);
        if (p) { x->hold = p; x->hold_cap = cap; }
    }
    size_t room = x->hold_cap - x->hold_off - x->hold_len;
    return room < want ? room : want;
}

/* The peer has no remedy of its own for a full ring: it cannot spill, and the transport
 * does not move a stalled ring to TCP. */
int rs_hold_applies(rs_conn *c)
{
    return !c->spill_ok && !c->ops->stall_ms && c->rx.ring;
}

/* Caller holds tx.lock and found the ring full: 1 if it should hold (rs_hold_fill, once
 * it has let tx.lock go). */
int rs_hold_due(rs_conn *c)
{
    if (!rs_hold_applies(c)) return 0;
    uint64_t full = rs_tx_full_ns(c);
    return full >= RS_HOLD_AFTER_NS || (full && __atomic_load_n(&c->rx.hold_len, __ATOMIC_RELAXED));   /* holding already */
}

/* How often a readiness wait for room (poll, epoll) should look again so that the hold
 * is filled (-1: never for its sake): the program may be writing before it reads, and
 * the peer's bytes in our ring wake nothing that waits only for POLLOUT. */
int rs_hold_recheck_ms(rs_conn *c)
{
    if (!rs_hold_applies(c)) return -1;
    return __atomic_load_n(&c->rx.hold_len, __ATOMIC_RELAXED) ? 1 : (int)(RS_HOLD_AFTER_NS / 1000000u);
}

/* The process's connections where the hold applies, for the writer that fills others'
 * holds and for the holder.  A connection leaves the list before it is freed, under the
 * list's lock, which the fillers hold. */
struct rs_live { rs_lock_t lock; rs_conn *head; int holder; };   /* holder: its thread runs */
static struct rs_live live;

static void holder_start(void);

/* A child does not fill the holds of the connections it inherited: a child that does not
 * use them would take bytes its parent is to read, where TCP gives them to whichever
 * process reads.  Only connections it adopts itself are listed. */
static void live_before_fork(void) { rs_lock(&live.lock); }
static void live_after_fork_parent(void) { rs_unlock(&live.lock); }
static void live_after_fork_child(void)
{
    for (rs_conn *o = live.head, *next; o; o = next) {
        next = o->live_next;
        o->live = NULL;
        o->live_prev = o->live_next = NULL;
    }
    live.head = NULL;
    live.holder = 0;                   /* threads do not survive fork */
    live.lock.v = 0;
}
static void live_init(void) { pthread_atfork(live_before_fork, live_after_fork_parent, live_after_fork_child); }

void rs_hold_list(rs_conn *c)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (c->live || !rs_hold_applies(c)) return;
    pthread_once(&once, live_init);
    rs_lock(&live.lock);
    c->live = &live;
    c->live_prev = NULL;
    c->live_next = live.head;
    if (live.head) live.head->live_prev = c;
    live.head = c;
    if (!live.holder) holder_start();
    rs_unlock(&live.lock);
}

void rs_hold_unlist(rs_conn *c)
{
    struct rs_live *l = c->live;       /* the list of the code that listed it */
    if (!l) return;
    rs_lock(&l->lock);
    if (c->live_prev) c->live_prev->live_next = c->live_next;
    else l->head = c->live_next;
    if (c->live_next) c->live_next->live_prev = c->live_prev;
    c->live = NULL;
    c->live_prev = c->live_next = NULL;
    rs_unlock(&l->lock);
}

/* Takes what the receive ring has into the hold and returns the credit (caller holds
 * rx.lock, not tx.lock: returning credit may ring the peer's doorbell, under tx.lock).
 * Once the transport failed and the ring has nothing more, what the socket has (after
 * the peer's RESYNC frame and the bytes it repeats). */
static void fill_locked(rs_conn *c)
{
    struct rs_rx *x = &c->rx;
    /* A server's ring comes after the client's preamble: only its SWITCH may be read off
     * here (bytes the client wrote before our answer are the program's to read first). */
    if (x->pre.active && !rs_pre_settle_locked(c)) return;
    if (x->spill_state || x->fin_seen || x->shut_rd || RS_GET(c->err)) return;
    if (x->move.state && !c->ops->lossy_failure) return;
    uint64_t limit = hold_limit(c);
    if (x->hold_len < limit) {
        size_t want = limit - x->hold_len < c->ring_size ? (size_t)(limit - x->hold_len) : c->ring_size;
        want = make_room(c, want);
        uint8_t *dst = x->hold + x->hold_off + x->hold_len;
        size_t n = want ? rs_rx_take_ring(c, dst, want) : 0;
        int from_ring = n != 0;
        if (!n && want && rs_rx_on_tcp(c) && !x->cur_len && !RS_GET(x->sock_readers)) n = rs_fb_rx_take(c, dst, want);
        if (n) {
            __atomic_store_n(&x->hold_len, x->hold_len + n, __ATOMIC_SEQ_CST);
            __atomic_store_n(&x->held, x->held + n, __ATOMIC_RELAXED);
            if (from_ring) rs_rx_publish_credit(c, 1);
        }
        if (!x->hold_len) rs_hold_free(c);
    }
}

/* Our own receive ring into the hold, then those of the process's other connections
 * where the hold applies (caller holds no lock). */
void rs_hold_fill(rs_conn *c)
{
    rs_lock(&c->rx.lock);
    fill_locked(c);
    rs_unlock(&c->rx.lock);
    rs_lock(&live.lock);
    for (rs_conn *o = live.head; o; o = o->live_next) {
        if (o == c || !rs_trylock(&o->rx.lock)) continue;
        fill_locked(o);
        rs_unlock(&o->rx.lock);
    }
    rs_unlock(&live.lock);
}

/* The holder thread: fills the holds of connections with half a ring or more unread
 * whose consumer has not moved for a look.  Ends when the list is empty (rs_hold_list
 * starts another). */
static void *holder_run(void *arg)
{
    (void)arg;
    unsigned ms = HOLDER_BUSY_MS;
    for (;;) {
        struct timespec ts = { 0, (long)ms * 1000000L };
        nanosleep(&ts, NULL);
        int waiting = 0;
        rs_lock(&live.lock);
        for (rs_conn *o = live.head; o; o = o->live_next) {
            /* Half a ring unread: its producer waits, or soon will.  The peer's count
             * comes with its words, which may lag behind its records: one below ours is
             * stale and counts as half a ring.  Not after a move to TCP, where the peer's
             * count stops and ours goes on: a writer fills the hold then (rs_fallback.c). */
            uint64_t took = __atomic_load_n(&o->rx.bytes, __ATOMIC_RELAXED), posted = o->ops->peer_posted(o);
            if (RS_GET(o->fb) || (posted >= took && posted - took < o->ring_size / 2)) {
                o->rx.hold_seen = took - 1;
                continue;
            }
            waiting = 1;
            if (took == o->rx.hold_seen && rs_trylock(&o->rx.lock)) {
                fill_locked(o);
                rs_unlock(&o->rx.lock);
            }
            o->rx.hold_seen = __atomic_load_n(&o->rx.bytes, __ATOMIC_RELAXED);
        }
        int last = !live.head;
        if (last) live.holder = 0;
        rs_unlock(&live.lock);
        if (last) return NULL;
        ms = waiting ? HOLDER_BUSY_MS : ms * 2 > HOLDER_IDLE_MS ? HOLDER_IDLE_MS : ms * 2;
    }
}

/* Caller holds live.lock.  The thread takes no signal of the program's (they go to its
 * own threads, as they would without us). */
static void holder_start(void)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_attr_t a;
    if (pthread_attr_init(&a)) return;
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 64 << 10);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    if (pthread_create(&t, &a, holder_run, NULL) == 0) live.holder = 1;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&a);
}

/* Copies up to len held bytes (caller holds rx.lock); with peek they stay. */
size_t rs_hold_take(rs_conn *c, uint8_t *dst, size_t len, int peek)
{
    struct rs_rx *x = &c->rx;
    size_t n = len < x->hold_len ? len : x->hold_len;
    memcpy(dst, x->hold + x->hold_off, n);
    if (peek || !n) return n;
    x->hold_off += n;
    __atomic_store_n(&x->hold_len, x->hold_len - n, __ATOMIC_SEQ_CST);
    if (!x->hold_len) {
        rs_hold_free(c);
        rs_fb_update_done(c);           /* a direction that moved may be plain TCP now */
    }
    return n;
}

void rs_hold_free(rs_conn *c)
{
    free(c->rx.hold);
    c->rx.hold = NULL;
    c->rx.hold_cap = c->rx.hold_off = 0;
    __atomic_store_n(&c->rx.hold_len, 0, __ATOMIC_SEQ_CST);
}
