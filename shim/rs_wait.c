/* rs_wait.c - spinning, napping and sleeping (rs_wait.h). */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <stdlib.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <poll.h>
#include <sched.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/signalfd.h>
#include <sys/timerfd.h>
#include <unistd.h>
#include "rs_lock.h"
#include "rs_wait.h"
#include "rs_sys.h"

void rs_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

static void hold_signals(struct rs_sigwait *w)
{
    if (w->active) return;
    sigset_t all;
    sigfillset(&all);
    if (pthread_sigmask(SIG_BLOCK, &all, &w->saved) == 0) w->active = 1;
}

int rs_spin_pause(uint64_t spun_ns, struct rs_sigwait *w)
{
    if (spun_ns <= RS_PURE_SPIN_NS) { rs_relax(); return 0; }
    if (w) hold_signals(w);
    sched_yield();
    if (!w || !w->active) return 0;
    sigset_t pending;
    if (sigpending(&pending) != 0) return 0;
    for (int sig = 1; sig < NSIG; sig++)
        if (sigismember(&pending, sig) == 1 && sigismember(&w->saved, sig) != 1) return 1;
    return 0;
}

/* Spinning cannot pay while this thread's CPU has others to run: then the thread itself
 * waits for it.  The kernel counts that wait (/proc/thread-self/schedstat: ns run, ns
 * waited on a run queue); the thread is busy while it waited more than a quarter of the
 * time it ran since it last looked.  One thread's CPU is what matters: a global count of
 * runnable tasks also stops the spinning of a client whose CPU is idle while the server's
 * is crowded.  Looking costs an open, a read and a close (3 to 5 us): a server of a
 * hundred backends that each looked every 10 ms spent 5% of its CPU on it.  So the
 * interval starts at 10 ms and doubles, up to 40 ms, while the answer stays the same; a
 * change of answer, or of the CPU the thread runs on, brings it back to 10 ms.
 * A busy answer holds for 500 ms: a thread that stopped spinning sleeps, and a sleeper
 * hardly waits for its CPU (a wake-up preempts the other task), so the next look would
 * say idle, the thread would spin again and be cut short again (pgbench -S -c 1 with a
 * busy loop on each CPU: 0.87x TCP with 10 ms between looks, 1.19x with no spinning,
 * 1.08x with the hold).  The look that ends a hold only starts a new 10 ms count, so a
 * crowding that is over stops the spinning for about 510 ms, not for another hold.  A
 * move to another CPU looks again at once, as before. */
#define BUSY_LOOK_MIN_NS 10000000u
#define BUSY_LOOK_MAX_NS 40000000u
#define BUSY_HOLD_NS 500000000u
static __thread uint64_t busy_at_ns, busy_every_ns, busy_run_ns, busy_wait_ns;
static __thread int busy_now, busy_cpu;

int rs_cpus_busy(void)
{
    uint64_t now = rs_now_ns();
    if (now - busy_at_ns < BUSY_LOOK_MIN_NS) return busy_now;
    int cpu = sched_getcpu();                 /* glibc reads it from the rseq area: no system call */
    if (now - busy_at_ns < busy_every_ns && cpu == busy_cpu) return busy_now;
    uint64_t every = cpu == busy_cpu ? busy_every_ns : 0;    /* moved: partly the old CPU's figures */
    busy_cpu = cpu;
    busy_at_ns = now;
    busy_every_ns = BUSY_LOOK_MIN_NS;         /* unless the answer repeats (below) */
    char buf[96];
    int fd = (int)rs_syscall(SYS_openat, AT_FDCWD, "/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return busy_now = 0;
    long n = rs_syscall(SYS_read, fd, buf, sizeof buf - 1);
    rs_syscall(SYS_close, fd);
    if (n <= 0) return busy_now = 0;
    buf[n] = 0;
    char *end;
    uint64_t run = strtoull(buf, &end, 10), wait = strtoull(end, NULL, 10);
    if (every == BUSY_HOLD_NS) {
        /* a hold ends: its 500 ms of figures would still show the crowding that began it,
         * and hold again; the answer comes from the next 10 ms alone */
        busy_run_ns = run;
        busy_wait_ns = wait;
        return busy_now;
    }
    /* counters that went back belong to another thread (a forked child's copy of ours) */
    int seen = (busy_run_ns || busy_wait_ns) && run >= busy_run_ns && wait >= busy_wait_ns, was = busy_now;
    busy_now = seen && (wait - busy_wait_ns) * 4 > run - busy_run_ns;
    if (seen && busy_now == was && every >= BUSY_LOOK_MIN_NS)
        busy_every_ns = 2 * every > BUSY_LOOK_MAX_NS ? BUSY_LOOK_MAX_NS : 2 * every;
    if (busy_now && every) busy_every_ns = BUSY_HOLD_NS;     /* not on figures partly of another CPU */
    busy_run_ns = run;
    busy_wait_ns = wait;
    return busy_now;
}

uint64_t rs_spin_allow(struct rs_spin *s)
{
    if (rs_cpus_busy()) return 0;
    uint64_t cur = __atomic_load_n(&s->cur, __ATOMIC_RELAXED);
    return cur < s->max ? cur : s->max;
}

void rs_spin_result(struct rs_spin *s, int found)
{
    uint64_t cur = __atomic_load_n(&s->cur, __ATOMIC_RELAXED), max = s->max;
    if (found) cur = cur * 2 > max ? max : (cur ? cur * 2 : 1000);
    else if (cur > max / 64 + 500) cur /= 2;
    else return;
    __atomic_store_n(&s->cur, cur, __ATOMIC_RELAXED);
}

void rs_spin_missed(struct rs_spin *s, uint64_t waited_ns)
{
    if (waited_ns >= s->max) return;
    uint64_t want = 2 * waited_ns + 1000, cur = __atomic_load_n(&s->cur, __ATOMIC_RELAXED);
    if (want > cur) __atomic_store_n(&s->cur, want > s->max ? s->max : want, __ATOMIC_RELAXED);
}

int rs_spin_done(struct rs_sigwait *w, int rule)
{
    int r = w->active ? rs_sigwait_nap(w, 0, rule) : 1;
    rs_sigwait_end(w);
    return r;
}

/* Which signal interrupted a poll is not known here; the kernel restarts a call after a
 * handler with SA_RESTART.  So: restart if every caught signal's handler has it. */
int rs_restart_after_signal(void)
{
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction sa;
        if (sigaction(sig, NULL, &sa) != 0) continue;
        if (sa.sa_handler == SIG_DFL || sa.sa_handler == SIG_IGN) continue;
        if (!(sa.sa_flags & SA_RESTART)) return 0;
    }
    return 1;
}

/* A signal during a sleep: what the kernel's call would do.  With a deadline (a socket
 * timeout), EINTR whatever the handler; without one, restart after an SA_RESTART handler. */
static int interrupted(uint64_t deadline)
{
    if (deadline != RS_NEVER || !rs_restart_after_signal()) return -EINTR;
    return 1;
}

/* An untimed sleep: with the program's signals held, a signalfd of the ones it lets
 * through sleeps beside fd, so the signal that ends the sleep is known and its action
 * decides, by the kernel's rule for that very signal (rs_sigwait_nap).  0 if it cannot be
 * set up (the caller then takes the approximation). */
static int sleep_fd_exact(int fd, short events, int ms)
{
    struct rs_sigwait w = { 0 };
    hold_signals(&w);
    if (!w.active) return 0;
    sigset_t want;
    sigfillset(&want);
    for (int sig = 1; sig < NSIG; sig++)
        if (sigismember(&w.saved, sig) == 1) sigdelset(&want, sig);
    int sfd = (int)rs_syscall(SYS_signalfd4, -1, &want, (size_t)(_NSIG / 8), SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) { rs_sigwait_end(&w); return 0; }
    struct pollfd p[2] = { { .fd = fd, .events = events }, { .fd = sfd, .events = POLLIN } };
    int r = rs_sys_poll(p, 2, ms);
    rs_syscall(SYS_close, sfd);
    int out = r < 0 ? r : 1;
    if (r > 0 && p[1].revents) out = rs_sigwait_nap(&w, 0, RS_SIG_RESTART);
    rs_sigwait_end(&w);
    return out;
}

int rs_sleep_fd(int fd, short events, uint64_t deadline)
{
    if (rs_passed(deadline)) return 0;
    int ms = rs_ms_until(deadline);
    if (ms < 0 || ms > 1000) ms = 1000;           /* look again now and then, whatever happens */
    if (deadline == RS_NEVER) {
        int r = sleep_fd_exact(fd, events, ms);
        if (r) return r;
    }
    struct pollfd p = { .fd = fd, .events = events };
    int r = rs_sys_poll(&p, 1, ms);
    if (r == -EINTR) return interrupted(deadline);
    if (r < 0) return r;
    return 1;
}

/* An untimed nap with nothing transferred yet is a blocking read of a one-shot timer: a
 * signal then ends it by the kernel's own rule for the very signal that came (restarted
 * after an SA_RESTART handler, EINTR otherwise), which no poll or nanosleep can tell. */
static int nap_restartable(uint64_t ns)
{
    int tfd = (int)rs_syscall(SYS_timerfd_create, CLOCK_MONOTONIC, TFD_CLOEXEC);
    if (tfd < 0) return 0;                         /* out of descriptors: the approximation */
    struct itimerspec its = { { 0, 0 }, { (time_t)(ns / 1000000000u), (long)(ns % 1000000000u) } };
    long r = rs_syscall(SYS_timerfd_settime, tfd, 0, &its, NULL);
    uint64_t ticks;
    if (r == 0) r = rs_syscall(SYS_read, tfd, &ticks, sizeof ticks);
    int e = errno;
    rs_syscall(SYS_close, tfd);
    return r < 0 && e == EINTR ? -EINTR : 1;
}

int rs_nap(uint64_t ns, uint64_t deadline, int progress)
{
    if (rs_passed(deadline)) return 0;
    if (deadline != RS_NEVER) {
        uint64_t left = deadline - rs_now_ns();
        if (left < ns) ns = left;
    }
    /* With a timeout, or once bytes moved, any handled signal ends the call (signal(7);
     * TCP returns the short count): a nanosleep's EINTR says exactly that. */
    if (deadline == RS_NEVER && !progress) {
        int r = nap_restartable(ns);
        if (r) return r;
    }
    struct timespec ts = { (time_t)(ns / 1000000000u), (long)(ns % 1000000000u) };
    if (nanosleep(&ts, NULL) != 0 && errno == EINTR) return progress ? -EINTR : interrupted(deadline);
    return 1;
}

/* Signals whose default action is to ignore them: they never interrupt a call. */
static int default_ignored(int sig)
{
    return sig == SIGCHLD || sig == SIGURG || sig == SIGWINCH || sig == SIGCONT;
}

int rs_sigwait_nap(struct rs_sigwait *w, uint64_t ns, int rule)
{
    sigset_t all;
    sigfillset(&all);
    hold_signals(w);
    if (!w->active) return ns ? rs_nap(ns, RS_NEVER, rule != RS_SIG_RESTART) : 1;
    sigset_t want;                     /* what the program lets through */
    sigfillset(&want);
    for (int sig = 1; sig < NSIG; sig++)
        if (sigismember(&w->saved, sig) == 1) sigdelset(&want, sig);
    struct timespec ts = { (time_t)(ns / 1000000000u), (long)(ns % 1000000000u) };
    siginfo_t si;
    int sig = sigtimedwait(&want, &si, &ts);
    if (sig <= 0) return 1;            /* the nap ended (or SIGSTOP/SIGCONT woke it) */
    struct sigaction sa;
    int restart = 1;
    if (sigaction(sig, NULL, &sa) == 0 && sa.sa_handler != SIG_IGN &&
        !(sa.sa_handler == SIG_DFL && default_ignored(sig)))
        restart = rule == RS_SIG_RESTART && (sa.sa_flags & SA_RESTART) != 0 && sa.sa_handler != SIG_DFL;
    /* The signal goes back to this thread, with its information where the kernel allows
     * it, and its action runs now, as it would have run inside the kernel's wait. */
    pid_t tid = (pid_t)rs_syscall(SYS_gettid), pid = getpid();
    if (rs_syscall(SYS_rt_tgsigqueueinfo, pid, tid, sig, &si) != 0) rs_syscall(SYS_tgkill, pid, tid, sig);
    pthread_sigmask(SIG_SETMASK, &w->saved, NULL);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    return restart ? 1 : -EINTR;
}

void rs_sigwait_end(struct rs_sigwait *w)
{
    if (w->active) pthread_sigmask(SIG_SETMASK, &w->saved, NULL);
    w->active = 0;
}

/* ---- rs_lock.h's slow path -------------------------------------------------------------- */

void rs_lock_wait(rs_lock_t *l)
{
    for (int i = 0; i < 100; i++) {                   /* holders keep it for microseconds */
        int c = 0;
        if (__atomic_compare_exchange_n(&l->v, &c, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return;
        rs_relax();
    }
    while (__atomic_exchange_n(&l->v, 2, __ATOMIC_ACQUIRE) != 0)
        rs_syscall(SYS_futex, &l->v, FUTEX_WAIT_PRIVATE, 2, NULL, NULL, 0);
}

void rs_lock_wake(rs_lock_t *l)
{
    rs_syscall(SYS_futex, &l->v, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* ---- wake-ups through shared memory (shm's FUTEX_WAKE feature) ------------------------ */

int rs_word_wait(const uint32_t *word, uint32_t seen, int timeout_ms)
{
    struct timespec ts = { timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L };
    /* not FUTEX_PRIVATE: the word is in a segment the peer process maps too */
    long r = rs_syscall(SYS_futex, word, FUTEX_WAIT, seen, timeout_ms < 0 ? NULL : &ts, NULL, 0);
    if (r == 0 || errno == EAGAIN) return 1;
    if (errno == ETIMEDOUT) return 0;
    return -errno;
}

int rs_words_wait(const uint32_t *const *words, const uint32_t *seen, int n, int timeout_ms)
{
    if (n == 1) return rs_word_wait(words[0], seen[0], timeout_ms);
    if (n < 1 || n > RS_WORDS_MAX) return -EINVAL;
    struct futex_waitv w[RS_WORDS_MAX];
    for (int i = 0; i < n; i++)
        w[i] = (struct futex_waitv){ .val = seen[i], .uaddr = (uintptr_t)words[i], .flags = FUTEX_32 };
    struct timespec at, *tp = NULL;
    if (timeout_ms >= 0) {                      /* futex_waitv takes an absolute time */
        uint64_t t = rs_now_ns() + (uint64_t)timeout_ms * 1000000u;
        at = (struct timespec){ (time_t)(t / 1000000000u), (long)(t % 1000000000u) };
        tp = &at;
    }
    long r = rs_syscall(SYS_futex_waitv, w, (unsigned)n, 0u, tp, CLOCK_MONOTONIC);
    if (r >= 0 || errno == EAGAIN) return 1;
    if (errno == ETIMEDOUT) return 0;
    return -errno;
}

void rs_word_raise(uint32_t *word)
{
    __atomic_fetch_add(word, 1, __ATOMIC_SEQ_CST);
    rs_syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}
