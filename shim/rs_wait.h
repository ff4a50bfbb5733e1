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
/* How a signal ends a wait (signal(7)): RS_SIG_RESTART for an untimed socket call that has
 * moved nothing yet (restarted after a handler with SA_RESTART, EINTR after any other);
 * RS_SIG_EINTR for the rest (a call with SO_RCVTIMEO/SO_SNDTIMEO or a deadline, one that
 * already moved bytes, poll/select/epoll): any handled signal ends it. */
enum { RS_SIG_EINTR, RS_SIG_RESTART };
int  rs_sigwait_nap(struct rs_sigwait *w, uint64_t ns, int rule);   /* 1 slept or restarted, -EINTR */
void rs_sigwait_end(struct rs_sigwait *w);                          /* the program's mask again */

/* A spinning wait, `spun_ns` into it: pure spinning for RS_PURE_SPIN_NS, then every round
 * yields the CPU, since the peer we wait for may share it (2-core machines).  From then on
 * the spin also holds the program's signals in `w` (the call pays system calls anyway), so
 * that one arriving during the spin ends or restarts the call by the kernel's rules when
 * the spin stops (rs_spin_done), instead of running its handler unnoticed.  Returns 1 when
 * such a signal is pending: the spin should stop.  A signal in the first RS_PURE_SPIN_NS is
 * handled at once and the call goes on, exactly as for one that arrives just before the
 * call. */
#define RS_PURE_SPIN_NS 2000u

/* The spin-then-block controller: how long the next spin before a kernel sleep may last,
 * at most `max` ns.  The budget doubles after a spin that found what it waited for and
 * halves (down to max/64 + 500 ns) after one that did not, so two processes sharing one
 * CPU quickly stop burning each other's time slice.  A wait whose spin ran out but whose
 * data came after `waited_ns` in all (rs_spin_missed) grows it to twice that: had the spin
 * lasted that long it would have saved the kernel sleep and the doorbell, whose cross-CPU
 * wake-up alone costs tens of microseconds, so a peer that answers within `max` (a
 * database statement, say) is waited for by spinning.  Any thread may update it. */
struct rs_spin { uint64_t cur, max; };
static inline void rs_spin_init(struct rs_spin *s, uint64_t max) { s->cur = s->max = max; }
/* The budget of a wait whose peers run on other CPUs: none while rs_cpus_busy().  A
 * thread that waits for its CPU is one whose spin the scheduler cuts short: it loses the
 * CPU mid-spin with no doorbell asked for, and the peer's answer then waits for the other
 * task's whole slice (redis-benchmark -c 50 against a preloaded redis-server, each
 * sharing its CPU with a busy loop of the same session: 3.9 ms median latency, 0.42x
 * TCP, when waits for many connections still spun; 0.2 ms, 1.7x, with none spinning). */
uint64_t rs_spin_allow(struct rs_spin *s);
/* This thread waits for its CPU: it waited on a run queue for more than a quarter of the
 * time it ran, over the last 10 ms or more (looked up at most that often; a busy answer
 * stands for 500 ms unless the thread moves to another CPU). */
int  rs_cpus_busy(void);
void rs_spin_result(struct rs_spin *s, int found);
void rs_spin_missed(struct rs_spin *s, uint64_t waited_ns);
int  rs_spin_pause(uint64_t spun_ns, struct rs_sigwait *w);
/* The spin found nothing: a signal held during it now runs its action; 1 to go on waiting,
 * -EINTR if the kernel's call would have ended.  The program's mask is back either way. */
int  rs_spin_done(struct rs_sigwait *w, int rule);

/* Wake-ups through a 32-bit word in memory shared with the peer process (a futex): the
 * sleeper reads the word, makes its last check, and sleeps only while the word still holds
 * what it read; the waker changes the word, then wakes every sleeper on it.  A wake-up
 * between the sleeper's read and its sleep is not lost: the word differs and the sleep
 * returns at once.  rs_word_wait: 1 woken (or the word changed, or a spurious wake-up:
 * look again), 0 timed out, -EINTR (any handled signal), or -errno.  The peer may raise
 * the word at will: a sleeper only ever looks again; it may also never raise it, so every
 * sleep is bounded by its caller. */
int  rs_word_wait(const uint32_t *word, uint32_t seen, int timeout_ms);
void rs_word_raise(uint32_t *word);
/* The same for several words at once (a poll over several sockets): woken by any. */
#define RS_WORDS_MAX 128
int  rs_words_wait(const uint32_t *const *words, const uint32_t *seen, int n, int timeout_ms);

/* How long, at most, a wait sleeps on a shm word before it goes back to sleeping on the
 * socket, where the peer's death is seen (its kernel closes the socket, never the word). */
#define RS_WORD_WINDOW_MS 50
#endif
