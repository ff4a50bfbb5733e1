/* rs_wait.h - time, deadlines and sleeping: the one way every part of the data path waits.
 *
 * A deadline is an absolute CLOCK_MONOTONIC time in ns, RS_NEVER for none.  A call with a
 * timeout of 0 ms does not wait at all (its deadline is now); -1 waits as long as it takes.
 */
#ifndef RS_WAIT_H
#define RS_WAIT_H
#include <signal.h>
#include <stdint.h>
#include <time.h>

#define RS_NEVER UINT64_MAX

static inline uint64_t rs_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);       /* vDSO: no system call */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t rs_deadline(int timeout_ms)
{
    return timeout_ms < 0 ? RS_NEVER : rs_now_ns() + (uint64_t)timeout_ms * 1000000u;
}

static inline int rs_passed(uint64_t deadline) { return deadline != RS_NEVER && rs_now_ns() >= deadline; }

/* Milliseconds left (rounded up), -1 for RS_NEVER, 0 once passed. */
static inline int rs_ms_until(uint64_t deadline)
{
    if (deadline == RS_NEVER) return -1;
    uint64_t now = rs_now_ns();
    if (now >= deadline) return 0;
    uint64_t ms = (deadline - now + 999999u) / 1000000u;
    return ms > 0x7fffffff ? 0x7fffffff : (int)ms;
}

static inline uint64_t rs_earlier(uint64_t a, uint64_t b) { return a < b ? a : b; }

void rs_relax(void);
/* A spinning wait, `spun_ns` into it: pure spinning for RS_PURE_SPIN_NS, then every round
 * yields the CPU, since the peer we wait for may share it (2-core machines). */
#define RS_PURE_SPIN_NS 2000u
void rs_spin_pause(uint64_t spun_ns);

/* After a sleep with no deadline that a signal interrupted: would the kernel have
 * restarted the call?  (It does if the handler has SA_RESTART.) */
int rs_restart_after_signal(void);

/* Sleeps until `events` on fd or the deadline.  Returns 1 (woken or a slice passed: look
 * again), 0 (deadline passed), -EINTR (a signal the kernel would not restart for), or
 * another -errno.  A poll, so not for a sleep with exact restart rules (rs_wait_fd). */
int rs_sleep_fd(int fd, short events, uint64_t deadline);
/* A short nap (up to ns) that respects the deadline and the kernel's signal rules: with a
 * deadline or `progress` (bytes already moved by this call) any handled signal gives
 * -EINTR; otherwise a signal whose handler has SA_RESTART does not end it. */
int rs_nap(uint64_t ns, uint64_t deadline, int progress);

/* An untimed wait (no timeout, nothing transferred yet) made of many naps, whose signals
 * must end it exactly as they would end the kernel's own wait: with all signals blocked
 * from the first nap to the end, a signal arriving anywhere in the wait stays pending
 * until a nap takes it (sigtimedwait), hands it back and lets its action run, and the
 * wait then restarts (SA_RESTART, or an action that ignores it) or ends with EINTR. */
struct rs_sigwait { int active; sigset_t saved; };
int  rs_sigwait_nap(struct rs_sigwait *w, uint64_t ns);   /* 1 slept or restarted, -EINTR */
void rs_sigwait_end(struct rs_sigwait *w);                /* the program's mask again */
#endif
