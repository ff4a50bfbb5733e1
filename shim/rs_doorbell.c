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
#include <sched.h>
#include <string.h>
#include <time.h>
#include "rs_conn.h"
#include "rs_sys.h"

uint64_t rs_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);   /* vDSO: no system call */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void rs_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

void rs_spin_pause(uint64_t spun_ns)
{
    if (spun_ns > RS_PURE_SPIN_NS) sched_yield();
    else rs_relax();
}

/* The counter was raised before the send (the consumer's snapshot relies on that order);
 * a byte that never left is taken back so the consumer does not wait to drain it. */
static int send_bell(rs_conn *c, uint8_t kind, uint64_t *counter)
{
    long r = rs_sys_send(c->fd, &kind, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r == 1) { c->stat_bells_sent++; return 1; }
    __atomic_fetch_sub(counter, 1, __ATOMIC_SEQ_CST);
    if (r == -EPIPE || r == -ECONNRESET || r == -ENOTCONN) c->tcp_eof = 1;
    return 0;
}

/* Producer side: after publishing records, wake the consumer if it asked for it. */
void rs_tx_flush_bell(rs_conn *c)
{
    if (c->rdma) { rs_rdma_flush_bell(c); return; }
    struct rs_dir_ctl *k = c->tx_ctl;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);           /* pairs with the consumer's fence */
    if (__atomic_load_n(&k->spinning, __ATOMIC_ACQUIRE) &&
        c->tx_bytes <= __atomic_load_n(&k->spin_limit, __ATOMIC_ACQUIRE))
        return;                                         /* a spinning recv will absorb it */
    if (!__atomic_load_n(&k->want_bell, __ATOMIC_RELAXED)) return;   /* a bell is pending */
    if (__atomic_exchange_n(&k->want_bell, 0, __ATOMIC_SEQ_CST)) {
        __atomic_fetch_add(&k->data_bells, 1, __ATOMIC_SEQ_CST);
        /* Not sent (send buffer full, e.g. of preamble the peer has not read yet): the
         * consumer still wants one, so the next record tries again. */
        if (!send_bell(c, RS_BELL_DATA, &k->data_bells))
            __atomic_store_n(&k->want_bell, 1, __ATOMIC_SEQ_CST);
    }
}

/* Consumer side: wake a producer blocked on a full ring (credit was just published). */
void rs_ring_bell(rs_conn *c, struct rs_dir_ctl *ctl, uint64_t *counter, uint8_t kind)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&ctl->tx_waiting, __ATOMIC_RELAXED)) return;
    if (__atomic_exchange_n(&ctl->tx_waiting, 0, __ATOMIC_SEQ_CST)) {
        __atomic_fetch_add(counter, 1, __ATOMIC_SEQ_CST);
        if (!send_bell(c, kind, counter)) __atomic_store_n(&ctl->tx_waiting, 1, __ATOMIC_SEQ_CST);
    }
}

/* Reads up to `todo` doorbell bytes that were sent before the caller's snapshot. */
static void drain_bells(rs_conn *c, uint64_t todo)
{
    uint8_t buf[256];
    while (todo > 0 && !c->tcp_eof) {
        long n = rs_sys_recv(c->fd, buf, todo < sizeof buf ? todo : sizeof buf, MSG_DONTWAIT);
        if (n == 0 || n == -ECONNRESET || n == -ENOTCONN) { c->tcp_eof = 1; break; }
        if (n < 0) break;                              /* EAGAIN: still in flight */
        for (long i = 0; i < n; i++)
            if (buf[i] != RS_BELL_DATA && buf[i] != RS_BELL_CREDIT)
                rs_conn_set_error(c, EPROTO, "rdmasock: garbage byte 0x%02x on the doorbell channel", buf[i]);
        c->bells_drained += (uint64_t)n;
        todo -= (uint64_t)n;
    }
}

/* With every counted bell drained, anything still readable is either a bell sent after
 * the snapshot, EOF (the peer is gone) or garbage.  Peeking consumes nothing, so the
 * invariant holds; without this an idle nonblocking reader would never see EOF. */
static void check_uncounted(rs_conn *c)
{
    uint8_t buf[64];
    long n = rs_sys_recv(c->fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 || n == -ECONNRESET || n == -ENOTCONN) { c->tcp_eof = 1; return; }
    for (long i = 0; i < n; i++)
        if (buf[i] != RS_BELL_DATA && buf[i] != RS_BELL_CREDIT) {
            rs_conn_set_error(c, EPROTO, "rdmasock: garbage byte 0x%02x on the doorbell channel", buf[i]);
            return;
        }
}

static int go_idle(rs_conn *c, int check);

/* Called by a consumer that found its ring empty.  Returns 1 if a record is there after
 * all (consume it, nothing was drained), 0 if the connection is idle: want_bell is set
 * and every doorbell byte sent before that moment has been read off the socket. */
int rs_rx_go_idle(rs_conn *c)
{
    if (c->rdma) return c->rx_pre ? 0 : rs_rdma_go_idle(c);
    return go_idle(c, 1);
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
    if (!c->lazy_tidy || c->rdma || c->rx_pre) return rs_rx_go_idle(c);
    rs_rx_publish_credit(c, 1);
    if (rs_rx_ready(c)) return 1;
    uint64_t now = rs_now_ns();
    if (now - c->last_peek_ns > 1000000u && !c->tcp_eof) {
        c->last_peek_ns = now;
        check_uncounted(c);
    }
    return 0;
}

/* Producer with a full ring, before it sleeps: ask the consumer for a credit doorbell.
 * Returns 1 if there is room after all. */
int rs_tx_arm_credit(rs_conn *c)
{
    if (c->rdma) return rs_rdma_arm_credit(c);
    __atomic_store_n(&c->tx_ctl->tx_waiting, 1, __ATOMIC_SEQ_CST);
    return rs_tx_writable(c);
}

/* After a recv emptied the ring: if doorbell bytes are outstanding, read them now so a
 * level-triggered select/epoll does not report a readiness that has been consumed.
 * Costs a system call only in episodes where the producer already paid one. */
void rs_rx_tidy(rs_conn *c)
{
    struct rs_dir_ctl *k = c->rx_ctl;
    if (c->rx_pre || !c->rx_ring || c->rdma) return;   /* rdma: the next go_idle drains */
    /* Under the preload library poll/select/epoll look at the ring first, so a stale
     * doorbell costs nothing there, while draining it here re-arms want_bell: the next
     * record then rings again, and a request/response exchange paid a send and a recv
     * system call per message for it.  The stale byte keeps the invariant (6.7). */
    if (c->lazy_tidy) return;
    uint64_t sent = __atomic_load_n(&k->data_bells, __ATOMIC_RELAXED) +
                    __atomic_load_n(&c->tx_ctl->credit_bells, __ATOMIC_RELAXED);
    if (sent > c->bells_drained && !rs_rx_ready(c)) go_idle(c, 0);
}

static int go_idle(rs_conn *c, int check)
{
    struct rs_dir_ctl *k = c->rx_ctl;
    if (c->rx_pre || !c->rx_ring) return 0;     /* preamble bytes on the socket are data */
    if (check) rs_rx_publish_credit(c, 1);      /* really idle: hand back all credit */
    __atomic_store_n(&k->want_bell, 1, __ATOMIC_SEQ_CST);
    /* Snapshot before the re-check: a bell counted here belongs to a record the re-check
     * is guaranteed to see, so draining it cannot strand that record without a bell. */
    uint64_t sent = __atomic_load_n(&k->data_bells, __ATOMIC_SEQ_CST) +
                    __atomic_load_n(&c->tx_ctl->credit_bells, __ATOMIC_SEQ_CST);
    if (rs_rx_ready(c)) return 1;
    if (sent > c->bells_drained) drain_bells(c, sent - c->bells_drained);
    if (check && sent <= c->bells_drained && !c->tcp_eof) check_uncounted(c);
    return 0;
}

/* Sleeps until the TCP socket is readable (a doorbell, or EOF) or timeout_ms passes.
 * Returns 1 woken, 0 timed out, -errno (EINTR). */
int rs_wait_fd(rs_conn *c, int timeout_ms)
{
    struct pollfd p = { .fd = c->fd, .events = POLLIN | POLLRDHUP };
    c->stat_sleeps++;
    int r = rs_sys_poll(&p, 1, timeout_ms);
    if (r > 0 && (p.revents & POLLERR)) {
        /* A peer host that vanished (keepalive timed out, unreachable) is an error, not
         * an end of stream; a reset by a dying peer process stays EOF, as before. */
        int e = rs_sys_sockerr(c->fd);
        if (e == ETIMEDOUT || e == EHOSTUNREACH || e == ENETUNREACH)
            rs_conn_set_error(c, e, "rdmasock: the connection's TCP socket failed: %s", strerror(e));
    }
    if (r > 0 && (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL))) c->tcp_eof = 1;
    return r;
}
