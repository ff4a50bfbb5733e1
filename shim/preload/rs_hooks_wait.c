/* rs_hooks_wait.c - poll, ppoll, select, pselect, epoll on upgraded sockets.
 *
 * The kernel already tells the truth about readability: a consumer with unconsumed
 * records and nobody in recv always has a doorbell byte pending (rs_doorbell.c).  What
 * the kernel cannot see is the ring itself, so these hooks (1) answer from the ring
 * first, (2) spin on it for a bounded budget before sleeping, since the peer is often
 * about to answer, (3) arm the doorbells (rs_rx_go_idle) before sleeping in the kernel,
 * and (4) report POLLOUT from ring credit rather than from the TCP socket, sleeping on
 * the credit doorbell while the ring is full.
 */
#include "rs_preload.h"
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t spin_ns = 1000000;     /* RDMASOCK_SPIN_US, default 1000 us (adaptive below it) */
static __thread uint64_t spin_cur = 1000000;  /* adaptive, <= spin_ns (see rs_consume.c) */

/* Spins share the CPU (rs_spin_pause); the budget halves when a spin found nothing and
 * doubles when it did. */
static inline uint64_t spin_budget(void) { return spin_cur < spin_ns ? spin_cur : spin_ns; }
/* A wait whose spin ran out but whose data came after `waited_ns` in all: had the spin
 * lasted that long it would have saved the kernel sleep and the doorbell, whose cross-CPU
 * wake-up alone costs tens of microseconds.  So a peer that answers within the maximum
 * budget (a database statement, say) is waited for by spinning, not by halving the
 * budget on every slow answer; only answers slower than the maximum shrink it. */
static inline void spin_missed(uint64_t waited_ns)
{
    if (waited_ns < spin_ns) {
        uint64_t want = 2 * waited_ns + 1000;
        spin_cur = want > spin_ns ? spin_ns : want > spin_cur ? want : spin_cur;
    }
}
static inline void spin_result(int found)
{
    if (found) spin_cur = spin_cur * 2 > spin_ns ? spin_ns : (spin_cur ? spin_cur * 2 : 1000);
    else if (spin_cur > spin_ns / 64 + 500) spin_cur /= 2;
}

__attribute__((constructor)) static void wait_init(void)
{
    const char *v = getenv("RDMASOCK_SPIN_US");
    if (v && *v) spin_ns = strtoull(v, NULL, 10) * 1000u;
    spin_cur = spin_ns;
}

/* An upgraded socket whose readiness the ring answers.  While the client's preamble
 * (ending in SWITCH) is still on the TCP socket, the kernel answers. */
static inline struct rs_link *ring_link(int fd)
{
    struct rs_link *l = rs_link_of(fd);
    return l && !rs_in_engine && __atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == RS_RING && !l->conn->rx_pre &&
           !__atomic_load_n(&l->conn->fb_done, __ATOMIC_ACQUIRE) ? l : NULL;   /* fb_done: plain TCP again */
}

/* Handshake, or a server still expecting the client's SWITCH: bytes on the kernel socket
 * may not be application data. */
static inline int in_handshake(struct rs_link *l)
{
    int s = l && !rs_in_engine ? __atomic_load_n(&l->state, __ATOMIC_ACQUIRE) : RS_PLAIN;
    return s == RS_CLIENT_HS || s == RS_SERVER_HS || (s == RS_RING && l->conn->rx_pre);
}

/* One non-blocking step towards the end of the handshake / preamble. */
static inline void settle(int fd, struct rs_link *l)
{
    rs_step(fd, l, 0);
    if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == RS_RING) rs_pre_settle(l->conn);
}

/* After settling: still nothing but handshake bytes could be waiting. */
static inline int only_handshake(struct rs_link *l)
{
    int s = __atomic_load_n(&l->state, __ATOMIC_ACQUIRE);
    return s == RS_CLIENT_HS || s == RS_SERVER_HS;
}

static short ring_revents(rs_conn *c, short events)
{
    short r = 0;
    if (c->err) r |= POLLERR;
    if (c->tcp_eof) r |= POLLHUP;
    if ((events & (POLLIN | POLLRDNORM)) && rs_rx_ready(c)) r |= events & (POLLIN | POLLRDNORM);
    if ((events & POLLRDHUP) && (c->fin_seen || c->tcp_eof)) r |= POLLRDHUP;
    if ((events & (POLLOUT | POLLWRNORM)) && rs_tx_writable(c)) r |= events & (POLLOUT | POLLWRNORM);
    return r;
}

/* Arms one upgraded socket for a kernel sleep.  Returns 1 if it is ready after all. */
static int arm(rs_conn *c, short events)
{
    int ready = rs_rx_go_idle(c) && (events & (POLLIN | POLLRDNORM));
    /* Credit published since the spin looked (without a doorbell: nobody had asked for one)
     * makes the socket writable now; sleeping then would wait for a doorbell never sent. */
    if ((events & (POLLOUT | POLLWRNORM)) && (rs_tx_writable(c) || rs_tx_arm_credit(c) || rs_tx_writable(c)))
        ready = 1;
    return ready || c->err || c->tcp_eof;
}

static int kernel_poll(struct pollfd *fds, nfds_t n, int timeout_ms, const sigset_t *mask)
{
    if (!mask) return rs_real.poll(fds, n, timeout_ms);
    struct timespec ts = { timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L };
    return rs_real.ppoll(fds, n, timeout_ms < 0 ? NULL : &ts, mask);
}

static uint64_t now_ns(void) { return rs_now_ns(); }

/* The upgraded entries of fds get their readiness from the ring; the rest from the
 * kernel (asked with a zero timeout).  Returns the number of ready entries. */
static int collect(struct pollfd *fds, nfds_t n, struct rs_link **links, short *want)
{
    int k = kernel_poll(fds, n, 0, NULL);
    if (k < 0) return k;
    int ready = 0;
    for (nfds_t i = 0; i < n; i++) {
        if (links[i]) fds[i].revents = ring_revents(links[i]->conn, want[i]);
        if (fds[i].revents) ready++;
    }
    return ready;
}

#define POLL_STACK 256

static int poll_rings(struct pollfd *fds, nfds_t n, int timeout_ms, const sigset_t *mask)
{
    struct rs_link *lbuf[POLL_STACK], **links = lbuf;
    short wbuf[POLL_STACK], *want = wbuf;
    nfds_t nring = 0;
    for (nfds_t i = 0; i < n; i++)
        if (ring_link(fds[i].fd)) nring++;
    if (!nring) return kernel_poll(fds, n, timeout_ms, mask);
    if (n > POLL_STACK) {
        links = malloc(n * sizeof *links);
        want = malloc(n * sizeof *want);
        if (!links || !want) { free(links); free(want); return kernel_poll(fds, n, timeout_ms, mask); }
    }
    for (nfds_t i = 0; i < n; i++) {
        links[i] = ring_link(fds[i].fd);
        want[i] = fds[i].events;
        if (links[i]) fds[i].events = POLLIN | POLLRDHUP;   /* doorbells (data and credit) */
    }
    uint64_t start = now_ns();
    uint64_t deadline = timeout_ms < 0 ? UINT64_MAX : start + (uint64_t)timeout_ms * 1000000u;
    int r, apart = 0;                   /* spin only for a peer on another CPU */
    for (nfds_t i = 0; i < n; i++)
        if (links[i] && !rs_peer_shares_cpu(links[i]->conn)) apart = 1;
    for (;;) {
        /* answer from the ring first; spin while the peer is likely to answer soon */
        uint64_t t0 = now_ns(), spin_end = t0 + (apart ? spin_budget() : 0);
        if (spin_end > deadline) spin_end = deadline;
        for (unsigned it = 0;; it++) {
            int any = 0;
            for (nfds_t i = 0; i < n && !any; i++)
                if (links[i] && ring_revents(links[i]->conn, want[i])) any = 1;
            if (any || (it & 15) == 15) {
                r = collect(fds, n, links, want);
                if (r != 0) { if (timeout_ms && apart) spin_result(1); goto out; }
            }
            if (now_ns() >= spin_end) break;
            rs_spin_pause(now_ns() - t0);
        }
        if (timeout_ms && apart) spin_result(0);
        if (timeout_ms == 0 || now_ns() >= deadline) { r = collect(fds, n, links, want); goto out; }
        int armed_ready = 0;
        for (nfds_t i = 0; i < n; i++)
            if (links[i] && arm(links[i]->conn, want[i])) armed_ready = 1;
        if (armed_ready) { r = collect(fds, n, links, want); if (r) goto out; continue; }
        int ms = -1;
        if (deadline != UINT64_MAX) {
            uint64_t t = now_ns();
            ms = t >= deadline ? 0 : (int)((deadline - t + 999999u) / 1000000u);
        }
        for (nfds_t i = 0; i < n; i++)      /* a resend after an RDMA failure must get out */
            if (links[i]) fds[i].events = POLLIN | POLLRDHUP | (rs_fb_tx_pending(links[i]->conn) ? POLLOUT : 0);
        r = kernel_poll(fds, n, ms, mask);
        if (r < 0) goto out;
        r = collect(fds, n, links, want);
        if (r && apart) spin_missed(now_ns() - start);
        if (r || now_ns() >= deadline) goto out;
        /* only a stale doorbell or a credit that is not enough yet: sleep again */
    }
out:
    for (nfds_t i = 0; i < n; i++)
        if (links[i]) fds[i].events = want[i];
    if (links != lbuf) { free(links); free(want); }
    return r;
}

/* Sockets still in the handshake: the HELLO or ACCEPT waiting in the kernel socket makes
 * it readable, but it is not the application's data.  Such a socket is settled (one
 * non-blocking handshake step) before the wait and again when the kernel reports it; a
 * wake-up that was only the handshake is not reported and the wait goes on. */
static int poll_common(struct pollfd *fds, nfds_t n, int timeout_ms, const sigset_t *mask)
{
    uint64_t deadline = timeout_ms < 0 ? UINT64_MAX : now_ns() + (uint64_t)timeout_ms * 1000000u;
    for (;;) {
        uint8_t hs_buf[POLL_STACK];
        int any_hs = 0;
        for (nfds_t i = 0; i < n; i++) {
            struct rs_link *l = rs_link_of(fds[i].fd);
            if (in_handshake(l)) settle(fds[i].fd, l);
            int still = in_handshake(l);
            if (i < POLL_STACK) hs_buf[i] = (uint8_t)still;
            any_hs |= still;
        }
        int ms = -1;
        if (deadline != UINT64_MAX) {
            uint64_t t = now_ns();
            ms = t >= deadline ? 0 : (int)((deadline - t + 999999u) / 1000000u);
        }
        int r = poll_rings(fds, n, ms, mask);
        if (r <= 0 || !any_hs || n > POLL_STACK) return r;
        int count = 0, settled = 0;
        for (nfds_t i = 0; i < n; i++) {
            if (hs_buf[i] && (fds[i].revents & POLLIN)) {
                struct rs_link *l = rs_link_of(fds[i].fd);
                settle(fds[i].fd, l);
                settled = 1;
                if (only_handshake(l)) {
                    fds[i].revents &= (short)~(POLLIN | POLLRDNORM);
                } else {
                    struct pollfd one = { .fd = fds[i].fd, .events = fds[i].events };
                    poll_rings(&one, 1, 0, NULL);
                    fds[i].revents = one.revents;
                }
            }
            if (fds[i].revents) count++;
        }
        if (count || !settled || (deadline != UINT64_MAX && now_ns() >= deadline)) return count;
    }
}

RS_EXPORT int poll(struct pollfd *fds, nfds_t n, int timeout_ms)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (!rs_nlinks || rs_in_engine) return rs_real.poll(fds, n, timeout_ms);
    return poll_common(fds, n, timeout_ms, NULL);
}

RS_EXPORT int __poll_chk(struct pollfd *fds, nfds_t n, int timeout_ms, size_t fdslen)
{
    if (fdslen / sizeof *fds < n) abort();
    return poll(fds, n, timeout_ms);
}

RS_EXPORT int __ppoll_chk(struct pollfd *fds, nfds_t n, const struct timespec *ts, const sigset_t *mask, size_t fdslen)
{
    if (fdslen / sizeof *fds < n) abort();
    return ppoll(fds, n, ts, mask);
}

static int ts_ms(const struct timespec *ts)
{
    if (!ts) return -1;
    long long ms = (long long)ts->tv_sec * 1000 + (ts->tv_nsec + 999999) / 1000000;
    return ms > 0x7fffffff ? 0x7fffffff : (int)ms;
}

RS_EXPORT int ppoll(struct pollfd *fds, nfds_t n, const struct timespec *ts, const sigset_t *mask)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (!rs_nlinks || rs_in_engine) return rs_real.ppoll(fds, n, ts, mask);
    int any = 0;
    for (nfds_t i = 0; i < n && !any; i++) any = ring_link(fds[i].fd) || in_handshake(rs_link_of(fds[i].fd));
    if (!any) return rs_real.ppoll(fds, n, ts, mask);
    return poll_common(fds, n, ts_ms(ts), mask);
}

/* select/pselect become a poll when an upgraded socket is in the sets. */
static int select_common(int nfds, fd_set *r, fd_set *w, fd_set *e, int timeout_ms, const sigset_t *mask, int *handled)
{
    *handled = 0;
    if (nfds > FD_SETSIZE) nfds = FD_SETSIZE;
    int any = 0;
    for (int fd = 0; fd < nfds && !any; fd++)
        if (((r && FD_ISSET(fd, r)) || (w && FD_ISSET(fd, w))) && (ring_link(fd) || in_handshake(rs_link_of(fd)))) any = 1;
    if (!any) return 0;
    *handled = 1;
    struct pollfd p[FD_SETSIZE];
    nfds_t n = 0;
    for (int fd = 0; fd < nfds; fd++) {
        short ev = 0;
        if (r && FD_ISSET(fd, r)) ev |= POLLIN;
        if (w && FD_ISSET(fd, w)) ev |= POLLOUT;
        if (e && FD_ISSET(fd, e)) ev |= POLLPRI;
        if (ev) { p[n].fd = fd; p[n].events = ev; p[n].revents = 0; n++; }
    }
    int rc = poll_common(p, n, timeout_ms, mask);
    if (rc < 0) return rc;
    if (r) FD_ZERO(r);
    if (w) FD_ZERO(w);
    if (e) FD_ZERO(e);
    int count = 0;
    for (nfds_t i = 0; i < n; i++) {
        short re = p[i].revents;
        if (re & POLLNVAL) { errno = EBADF; return -1; }
        if (r && (re & (POLLIN | POLLHUP | POLLERR)) && (p[i].events & POLLIN)) { FD_SET(p[i].fd, r); count++; }
        if (w && (re & (POLLOUT | POLLERR)) && (p[i].events & POLLOUT)) { FD_SET(p[i].fd, w); count++; }
        if (e && (re & POLLPRI)) { FD_SET(p[i].fd, e); count++; }
    }
    return count;
}

RS_EXPORT int select(int nfds, fd_set *r, fd_set *w, fd_set *e, struct timeval *tv)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (rs_nlinks && !rs_in_engine) {
        int handled;
        int ms = tv ? (int)(tv->tv_sec * 1000 + (tv->tv_usec + 999) / 1000) : -1;
        int rc = select_common(nfds, r, w, e, ms, NULL, &handled);
        if (handled) {
            if (tv && rc >= 0) tv->tv_sec = tv->tv_usec = 0;   /* Linux updates the timeout */
            return rc;
        }
    }
    return rs_real.select(nfds, r, w, e, tv);
}

RS_EXPORT int pselect(int nfds, fd_set *r, fd_set *w, fd_set *e, const struct timespec *ts, const sigset_t *mask)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (rs_nlinks && !rs_in_engine) {
        int handled;
        int rc = select_common(nfds, r, w, e, ts_ms(ts), mask, &handled);
        if (handled) return rc;
    }
    return rs_real.pselect(nfds, r, w, e, ts, mask);
}

RS_EXPORT long int __fdelt_chk(long int d)
{
    if (d < 0 || d >= FD_SETSIZE) abort();
    return d / __NFDBITS;
}

/* ---- epoll --------------------------------------------------------------------------
 * The kernel registration stays the application's (doorbells make it truthful for
 * EPOLLIN); we remember, per epoll instance, which members are tracked sockets so that
 * epoll_wait can answer from their rings and spin before sleeping. */
/* et_mark: for EPOLLET, the producer's byte count when we last reported the ring readable
 * (an edge is new data since then).  disarmed: EPOLLONESHOT fired, until EPOLL_CTL_MOD. */
struct ep_member { int fd; uint32_t events; epoll_data_t data; uint64_t et_mark; int disarmed; };
struct ep_set { int n, cap; struct ep_member *m; };
static struct ep_set *ep_sets[RS_MAXFD];
static int ep_max = -1;                 /* highest epfd with a set */
static pthread_mutex_t ep_lock = PTHREAD_MUTEX_INITIALIZER;

static void drop_member(struct ep_set *s, int fd)
{
    for (int i = 0; i < s->n; i++)
        if (s->m[i].fd == fd) { s->m[i] = s->m[--s->n]; return; }
}

int rs_ep_is_set(int fd) { return (unsigned)fd < RS_MAXFD && ep_sets[fd]; }

/* A tracked fd was closed: the kernel dropped its registrations, so do we (its number
 * may be reused by a socket the application registers with other data). */
void rs_ep_forget(int fd)
{
    pthread_mutex_lock(&ep_lock);
    for (int e = 0; e <= ep_max; e++)
        if (ep_sets[e]) drop_member(ep_sets[e], fd);
    if ((unsigned)fd < RS_MAXFD && ep_sets[fd]) {          /* fd was itself an epoll instance */
        free(ep_sets[fd]->m);
        free(ep_sets[fd]);
        ep_sets[fd] = NULL;
    }
    pthread_mutex_unlock(&ep_lock);
}

static void ep_remember(int epfd, int op, int fd, const struct epoll_event *ev)
{
    if ((unsigned)epfd >= RS_MAXFD) return;
    pthread_mutex_lock(&ep_lock);
    struct ep_set *s = ep_sets[epfd];
    int i = 0;
    if (s) for (; i < s->n && s->m[i].fd != fd; i++) {}
    if (op == EPOLL_CTL_DEL) {
        if (s && i < s->n) s->m[i] = s->m[--s->n];
    } else if (ev) {
        if (!s) {
            s = ep_sets[epfd] = calloc(1, sizeof *s);
            if (epfd > ep_max) ep_max = epfd;
        }
        if (s && i == s->n) {
            if (s->n == s->cap) {
                int cap = s->cap ? s->cap * 2 : 8;
                struct ep_member *m = realloc(s->m, (size_t)cap * sizeof *m);
                if (!m) { pthread_mutex_unlock(&ep_lock); return; }
                s->m = m; s->cap = cap;
            }
            s->n++;
        }
        if (s) {
            s->m[i].fd = fd; s->m[i].events = ev->events; s->m[i].data = ev->data;
            s->m[i].et_mark = (uint64_t)-1; s->m[i].disarmed = 0;
        }
    }
    pthread_mutex_unlock(&ep_lock);
}

/* Registrations of a socket made before it became a link (registered, then connected, as
 * some event loops do).  connect adopts them (rs_ep_adopt): without that, waits on the
 * socket would go to the kernel alone, never arm, and a reader that reads until EAGAIN
 * would not be woken.  One registration per fd is kept; a second epoll instance makes
 * it unknown (n = 2). */
struct ep_early { int epfd; uint32_t events; epoll_data_t data; uint8_t n; };
static struct ep_early ep_early[RS_MAXFD];

static void ep_note_early(int epfd, int op, int fd, const struct epoll_event *ev)
{
    if ((unsigned)fd >= RS_MAXFD) return;
    pthread_mutex_lock(&ep_lock);
    struct ep_early *e = &ep_early[fd];
    if (op == EPOLL_CTL_DEL) {
        if (e->n == 1 && e->epfd == epfd) e->n = 0;
    } else if (ev && e->n != 2) {
        if (e->n == 1 && e->epfd != epfd) e->n = 2;
        else { e->epfd = epfd; e->events = ev->events; e->data = ev->data; e->n = 1; }
    }
    pthread_mutex_unlock(&ep_lock);
}

/* fd was closed or is new (accepted): no registration of an earlier file is its own. */
void rs_ep_fd_fresh(int fd)
{
    if ((unsigned)fd < RS_MAXFD && __atomic_load_n(&ep_early[fd].n, __ATOMIC_RELAXED)) {
        pthread_mutex_lock(&ep_lock);
        ep_early[fd].n = 0;
        pthread_mutex_unlock(&ep_lock);
    }
}

/* fd just became a link: take over its earlier registration.  Returns 1 if every epoll
 * registration of the socket is now known (or there is none), 0 if not: a one-shot (its
 * state cannot be read back without re-arming it) or more than one epoll instance. */
int rs_ep_adopt(int fd)
{
    if ((unsigned)fd >= RS_MAXFD) return 1;
    pthread_mutex_lock(&ep_lock);
    struct ep_early e = ep_early[fd];
    ep_early[fd].n = 0;
    pthread_mutex_unlock(&ep_lock);
    if (!e.n) return 1;
    if (e.n == 2 || (e.events & EPOLLONESHOT)) return 0;
    /* Is it still registered there (the epoll fd may have been closed and its number
     * reused)?  MOD to the same events and data changes nothing else. */
    struct epoll_event ev = { .events = e.events, .data = e.data };
    if (rs_real.epoll_ctl(e.epfd, EPOLL_CTL_MOD, fd, &ev) != 0) return errno == ENOENT || errno == EBADF || errno == EINVAL;
    ep_remember(e.epfd, EPOLL_CTL_ADD, fd, &ev);
    return 1;
}

RS_EXPORT int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    int r = rs_real.epoll_ctl(epfd, op, fd, ev);
    if (r == 0 && !rs_in_engine) {
        int e = errno;
        int link = rs_link_of(fd) != NULL;
        if (link || op == EPOLL_CTL_DEL) ep_remember(epfd, op, fd, ev);
        if (!link) ep_note_early(epfd, op, fd, ev);
        errno = e;
    }
    return r;
}

/* Events from the rings of the tracked members that the kernel did not report. */
static int ep_from_rings(int epfd, struct ep_set *s, struct epoll_event *out, int have, int max)
{
    int n = have;
    for (int i = 0; i < s->n && n < max; i++) {
        struct rs_link *l = ring_link(s->m[i].fd);
        if (!l || s->m[i].disarmed) continue;
        uint64_t produced = rs_rx_produced(l->conn);
        if ((s->m[i].events & EPOLLET) && produced == s->m[i].et_mark && !l->conn->fin_seen) continue;
        short want = (s->m[i].events & EPOLLIN ? POLLIN : 0) | (s->m[i].events & EPOLLOUT ? POLLOUT : 0) |
                     (s->m[i].events & EPOLLRDHUP ? POLLRDHUP : 0);
        short re = ring_revents(l->conn, want);
        if (!(re & (POLLIN | POLLRDHUP | POLLHUP | POLLERR))) continue;   /* EPOLLOUT: the kernel says */
        int dup = 0;
        for (int j = 0; j < have && !dup; j++) dup = out[j].data.u64 == s->m[i].data.u64;
        if (dup) continue;
        out[n].events = (re & POLLIN ? EPOLLIN : 0) | (re & POLLRDHUP ? EPOLLRDHUP : 0) |
                        (re & POLLHUP ? EPOLLHUP : 0) | (re & POLLERR ? EPOLLERR : 0);
        out[n].data = s->m[i].data;
        n++;
        s->m[i].et_mark = produced;
        if (s->m[i].events & EPOLLONESHOT) {
            /* fired: disable the kernel registration too, as EPOLLONESHOT does */
            struct epoll_event off = { .events = 0, .data = s->m[i].data };
            rs_real.epoll_ctl(epfd, EPOLL_CTL_MOD, s->m[i].fd, &off);
            s->m[i].disarmed = 1;
        }
    }
    return n;
}

/* The kernel's EPOLLOUT only says the TCP socket has room; for an upgraded socket the ring
 * must have it.  Drops EPOLLOUT for full rings (asking the peer for a credit doorbell) and
 * returns how many events remain. */
static int ep_filter_out(int epfd, struct ep_set *s, struct epoll_event *ev, int k)
{
    int n = 0;
    for (int j = 0; j < k; j++) {
        for (int i = 0; i < s->n; i++) {
            if (s->m[i].data.u64 != ev[j].data.u64) continue;
            struct rs_link *hl = rs_link_of(s->m[i].fd);
            if (in_handshake(hl)) {
                /* woken by handshake bytes: settle, and report only the application's data */
                settle(s->m[i].fd, hl);
                struct rs_link *rl = ring_link(s->m[i].fd);
                if (only_handshake(hl) || (rl && !rs_rx_ready(rl->conn)))
                    ev[j].events &= ~(uint32_t)(EPOLLIN | EPOLLRDNORM);
            }
            struct rs_link *l = ring_link(s->m[i].fd);
            if (!l) break;
            /* the kernel's EPOLLIN may be a doorbell of records already consumed (no tidy
             * under the preload, rs_doorbell.c): the ring says whether data is there */
            if ((ev[j].events & (EPOLLIN | EPOLLRDNORM)) && !(ev[j].events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR)) &&
                !rs_rx_ready(l->conn)) {
                ev[j].events &= ~(uint32_t)(EPOLLIN | EPOLLRDNORM);
                if (!ev[j].events && (s->m[i].events & EPOLLONESHOT)) {
                    /* the kernel's one shot went on a stale doorbell: arm it again */
                    struct epoll_event again = { .events = s->m[i].events, .data = s->m[i].data };
                    rs_real.epoll_ctl(epfd, EPOLL_CTL_MOD, s->m[i].fd, &again);
                    break;
                }
            }
            if ((ev[j].events & EPOLLOUT) && !rs_tx_writable(l->conn)) {
                if (!rs_tx_arm_credit(l->conn) && !rs_tx_writable(l->conn)) ev[j].events &= ~(uint32_t)EPOLLOUT;
            }
            /* the kernel's report counts as ours: no second edge, no second one-shot */
            if (ev[j].events & EPOLLIN) s->m[i].et_mark = rs_rx_produced(l->conn);
            if (s->m[i].events & EPOLLONESHOT) s->m[i].disarmed = 1;
            break;
        }
        if (ev[j].events) ev[n++] = ev[j];
    }
    return n;
}

/* Settles members still in the handshake; 1 if the set has upgraded or settling members. */
static int ep_has_ring(struct ep_set *s)
{
    if (!s) return 0;
    int any = 0;
    for (int i = 0; i < s->n; i++) {
        struct rs_link *l = rs_link_of(s->m[i].fd);
        if (in_handshake(l)) { settle(s->m[i].fd, l); any = 1; }
        if (ring_link(s->m[i].fd)) any = 1;
    }
    return any;
}

static int epoll_common(int epfd, struct epoll_event *ev, int max, int timeout_ms, const sigset_t *mask)
{
    struct ep_set *s = (unsigned)epfd < RS_MAXFD ? ep_sets[epfd] : NULL;
    if (!ep_has_ring(s) || max <= 0)
        return mask ? rs_real.epoll_pwait(epfd, ev, max, timeout_ms, mask) : rs_real.epoll_wait(epfd, ev, max, timeout_ms);
    uint64_t start = now_ns();
    uint64_t deadline = timeout_ms < 0 ? UINT64_MAX : start + (uint64_t)timeout_ms * 1000000u;
    uint64_t budget = spin_budget(), apart = 0;       /* spin only for a peer on another CPU */
    for (int i = 0; i < s->n && !apart; i++) {
        struct rs_link *l = ring_link(s->m[i].fd);
        if (l && !rs_peer_shares_cpu(l->conn)) apart = 1;
    }
    if (!apart) budget = 0;
    uint64_t spin_end = start + budget < deadline ? start + budget : deadline;
    for (unsigned it = 0;; it++) {
        int k = 0;
        if ((it & 15) == 0) {
            k = rs_real.epoll_wait(epfd, ev, max, 0);
            if (k < 0) return k;
        }
        pthread_mutex_lock(&ep_lock);
        if (k > 0) k = ep_filter_out(epfd, s, ev, k);
        int n = ep_from_rings(epfd, s, ev, k, max);
        pthread_mutex_unlock(&ep_lock);
        if (n) { if (timeout_ms && apart) spin_result(1); return n; }
        if (now_ns() >= spin_end) break;
        rs_spin_pause(now_ns() - start);
    }
    if (timeout_ms && apart) spin_result(0);
    unsigned nap_us = 20;
    for (;;) {
        if (timeout_ms == 0 || now_ns() >= deadline) return 0;
        int ready = 0;
        pthread_mutex_lock(&ep_lock);
        for (int i = 0; i < s->n; i++) {
            struct rs_link *l = ring_link(s->m[i].fd);
            if (l && arm(l->conn, (s->m[i].events & EPOLLIN ? POLLIN : 0))) ready = 1;
        }
        int n = ready ? ep_from_rings(epfd, s, ev, 0, max) : 0;
        int resend = 0;                  /* a resend after an RDMA failure: push it now and then */
        for (int i = 0; i < s->n && !n; i++) {
            struct rs_link *l = ring_link(s->m[i].fd);
            if (l && rs_fb_tx_pending(l->conn)) { rs_fb_kick(l->conn); resend = 1; }
        }
        pthread_mutex_unlock(&ep_lock);
        if (n) return n;
        int ms = -1;
        if (deadline != UINT64_MAX) {
            uint64_t t = now_ns();
            ms = t >= deadline ? 0 : (int)((deadline - t + 999999u) / 1000000u);
        }
        if (resend && (ms < 0 || ms > 10)) ms = 10;
        int k = mask ? rs_real.epoll_pwait(epfd, ev, max, ms, mask) : rs_real.epoll_wait(epfd, ev, max, ms);
        if (k <= 0) return k;
        pthread_mutex_lock(&ep_lock);
        k = ep_filter_out(epfd, s, ev, k);
        pthread_mutex_unlock(&ep_lock);
        if (k && apart) spin_missed(now_ns() - start);
        if (k) return k;               /* doorbells, checked against the ring, make it truthful */
        /* Only "writable" for a full ring: the credit comes through memory; nap and look. */
        struct timespec ts = { 0, (long)nap_us * 1000 };
        nanosleep(&ts, NULL);
        if (nap_us < 1000) nap_us *= 2;
    }
}

RS_EXPORT int epoll_wait(int epfd, struct epoll_event *ev, int max, int timeout_ms)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (!rs_nlinks || rs_in_engine) return rs_real.epoll_wait(epfd, ev, max, timeout_ms);
    return epoll_common(epfd, ev, max, timeout_ms, NULL);
}

RS_EXPORT int epoll_pwait(int epfd, struct epoll_event *ev, int max, int timeout_ms, const sigset_t *mask)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (!rs_nlinks || rs_in_engine) return rs_real.epoll_pwait(epfd, ev, max, timeout_ms, mask);
    return epoll_common(epfd, ev, max, timeout_ms, mask);
}

/* epoll_pwait2 (glibc 2.35+): the same, with the timeout as a timespec (waits on upgraded
 * sockets round it up to whole milliseconds, like ppoll's). */
RS_EXPORT int epoll_pwait2(int epfd, struct epoll_event *ev, int max, const struct timespec *ts, const sigset_t *mask)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (!rs_real.epoll_pwait2) { errno = ENOSYS; return -1; }
    struct ep_set *s = (unsigned)epfd < RS_MAXFD ? ep_sets[epfd] : NULL;
    if (!rs_nlinks || rs_in_engine || !ep_has_ring(s)) return rs_real.epoll_pwait2(epfd, ev, max, ts, mask);
    return epoll_common(epfd, ev, max, ts_ms(ts), mask);
}
