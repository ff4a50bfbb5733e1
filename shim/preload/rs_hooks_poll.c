/* rs_hooks_poll.c - poll, ppoll, select and pselect when an upgraded (or still settling)
 * socket is among the descriptors.  select/pselect become a poll.  Every upgraded socket
 * of a wait is referenced for the whole wait (rs_ready.c for the readiness rules). */
#include "rs_preload.h"
#include <stdlib.h>
#include <time.h>

static int kernel_poll(struct pollfd *fds, nfds_t n, int timeout_ms, const sigset_t *mask)
{
    if (!mask) return rs_real.poll(fds, n, timeout_ms);
    struct timespec ts = { timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L };
    return rs_real.ppoll(fds, n, timeout_ms < 0 ? NULL : &ts, mask);
}

/* The upgraded entries of fds get their readiness from the ring; the rest, and urgent
 * data, from the kernel (asked with a zero timeout, unless `kernel` says none of that is
 * wanted).  Returns the number of ready entries. */
static int collect(struct pollfd *fds, nfds_t n, struct rs_sock **socks, short *want, int kernel)
{
    if (kernel) {
        int k = kernel_poll(fds, n, 0, NULL);
        if (k < 0) return k;
    } else {
        for (nfds_t i = 0; i < n; i++) fds[i].revents = 0;
    }
    int ready = 0;
    for (nfds_t i = 0; i < n; i++) {
        /* The kernel's end of stream on an upgraded socket: its peer may be gone
         * (rs_peer_gone decides), which makes it writable (the write fails) as over TCP.
         * A wait for room alone would otherwise never learn it. */
        if (socks[i] && (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR))) rs_peer_gone(socks[i]->conn);
        /* urgent data comes only over TCP (rs_sock.c send_urgent): the kernel knows */
        if (socks[i]) fds[i].revents = rs_ring_revents(socks[i]->conn, want[i]) | (fds[i].revents & want[i] & POLLPRI);
        if (fds[i].revents) ready++;
    }
    return ready;
}

#define POLL_STACK 256

/* Every entry is an upgraded socket waited on for input whose peer raises a shared word
 * with its records (FUTEX_WAKE): the wait sleeps on those words, for at most `until`,
 * instead of in the kernel.  1 slept or found one ready (look again), 0 not possible
 * here (sleep in the kernel), -1 with errno (EINTR: poll is never restarted). */
static int sleep_on_words(struct rs_sock **socks, short *want, nfds_t n, uint64_t deadline, uint64_t until)
{
    const uint32_t *words[RS_WORDS_MAX];
    uint32_t seen[RS_WORDS_MAX];
    if (n > RS_WORDS_MAX) return 0;
    for (nfds_t i = 0; i < n; i++) {
        int a = socks[i] ? rs_ring_arm_word(socks[i]->conn, want[i], &words[i], &seen[i]) : -1;
        if (a) return a > 0;
    }
    int r = rs_words_wait(words, seen, (int)n, rs_ms_until(rs_earlier(deadline, until)));
    if (r == -EINTR) { errno = EINTR; return -1; }
    return r >= 0;
}

static int poll_rings(struct pollfd *fds, nfds_t n, int timeout_ms, const sigset_t *mask)
{
    struct rs_sock *sbuf[POLL_STACK], **socks = sbuf;
    short wbuf[POLL_STACK], *want = wbuf;
    if (n > POLL_STACK) {
        socks = malloc(n * sizeof *socks);
        want = malloc(n * sizeof *want);
        if (!socks || !want) { free(socks); free(want); return kernel_poll(fds, n, timeout_ms, mask); }
    }
    nfds_t nring = 0;
    int apart = 0;                      /* spin only for a peer on another CPU */
    int kernel = 0;                     /* the kernel has something to say: other descriptors, urgent data */
    for (nfds_t i = 0; i < n; i++) {
        socks[i] = rs_ring_sock(fds[i].fd);
        want[i] = fds[i].events;
        if (!socks[i] || (want[i] & POLLPRI)) kernel = 1;
        if (!socks[i]) continue;
        nring++;
        fds[i].events = POLLIN | POLLRDHUP | (want[i] & POLLPRI);     /* doorbells (data and credit), urgent data */
        if (!rs_peer_shares_cpu(socks[i]->conn)) apart++;
    }
    int r;
    if (!nring) {
        r = kernel_poll(fds, n, timeout_ms, mask);
        goto out;
    }
    uint64_t start = rs_now_ns();
    uint64_t deadline = rs_deadline(timeout_ms);
    uint64_t words_until = mask || kernel ? 0 : start + RS_WORD_WINDOW_MS * 1000000ull;
    unsigned empty_wakes = 0, nap_us = 20;
    for (;;) {
        /* answer from the ring first; spin while the peer is likely to answer soon */
        uint64_t t0 = rs_now_ns(), spin_end = t0 + (apart ? rs_spin_allow(rs_wait_spin()) : 0);
        spin_end = rs_earlier(spin_end, deadline);
        struct rs_sigwait sw = { 0 };
        for (unsigned it = 0;; it++) {
            int any = 0;
            for (nfds_t i = 0; i < n && !any; i++)
                if (socks[i] && rs_ring_revents(socks[i]->conn, want[i])) any = 1;
            if (any || (it & 15) == 15) {
                r = collect(fds, n, socks, want, kernel);
                if (r != 0) { rs_sigwait_end(&sw); if (timeout_ms && apart) rs_spin_result(rs_wait_spin(), 1); goto out; }
            }
            if (rs_now_ns() >= spin_end) break;
            if (rs_spin_pause(rs_now_ns() - t0, &sw)) break;
        }
        if (rs_spin_done(&sw, RS_SIG_EINTR) < 0) { errno = EINTR; r = -1; goto out; }   /* poll is never restarted */
        if (timeout_ms && apart) rs_spin_result(rs_wait_spin(), 0);
        if (timeout_ms == 0 || rs_passed(deadline)) { r = collect(fds, n, socks, want, kernel); goto out; }
        if (!rs_passed(words_until)) {
            int w = sleep_on_words(socks, want, n, deadline, words_until);
            if (w < 0) { r = -1; goto out; }
            if (w > 0) {
                r = collect(fds, n, socks, want, kernel);
                if (r || rs_passed(deadline)) goto out;
                continue;
            }
            words_until = 0;            /* not possible for this set: the kernel from now on */
        }
        int armed_ready = 0;
        for (nfds_t i = 0; i < n; i++)
            if (socks[i] && rs_ring_arm(socks[i]->conn, want[i], 0)) armed_ready = 1;
        /* Ready at arming, yet nothing to report: a record still being written.  Its
         * producer sees the armed flag after it finishes, and rings: sleep for that. */
        if (armed_ready && (r = collect(fds, n, socks, want, kernel)) != 0) goto out;
        int ms = rs_ms_until(deadline);
        for (nfds_t i = 0; i < n; i++) {    /* a resend after an RDMA failure must get out */
            if (!socks[i]) continue;
            fds[i].events = POLLIN | POLLRDHUP | (want[i] & POLLPRI) | (rs_fb_tx_pending(socks[i]->conn) ? POLLOUT : 0);
            ms = rs_min_ms(ms, rs_ring_sleep_cap_ms(socks[i]->conn, want[i]));
        }
        r = kernel_poll(fds, n, ms, mask);
        if (r < 0) goto out;
        r = collect(fds, n, socks, want, kernel);
        if (r && apart) rs_spin_missed(rs_wait_spin(), rs_now_ns() - start);
        if (r || rs_passed(deadline)) goto out;
        /* Only a stale doorbell or a credit that is not enough yet: sleep again.  Woken so
         * again and again, something the arming cannot settle keeps a socket readable: the
         * sleeps start after a nap growing to 1 ms, not in a busy loop. */
        if (empty_wakes++) {
            if (rs_nap((uint64_t)nap_us * 1000, deadline, 1) < 0) { errno = EINTR; r = -1; goto out; }
            if (nap_us < 1000) nap_us *= 2;
        }
    }
out:;
    int e = errno;                      /* a last reference's close must not change it */
    for (nfds_t i = 0; i < n; i++)
        if (socks[i]) { fds[i].events = want[i]; rs_sock_put(socks[i]); }
    if (socks != sbuf) { free(socks); free(want); }
    errno = e;
    return r;
}

/* Sockets still in the handshake: the HELLO or ACCEPT waiting in the kernel socket makes
 * it readable, but it is not the application's data.  Such a socket is settled (one
 * non-blocking handshake step) before the wait and again when the kernel reports it; a
 * wake-up that was only the handshake is not reported and the wait goes on. */
static int poll_common(struct pollfd *fds, nfds_t n, int timeout_ms, const sigset_t *mask)
{
    uint64_t deadline = rs_deadline(timeout_ms);
    for (;;) {
        uint8_t hs_buf[POLL_STACK];
        int any_hs = 0;
        for (nfds_t i = 0; i < n; i++) {
            struct rs_sock *s = rs_handshake_sock(fds[i].fd);
            int still = 0;
            if (s) {
                rs_sock_settle(s);
                still = rs_sock_in_handshake(s);
                rs_sock_put(s);
            }
            if (i < POLL_STACK) hs_buf[i] = (uint8_t)still;
            any_hs |= still;
        }
        int r = poll_rings(fds, n, rs_ms_until(deadline), mask);
        if (r <= 0 || !any_hs || n > POLL_STACK) return r;
        int count = 0, settled = 0;
        for (nfds_t i = 0; i < n; i++) {
            if (hs_buf[i] && (fds[i].revents & POLLIN)) {
                struct rs_sock *s = rs_sock_of(fds[i].fd);
                if (s) {
                    rs_sock_settle(s);
                    settled = 1;
                    if (rs_only_handshake(s)) {
                        fds[i].revents &= (short)~(POLLIN | POLLRDNORM);
                    } else {
                        struct pollfd one = { .fd = fds[i].fd, .events = fds[i].events };
                        poll_rings(&one, 1, 0, NULL);
                        fds[i].revents = one.revents;
                    }
                    rs_sock_put(s);
                }
            }
            if (fds[i].revents) count++;
        }
        if (count || !settled || rs_passed(deadline)) return count;
    }
}

/* Whether any descriptor of the set needs our treatment. */
static int any_ours(const struct pollfd *fds, nfds_t n)
{
    for (nfds_t i = 0; i < n; i++) {
        struct rs_sock *s = rs_in_engine ? NULL : rs_sock_of(fds[i].fd);
        if (!s) continue;
        int st = rs_sock_state(s);
        rs_sock_put(s);
        if (st != RS_PLAIN && st != RS_LISTEN && st != RS_BROKEN) return 1;
    }
    return 0;
}

RS_EXPORT int poll(struct pollfd *fds, nfds_t n, int timeout_ms)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (!rs_tracking() || rs_in_engine || !any_ours(fds, n)) return rs_real.poll(fds, n, timeout_ms);
    return poll_common(fds, n, timeout_ms, NULL);
}

RS_EXPORT int __poll_chk(struct pollfd *fds, nfds_t n, int timeout_ms, size_t fdslen)
{
    if (fdslen / sizeof *fds < n) abort();
    return poll(fds, n, timeout_ms);
}

RS_EXPORT int ppoll(struct pollfd *fds, nfds_t n, const struct timespec *ts, const sigset_t *mask)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (!rs_tracking() || rs_in_engine || !any_ours(fds, n)) return rs_real.ppoll(fds, n, ts, mask);
    return poll_common(fds, n, rs_ts_ms(ts), mask);
}

RS_EXPORT int __ppoll_chk(struct pollfd *fds, nfds_t n, const struct timespec *ts, const sigset_t *mask, size_t fdslen)
{
    if (fdslen / sizeof *fds < n) abort();
    return ppoll(fds, n, ts, mask);
}

/* select/pselect become a poll when an upgraded socket is in the sets. */
static int select_common(int nfds, fd_set *r, fd_set *w, fd_set *e, int timeout_ms, const sigset_t *mask, int *handled)
{
    *handled = 0;
    if (nfds > FD_SETSIZE) nfds = FD_SETSIZE;
    struct pollfd p[FD_SETSIZE];
    nfds_t n = 0;
    for (int fd = 0; fd < nfds; fd++) {
        short ev = 0;
        if (r && FD_ISSET(fd, r)) ev |= POLLIN;
        if (w && FD_ISSET(fd, w)) ev |= POLLOUT;
        if (e && FD_ISSET(fd, e)) ev |= POLLPRI;
        if (ev) { p[n].fd = fd; p[n].events = ev; p[n].revents = 0; n++; }
    }
    if (!any_ours(p, n)) return 0;
    *handled = 1;
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
    if (rs_tracking() && !rs_in_engine) {
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
    if (rs_tracking() && !rs_in_engine) {
        int handled;
        int rc = select_common(nfds, r, w, e, rs_ts_ms(ts), mask, &handled);
        if (handled) return rc;
    }
    return rs_real.pselect(nfds, r, w, e, ts, mask);
}

RS_EXPORT long int __fdelt_chk(long int d)
{
    if (d < 0 || d >= FD_SETSIZE) abort();
    return d / __NFDBITS;
}
