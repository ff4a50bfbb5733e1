/* rs_ready.c - readiness of one upgraded socket, for the waiting hooks (rs_hooks_poll.c,
 * rs_hooks_epoll.c).
 *
 * The kernel already tells the truth about readability: a consumer with unconsumed
 * records and nobody in recv always has a doorbell byte pending (rs_doorbell.c).  What
 * the kernel cannot see is the ring itself, so the hooks (1) answer from the ring first,
 * (2) spin on it for a bounded budget before sleeping, since the peer is often about to
 * answer, (3) arm the doorbells (rs_rx_go_idle) before sleeping in the kernel, and (4)
 * report POLLOUT from ring credit rather than from the TCP socket, sleeping on the credit
 * doorbell while the ring is full.
 */
#include "rs_preload.h"
#include <stdlib.h>

static uint64_t spin_max = 1000000;    /* RDMASOCK_SPIN_US */
/* The poll/select/epoll hooks' spin budget, one per thread (rs_spin, rs_wait.h). */
static __thread struct rs_spin wait_spin = { 1000000, 1000000 };

__attribute__((constructor)) static void ready_init(void)
{
    spin_max = strtoull(rs_config_get(RS_CFG_SPIN_US), NULL, 10) * 1000u;
    rs_spin_init(&wait_spin, spin_max);
}

struct rs_spin *rs_wait_spin(void)
{
    if (wait_spin.max != spin_max) rs_spin_init(&wait_spin, spin_max);   /* a thread born before the constructor ran */
    return &wait_spin;
}

struct rs_sock *rs_waited_sock(int fd)
{
    if (rs_in_engine) return NULL;
    rs_adopt_if_due(fd);
    return rs_sock_of(fd);
}

/* During a server's preamble too: writability is the ring's, and the client's frames are
 * readable data (rs_rx_ready).  fb_done: plain TCP again. */
int rs_ring_answers(struct rs_sock *s)
{
    return rs_sock_state(s) == RS_RING && !__atomic_load_n(&s->conn->fb_done, __ATOMIC_ACQUIRE);
}

struct rs_sock *rs_ring_sock(int fd)
{
    struct rs_sock *s = rs_waited_sock(fd);
    if (!s || rs_ring_answers(s)) return s;
    rs_sock_put(s);
    return NULL;
}

struct rs_sock *rs_handshake_sock(int fd)
{
    struct rs_sock *s = rs_waited_sock(fd);
    if (!s) return NULL;
    if (rs_sock_in_handshake(s)) return s;
    rs_sock_put(s);
    return NULL;
}

int rs_only_handshake(struct rs_sock *s)
{
    int st = rs_sock_state(s);
    return st == RS_CLIENT_HS || st == RS_SERVER_HS;
}

short rs_ring_revents(rs_conn *c, short events)
{
    short r = 0;
    if (RS_GET(c->err)) r |= POLLERR;
    if (RS_GET(c->tcp_eof)) r |= POLLHUP;
    /* a peer gone: a read returns the end of the stream or the reset, as over TCP, whose
     * socket is then readable too (a wait for input that saw only POLLHUP would never read) */
    if ((events & (POLLIN | POLLRDNORM)) && (RS_GET(c->tcp_eof) || rs_rx_ready(c))) r |= events & (POLLIN | POLLRDNORM);
    if ((events & POLLRDHUP) && (c->rx.fin_seen || RS_GET(c->tcp_eof))) r |= POLLRDHUP;
    if ((events & (POLLOUT | POLLWRNORM)) && rs_tx_writable(c)) r |= events & (POLLOUT | POLLWRNORM);
    return r;
}

/* Arms one upgraded socket for a kernel sleep (`bell`: one that its event bell wakes too,
 * rs_bells.c).  Returns 1 if it is ready after all. */
int rs_ring_arm(rs_conn *c, short events, int bell)
{
    rs_tx_switch(c);                             /* our own SWITCH, if the socket had no room for it before */
    if (RS_GET(c->rx.pre.active)) rs_pre_settle(c);     /* a SWITCH left unread would keep the kernel's wait awake */
    /* Only a wait for input arms the receive side: going idle reads doorbells off the
     * socket, and a writer's wait must not take the one that another thread, asleep in
     * a wait for input on the same socket, is to wake on. */
    int ready = (events & (POLLIN | POLLRDNORM)) && (bell ? rs_rx_go_idle_event(c) : rs_rx_go_idle(c));
    /* Credit published since the spin looked (without a doorbell: nobody had asked for one)
     * makes the socket writable now; sleeping then would wait for a doorbell never sent. */
    if ((events & (POLLOUT | POLLWRNORM)) && (rs_tx_writable(c) || rs_tx_arm_credit(c) || rs_tx_writable(c)))
        ready = 1;
    return ready || RS_GET(c->err) || RS_GET(c->tcp_eof);
}

/* Arms one upgraded socket, waited on for input only, for a sleep on the word its peer
 * raises with the next record (FUTEX_WAKE) instead of a kernel sleep on the socket.
 * Returns 1 if it is ready after all, 0 armed (*word, *seen for rs_words_wait), -1 not
 * possible (other events wanted, a preamble or resend on the socket, no word). */
int rs_ring_arm_word(rs_conn *c, short events, const uint32_t **word, uint32_t *seen)
{
    if (events & ~(POLLIN | POLLRDNORM | POLLRDHUP | POLLERR | POLLHUP | POLLNVAL)) return -1;
    if (!c->word_wake_ok || !rs_tx_switch(c) || RS_GET(c->rx.pre.active) || rs_fb_tx_pending(c)) return -1;
    rs_lock(&c->rx.lock);
    int r = rs_rx_arm_word_locked(c, word, seen, 0, -1);   /* its program may not read: never quiet */
    rs_unlock(&c->rx.lock);
    if (r < 0) return -1;
    return r || RS_GET(c->err) || RS_GET(c->tcp_eof);
}

/* How long a kernel sleep may last for a socket armed with `events` (-1: no limit).  A
 * wait for room in a full ring looks again as the transport asks (room_recheck_ms): its
 * credit doorbell can be read off the socket by another thread of the program going idle
 * on the same socket (a reader and a writer thread), only a look moves a stalled shm ring
 * to TCP (rs_fallback.c), and only a look probes an rdma link whose credit WRITE may never
 * arrive, and only a look fills the hold of a program that writes before it reads
 * (rs_hold.c).  Room that came since the arming: no sleep at all. */
int rs_ring_sleep_cap_ms(rs_conn *c, short events)
{
    if (!(events & (POLLOUT | POLLWRNORM))) return -1;
    if (rs_tx_writable(c)) return 0;
    return rs_min_ms(c->ops->room_recheck_ms ? c->ops->room_recheck_ms : -1, rs_hold_recheck_ms(c));
}

/* The shorter of two kernel sleep limits (-1: none). */
int rs_min_ms(int a, int b)
{
    if (a < 0) return b;
    if (b < 0) return a;
    return a < b ? a : b;
}

int rs_ts_ms(const struct timespec *ts)
{
    if (!ts) return -1;
    long long ms = (long long)ts->tv_sec * 1000 + (ts->tv_nsec + 999999) / 1000000;
    return ms > 0x7fffffff ? 0x7fffffff : (int)ms;
}
