/* rs_doorbell.c - readiness: when to ring the peer, how to go idle, how to sleep.
 *
 * The application's TCP socket stays the one descriptor anybody waits on.  A consumer that
 * finds its ring empty sets want_bell and, from then on, the producer writes one doorbell
 * byte on the TCP socket for the next record, so select/poll/epoll on the socket see it
 * readable.  While a consumer busy-polls inside recv it publishes spin_limit: records up to
 * that payload position are certain to be absorbed by that very call, so the producer
 * skips the system call for them.  Invariant kept for every caller: whenever records are
 * unconsumed and nobody is inside recv, at least one doorbell byte is pending.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include "rs_conn.h"
#include "rs_sys.h"

/* The counter was raised before the send (the consumer's snapshot relies on that order);
 * a byte that never left is taken back so the consumer does not wait to drain it. */
static int send_bell(rs_conn *c, uint8_t kind, uint64_t *counter)
{
    long r = rs_tx_switch(c) ? rs_c_send(c, &kind, 1, MSG_DONTWAIT | MSG_NOSIGNAL) : -EAGAIN;
    if (r == 1) { __atomic_fetch_add(&c->bells_sent, 1, __ATOMIC_RELAXED); return 1; }
    __atomic_fetch_sub(counter, 1, __ATOMIC_SEQ_CST);
    if (r == -EPIPE || r == -ECONNRESET || r == -ENOTCONN) RS_SET(c->tcp_eof, 1);
    return 0;
}

/* Producer side (caller holds tx_lock): after publishing records, wake the consumer if it
 * asked for it. */
void rs_tx_flush_bell(rs_conn *c)
{
    rs_tx_switch(c);                                    /* our first records are out */
    if (c->tx.fb) return;                               /* after a RESYNC frame only the stream */
    if (c->rdma) { rs_rdma_flush_bell(c); return; }
    struct rs_dir_ctl *k = c->tx.ctl;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);           /* pairs with the consumer's fence */
    uint32_t want = __atomic_load_n(&k->want_bell, __ATOMIC_RELAXED);
    if (!want) return;                                  /* a bell is pending */
    /* RS_WANT_EVERY: the consumer's program learns of each arrival from a SIGIO, as over
     * TCP, so every publication rings, spinning consumer or not; the request stays. */
    if (want != RS_WANT_EVERY) {
        if (__atomic_load_n(&k->spinning, __ATOMIC_ACQUIRE) &&
            c->tx.bytes <= __atomic_load_n(&k->spin_limit, __ATOMIC_ACQUIRE))
            return;                                     /* a spinning recv will absorb it */
        want = __atomic_exchange_n(&k->want_bell, 0, __ATOMIC_SEQ_CST);
        if (!want) return;
        if (want == RS_WANT_EVERY) {                    /* asked for meanwhile: it stays */
            uint32_t none = 0;
            __atomic_compare_exchange_n(&k->want_bell, &none, RS_WANT_EVERY, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        }
    }
    __atomic_fetch_add(&k->data_bells, 1, __ATOMIC_SEQ_CST);
    /* Not sent (send buffer full, e.g. of preamble the peer has not read yet): the
     * consumer still wants one, so the next record tries again. */
    if (!send_bell(c, RS_BELL_DATA, &k->data_bells) && want != RS_WANT_EVERY)
        __atomic_store_n(&k->want_bell, RS_WANT_NEXT, __ATOMIC_SEQ_CST);
}

/* Consumer side: wake a producer blocked on a full ring (credit was just published).
 * Under tx_lock: once our own direction has moved to TCP (its RESYNC frame is out), no
 * byte but the stream may follow it; a producer waiting for credit then finds it in
 * memory (its waits nap and look). */
void rs_ring_bell(rs_conn *c, struct rs_dir_ctl *ctl, uint64_t *counter, uint8_t kind)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&ctl->tx_waiting, __ATOMIC_RELAXED)) return;
    rs_lock(&c->tx.lock);
    if (!c->tx.fb && __atomic_exchange_n(&ctl->tx_waiting, 0, __ATOMIC_SEQ_CST)) {
        __atomic_fetch_add(counter, 1, __ATOMIC_SEQ_CST);
        if (!send_bell(c, kind, counter)) __atomic_store_n(&ctl->tx_waiting, 1, __ATOMIC_SEQ_CST);
    }
    rs_unlock(&c->tx.lock);
}

static void note_sock_error(rs_conn *c, int e);

/* What a recv on the doorbell channel said: 1 bytes came, 0 nothing more (EAGAIN), -1 the
 * socket ended (tcp_eof set, and the error if it was one). */
static int bell_read_result(rs_conn *c, long n)
{
    if (n > 0) return 1;
    if (n == -EAGAIN || n == -EINTR) return 0;
    if (n == 0 && c->rx.shut_rd) return 0;                 /* our own SHUT_RD, not the peer */
    if (n < 0) note_sock_error(c, (int)-n);
    RS_SET(c->tcp_eof, 1);
    return -1;
}

/* Doorbell bytes at the front of what the socket holds (peeked: n bytes in buf): how many
 * may be read off.  A RESYNC frame's first byte ends them: the peer's direction moved to
 * TCP and our ring has its MOVED record, which the consumer reaches first.  Anything
 * else is garbage. */
static long leading_bells(rs_conn *c, const uint8_t *buf, long n)
{
    long k = 0;
    while (k < n && (buf[k] == RS_BELL_DATA || buf[k] == RS_BELL_CREDIT)) k++;
    if (k < n && buf[k] != RS_BELL_RESYNC)
        rs_conn_set_error(c, EPROTO, "rdmasock: garbage byte 0x%02x on the doorbell channel", buf[k]);
    return k;
}

/* Reads up to `todo` doorbell bytes that were sent before the caller's snapshot (the
 * peer writes the counter: at most 64 reads, whatever it says). */
static void drain_bells(rs_conn *c, uint64_t todo)
{
    uint8_t buf[256];
    for (int rounds = 0; todo > 0 && !RS_GET(c->tcp_eof) && rounds < 64; rounds++) {
        long n = rs_c_recv(c, buf, todo < sizeof buf ? todo : sizeof buf, MSG_PEEK | MSG_DONTWAIT);
        if (bell_read_result(c, n) <= 0) break;         /* EAGAIN: still in flight */
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
 * see EOF. */
static void check_uncounted(rs_conn *c)
{
    uint8_t buf[64];
    long n = rs_c_recv(c, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    if (bell_read_result(c, n) <= 0) return;
    leading_bells(c, buf, n);
}

static int go_idle(rs_conn *c, int check);

/* Called by a consumer that found its ring empty (caller holds rx_lock).  Returns 1 if a
 * record is there after all (consume it, nothing was drained), 0 if the connection is
 * idle: want_bell is set and every doorbell byte sent before that moment has been read
 * off the socket. */
static void bell_every_locked(rs_conn *c, int on);

int rs_rx_go_idle_locked(rs_conn *c)
{
    if (c->rx.flags_unseen) {
        /* Whether the program takes SIGIO: asked of the socket before each idle period,
         * the only moment a doorbell could be missed for it. */
        long fl = syscall(SYS_fcntl, rs_fd_peek(c), F_GETFL);
        if (fl >= 0 && !(fl & O_ASYNC) != !c->rx.bell_every) bell_every_locked(c, (fl & O_ASYNC) != 0);
    }
    if (c->rdma) return c->rx.pre ? 0 : rs_rdma_go_idle(c);
    return go_idle(c, 1);
}

int rs_rx_go_idle(rs_conn *c)
{
    rs_lock(&c->rx.lock);
    int r = rs_rx_go_idle_locked(c);
    rs_unlock(&c->rx.lock);
    return r;
}

/* A non-blocking receive found the ring empty.  Programs that read until EAGAIN (libpq,
 * event loops) do so after every message; arming there (want_bell) made the peer ring a
 * doorbell for the next message, a send and a wake-up per request.  Under the preload
 * library the wait that follows goes through its poll/epoll hooks, which arm before they
 * sleep, so this only hands back credit and, at most every millisecond, looks for EOF (an
 * idle reader that never waits must still see the peer's death).  1 if a record is there
 * after all.  Elsewhere it is go-idle. */
int rs_rx_nonblock_empty(rs_conn *c)
{
    if (c->rx.fb) return rs_fb_rx_ready(c);
    if (!c->rx.lazy_tidy || c->rdma || c->rx.pre) return rs_rx_go_idle_locked(c);
    rs_rx_publish_credit(c, 1);
    if (rs_rx_ready_locked(c)) return 1;
    uint64_t now = rs_now_ns();
    if (now - c->rx.last_peek_ns > 1000000u && !RS_GET(c->tcp_eof)) {
        c->rx.last_peek_ns = now;
        check_uncounted(c);
    }
    return 0;
}

/* Producer with a full ring, before it sleeps: ask the consumer for a credit doorbell
 * (caller holds tx_lock).  Returns 1 if there is room after all. */
int rs_tx_arm_credit_locked(rs_conn *c)
{
    if (c->rdma) return rs_rdma_arm_credit(c);
    __atomic_store_n(&c->tx.ctl->tx_waiting, 1, __ATOMIC_SEQ_CST);
    return rs_tx_writable_locked(c);
}

int rs_tx_arm_credit(rs_conn *c)
{
    rs_lock(&c->tx.lock);
    int r = rs_tx_arm_credit_locked(c);
    rs_unlock(&c->tx.lock);
    return r;
}

/* After a recv emptied the ring: if doorbell bytes are outstanding, read them now so a
 * level-triggered select/epoll does not report a readiness that has been consumed.
 * Costs a system call only in episodes where the producer already paid one. */
void rs_rx_tidy(rs_conn *c)
{
    struct rs_dir_ctl *k = c->rx.ctl;
    if (c->rx.pre || !c->rx.ring || c->rdma || c->rx.fb) return;   /* rdma: the next go_idle drains */
    /* Under the preload library poll/select/epoll look at the ring first, so a stale
     * doorbell costs nothing there, while draining it here re-arms want_bell: the next
     * record then rings again, and a request/response exchange paid a send and a recv
     * system call per message for it.  The stale byte keeps the invariant (6.7). */
    if (c->rx.lazy_tidy) return;
    uint64_t sent = __atomic_load_n(&k->data_bells, __ATOMIC_RELAXED) +
                    __atomic_load_n(&c->tx.ctl->credit_bells, __ATOMIC_RELAXED);
    if (sent > c->rx.bells_drained && !rs_rx_ready_locked(c)) go_idle(c, 0);
}

static int go_idle(rs_conn *c, int check)
{
    struct rs_dir_ctl *k = c->rx.ctl;
    if (c->rx.pre || !c->rx.ring) return 0;     /* preamble bytes on the socket are data */
    if (c->rx.fb) return rs_fb_rx_ready(c);     /* past the peer's MOVED record: the socket is the stream */
    if (check) rs_rx_publish_credit(c, 1);      /* really idle: hand back all credit */
    __atomic_store_n(&k->want_bell, c->rx.bell_every ? RS_WANT_EVERY : RS_WANT_NEXT, __ATOMIC_SEQ_CST);
    /* Snapshot before the re-check: a bell counted here belongs to a record the re-check
     * is guaranteed to see, so draining it cannot strand that record without a bell. */
    uint64_t sent = __atomic_load_n(&k->data_bells, __ATOMIC_SEQ_CST) +
                    __atomic_load_n(&c->tx.ctl->credit_bells, __ATOMIC_SEQ_CST);
    if (rs_rx_ready_locked(c)) return 1;
    if (sent > c->rx.bells_drained) drain_bells(c, sent - c->rx.bells_drained);
    if (check && sent <= c->rx.bells_drained && !RS_GET(c->tcp_eof)) check_uncounted(c);
    return 0;
}

/* O_ASYNC set (on) or cleared on the socket.  The kernel raises SIGIO for every arrival
 * of data, not only for the first after a read, so the producer is asked for a doorbell
 * after every publication, whatever else it knows of us.  Extra doorbells are harmless:
 * they are counted and drained like any other. */
void rs_rx_bell_every(rs_conn *c, int on)
{
    rs_lock(&c->rx.lock);
    bell_every_locked(c, on);
    rs_unlock(&c->rx.lock);
}

static void bell_every_locked(rs_conn *c, int on)
{
    c->rx.bell_every = (uint8_t)(on != 0);
    if (c->rdma) { rs_rdma_bell_every(c, on); return; }
    if (c->rx.ctl && !c->rx.fb) {
        if (on) __atomic_store_n(&c->rx.ctl->want_bell, RS_WANT_EVERY, __ATOMIC_SEQ_CST);
        else {
            uint32_t every = RS_WANT_EVERY;
            __atomic_compare_exchange_n(&c->rx.ctl->want_bell, &every, RS_WANT_NEXT, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST);
        }
    }
}

/* Before the application's close: the peer is told that no doorbell is wanted any more,
 * and those it already sent are read off the socket (a short bounded wait for ones in
 * flight), so that the kernel's close does not turn into a reset over bytes that were
 * only ours.  A reset would throw away what is still in flight to the peer, which after
 * a move to TCP (6.8) is stream data.  Not once our receive side reads the socket: the
 * bytes there are the peer's stream. */
#define RS_QUIESCE_NS 20000000ull
void rs_quiesce_bells(rs_conn *c)
{
    if (RS_GET(c->rx.pre) && !rs_pre_quiesce(c, RS_QUIESCE_NS)) return;
    if (c->rdma || !c->rx.ring || RS_GET(c->tcp_eof)) return;
    rs_lock(&c->rx.lock);
    if (!c->rx.fb) {
        __atomic_store_n(&c->rx.ctl->want_bell, 0, __ATOMIC_SEQ_CST);
        __atomic_store_n(&c->tx.ctl->tx_waiting, 0, __ATOMIC_SEQ_CST);
        uint64_t until = rs_now_ns() + RS_QUIESCE_NS;
        for (int i = 0; i < 64; i++) {
            uint64_t sent = __atomic_load_n(&c->rx.ctl->data_bells, __ATOMIC_SEQ_CST) +
                            __atomic_load_n(&c->tx.ctl->credit_bells, __ATOMIC_SEQ_CST);
            if (sent <= c->rx.bells_drained || RS_GET(c->tcp_eof) || rs_now_ns() >= until) break;
            drain_bells(c, sent - c->rx.bells_drained);
            if (sent > c->rx.bells_drained) {
                struct timespec ts = { 0, 200000 };
                nanosleep(&ts, NULL);
            }
        }
    }
    rs_unlock(&c->rx.lock);
}

/* An error e on the TCP socket (0: read it from SO_ERROR, which reading clears): a peer
 * host that vanished (keepalive timed out, unreachable) is an error of the connection, not
 * an end of stream (a reset is not: stray doorbell bytes make a closing peer send one). */
static void note_sock_error(rs_conn *c, int e)
{
    if (!e) e = rs_c_sockerr(c);
    if (e == ETIMEDOUT || e == EHOSTUNREACH || e == ENETUNREACH)
        rs_conn_set_error(c, e, "rdmasock: the connection's TCP socket failed: %s", strerror(e));
}

/* The peer's RESYNC frame waits on the socket behind doorbell bytes: its direction moved
 * to TCP (its MOVED record is in our ring), so a TCP FIN after it is a half-close. */
static int peer_moved(rs_conn *c)
{
    uint8_t buf[4096];
    long n = rs_c_recv(c, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    long k = 0;
    while (k < n && (buf[k] == RS_BELL_DATA || buf[k] == RS_BELL_CREDIT)) k++;
    if (k == (long)sizeof buf) return 1;        /* only doorbells in view: not known yet, not gone */
    return k < n && buf[k] == RS_BELL_RESYNC;
}

/* Without blocking: does the TCP socket say that the peer is gone?  An upgraded peer never
 * ends the TCP stream while it lives (its FIN travels as a record), so the kernel's end of
 * stream or reset means its socket is closed: its process died or closed the connection.
 * Not so after our own shutdown(SHUT_RD) (then the kernel reports an end of stream of its
 * own), nor once the peer's direction moved to TCP (then a TCP FIN is its half-close). */
int rs_peer_gone(rs_conn *c)
{
    if (RS_GET(c->tcp_eof)) return 1;
    short re;
    if (rs_c_poll(c, POLLRDHUP, 0, &re) <= 0) return 0;
    if (re & POLLERR) note_sock_error(c, 0);
    if (re & (POLLHUP | POLLERR | POLLNVAL)) RS_SET(c->tcp_eof, 1);
    else if ((re & POLLRDHUP) && !rs_rx_on_tcp(c) && !peer_moved(c)) {
        if (!RS_GET(c->rx.shut_rd)) {
            RS_SET(c->tcp_eof, 1);
        } else {
            struct tcp_info ti;
            socklen_t l = sizeof ti;
            if (syscall(SYS_getsockopt, rs_fd_enter(c), IPPROTO_TCP, TCP_INFO, &ti, &l) == 0 &&
                ti.tcpi_state != TCP_ESTABLISHED && ti.tcpi_state != TCP_FIN_WAIT1 && ti.tcpi_state != TCP_FIN_WAIT2)
                RS_SET(c->tcp_eof, 1);                      /* the peer's FIN, behind our own SHUT_RD */
            rs_fd_leave(c);
        }
    }
    return RS_GET(c->tcp_eof);
}

/* Sleeps until the TCP socket is readable (a doorbell, or the peer's end) or timeout_ms
 * passes.  Returns 1 woken, 0 timed out, -errno (EINTR).
 *
 * With no timeout the sleep is a blocking recv(MSG_PEEK) on a duplicate of the socket, so
 * the kernel's own rules apply: a signal whose handler has SA_RESTART restarts it, any
 * other interrupts it (EINTR), as for a recv on a TCP socket; and the duplicate keeps the
 * socket, as a kernel recv would, even if the application closes its number meanwhile.
 * With a timeout (SO_RCVTIMEO, or the caller's) it is a poll, which a signal always
 * interrupts: that too is what a TCP recv with SO_RCVTIMEO does (signal(7)); it wakes at
 * least every RS_WAIT_SLICE_MS to look again.  rdma always takes the poll: its own queue
 * pair can fail while it sleeps, with no byte on the socket to say so. */
#define RS_WAIT_SLICE_MS 500
int rs_wait_fd(rs_conn *c, int timeout_ms)
{
    c->rx.sleeps++;
    short out = rs_tx_switch(c) ? 0 : POLLOUT;          /* room for our SWITCH wakes us too */
    if (timeout_ms < 0 && !c->rdma && !out) {
        int fd = rs_fd_enter(c);
        int own = (int)syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, 1024);
        if (own < 0) own = (int)syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, 0);
        rs_fd_leave(c);
        if (own >= 0) {
            uint8_t b;
            long r = syscall(SYS_recvfrom, own, &b, 1, MSG_PEEK, NULL, NULL);
            int e = errno;
            syscall(SYS_close, own);
            if (r >= 0 || e != EAGAIN) {             /* EAGAIN: O_NONBLOCK set meanwhile: poll */
                if (r == 0 && !RS_GET(c->rx.shut_rd)) RS_SET(c->tcp_eof, 1);
                if (r < 0 && e == EINTR) return -EINTR;
                if (r < 0) { note_sock_error(c, e); RS_SET(c->tcp_eof, 1); }
                return 1;
            }
        }
    }
    short re;
    int slice = timeout_ms < 0 || timeout_ms > RS_WAIT_SLICE_MS ? RS_WAIT_SLICE_MS : timeout_ms;
    int r = rs_c_poll(c, POLLIN | POLLRDHUP | out, slice, &re);
    if (r == -EINTR && timeout_ms < 0 && rs_restart_after_signal()) return 1;
    if (r > 0 && (re & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL))) rs_peer_gone(c);
    return r;
}
