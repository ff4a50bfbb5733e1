/* rs_preload.h - the LD_PRELOAD front library: interposed libc calls, the descriptor
 * table, and the bridge to the Python engine (control plane, loaded on first INET stream
 * use).
 *
 * Layering: rs_real.c (the real libc functions), rs_socks.c (descriptor -> socket object,
 * shared by dup), rs_bridge.c (engine loading, re-entrancy guard, the host operations the
 * socket object calls), rs_hooks_sock.c (socket set-up calls), rs_hooks_io.c (data calls),
 * rs_hooks_wait.c (poll/select/epoll), rs_hooks_exec.c (exec: sockets the new program
 * inherits).  Each hook looks the socket up, takes a
 * reference, calls shim/rs_sock.c, and lets go.
 */
#ifndef RS_PRELOAD_H
#define RS_PRELOAD_H
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include "../rs_conn.h"
#include "../rs_sock.h"
#include "../rs_sys.h"

#define RS_EXPORT __attribute__((visibility("default")))

/* ---- rs_hooks_sock.c ------------------------------------------------------------ */
void rs_adopt_accepted(int lfd, int fd);    /* an accepted socket: a HELLO may follow */
int  rs_memory_shared_child(void);          /* a vfork child: our tables are its parent's */

/* ---- rs_hooks_exec.c ------------------------------------------------------------ */
extern int rs_adopt_due;                    /* sockets accepted before our exec wait for first use */
void rs_adopt_inherited(int fd);            /* adopts fd's socket if it is one of them */
static inline void rs_adopt_if_due(int fd)
{
    if (__builtin_expect(__atomic_load_n(&rs_adopt_due, __ATOMIC_ACQUIRE), 0)) rs_adopt_inherited(fd);
}

/* ---- rs_real.c ---------------------------------------------------------------- */
struct rs_real {
    int (*socket)(int, int, int);
    int (*connect)(int, const struct sockaddr *, socklen_t);
    int (*listen)(int, int);
    int (*accept)(int, struct sockaddr *, socklen_t *);
    int (*accept4)(int, struct sockaddr *, socklen_t *, int);
    int (*close)(int);
    int (*shutdown)(int, int);
    int (*dup)(int);
    int (*dup2)(int, int);
    int (*dup3)(int, int, int);
    int (*fcntl)(int, int, ...);
    int (*ioctl)(int, unsigned long, ...);
    int (*getsockopt)(int, int, int, void *, socklen_t *);
    int (*setsockopt)(int, int, int, const void *, socklen_t);
    ssize_t (*read)(int, void *, size_t);
    ssize_t (*write)(int, const void *, size_t);
    ssize_t (*readv)(int, const struct iovec *, int);
    ssize_t (*writev)(int, const struct iovec *, int);
    ssize_t (*send)(int, const void *, size_t, int);
    ssize_t (*recv)(int, void *, size_t, int);
    ssize_t (*sendto)(int, const void *, size_t, int, const struct sockaddr *, socklen_t);
    ssize_t (*recvfrom)(int, void *, size_t, int, struct sockaddr *, socklen_t *);
    ssize_t (*sendmsg)(int, const struct msghdr *, int);
    ssize_t (*recvmsg)(int, struct msghdr *, int);
    ssize_t (*sendfile)(int, int, off_t *, size_t);
    ssize_t (*splice)(int, loff_t *, int, loff_t *, size_t, unsigned);
    int (*sendmmsg)(int, struct mmsghdr *, unsigned, int);
    int (*recvmmsg)(int, struct mmsghdr *, unsigned, int, struct timespec *);
    ssize_t (*preadv2)(int, const struct iovec *, int, off_t, int);
    ssize_t (*pwritev2)(int, const struct iovec *, int, off_t, int);
    int (*poll)(struct pollfd *, nfds_t, int);
    int (*ppoll)(struct pollfd *, nfds_t, const struct timespec *, const sigset_t *);
    int (*select)(int, fd_set *, fd_set *, fd_set *, struct timeval *);
    int (*pselect)(int, fd_set *, fd_set *, fd_set *, const struct timespec *, const sigset_t *);
    int (*epoll_wait)(int, struct epoll_event *, int, int);
    int (*epoll_pwait)(int, struct epoll_event *, int, int, const sigset_t *);
    int (*epoll_pwait2)(int, struct epoll_event *, int, const struct timespec *, const sigset_t *);
    void (*closefrom)(int);                  /* glibc 2.34+; NULL before */
    int (*epoll_ctl)(int, int, int, struct epoll_event *);
    int (*execve)(const char *, char *const[], char *const[]);
    int (*execveat)(int, const char *, char *const[], char *const[], int);
    int (*fexecve)(int, char *const[], char *const[]);
    int (*execvpe)(const char *, char *const[], char *const[]);
};
extern struct rs_real rs_real;
void rs_real_init(void);

/* ---- rs_stats.c ------------------------------------------------------------------ */
struct rs_stat_slot *rs_stat_open(int fd, int role, int transport, int reason);
void rs_stat_close(struct rs_stat_slot *s);
void rs_stat_copy(const struct rs_stat_slot *row, struct rs_stat_slot *out);
struct rs_stat_slot *rs_stat_inherit(const struct rs_stat_slot *at_fork);
void rs_stats_after_fork(void);
void rs_stats_forget_parent(void);

/* ---- rs_socks.c ------------------------------------------------------------------ */
extern int rs_ntracked;                     /* tracked descriptors: 0 lets waits pass */
static inline int rs_tracking(void) { return __atomic_load_n(&rs_ntracked, __ATOMIC_RELAXED) != 0; }
struct rs_sock *rs_sock_of(int fd);         /* with a call reference (rs_sock_put), or NULL */
int  rs_is_tracked(int fd);
struct rs_sock *rs_track(int fd, int state, int handle, int role);  /* a new socket at fd, with a call reference */
void rs_untrack(int fd);                    /* fd is closed (or replaced) */
void rs_untrack_range(unsigned first, unsigned last);     /* close_range */
void rs_forget_reused(int fd);              /* fd was closed unseen and is now another file */
void rs_sock_passing(int fd);               /* fd is about to be sent to another process (SCM_RIGHTS) */
void rs_adopt_received(int fd);             /* fd was received from another process (SCM_RIGHTS) */
#define RS_PASS_WAIT_MS 2000                /* for the peer to follow a move to TCP before a pass */
void rs_share(int oldfd, int newfd);        /* newfd refers to oldfd's socket now */
void rs_socks_after_fork_child(void);
void rs_socks_each(void (*fn)(int fd, struct rs_sock *s, void *arg), void *arg);

/* ---- rs_pyworld.c ---------------------------------------------------------------- */
#include <limits.h>
/* The Python installation the package belongs to (found from this library's location). */
struct rs_pyworld {
    char pkgdir[PATH_MAX];     /* .../rdmasock: this library, the engine, the package */
    char root[PATH_MAX];       /* the directory holding the package */
    char exe[PATH_MAX];        /* the interpreter the engine starts as */
    char home[PATH_MAX];       /* a venv's `home` (pyvenv.cfg), or "" */
    char libpython[PATH_MAX];  /* path or soname of its libpython */
    char kind[16];             /* venv, prefix or system */
};
int rs_pyworld_find(struct rs_pyworld *w, char *why, size_t whylen);

/* ---- rs_bridge.c ----------------------------------------------------------------- */
extern __thread int rs_in_engine;
int  rs_engine_ready(void);        /* loads and starts the engine once; 0 if unusable */
int  rs_engine_loaded(void);
/* > 0: a handle for rs_sock (RS_LISTEN); *tpl filled if C may plan its accepted sockets */
int  rs_br_listen(int fd, struct rs_answer *tpl);
int  rs_br_connect_plan(int fd, const struct sockaddr *sa, socklen_t len);
/* The control plane fills *answer if the HELLO may be answered in C (struct rs_answer). */
int  rs_br_accept(int lfd, int fd, struct rs_answer *answer);
void rs_br_drop(int handle);
void rs_br_unlisten(int handle);           /* a listener's name, given up */
void rs_br_plain(int fd, int reason);
void rs_log_direct(const char *text);     /* "TIME pid=N text" to RDMASOCK_LOG_FILE, from C */
/* "role=ROLE local=A peer=B WHAT", the engine's connection line, from C */
void rs_log_connection(int fd, const char *role, const char *what);   /* role NULL: not said */

/* ---- rs_ready.c ------------------------------------------------------------------ */
struct rs_sock *rs_waited_sock(int fd);    /* fd's tracked socket, any state: referenced */
int   rs_ring_answers(struct rs_sock *s);   /* upgraded: its ring answers readiness */
struct rs_sock *rs_ring_sock(int fd);      /* upgraded, ring answers readiness: referenced */
struct rs_sock *rs_handshake_sock(int fd); /* kernel bytes may not be data yet: referenced */
int   rs_only_handshake(struct rs_sock *s);
short rs_ring_revents(rs_conn *c, short events);
int   rs_ring_arm(rs_conn *c, short events, int bell);
int   rs_ring_arm_word(rs_conn *c, short events, const uint32_t **word, uint32_t *seen);
int   rs_ring_sleep_cap_ms(rs_conn *c, short events);
int   rs_min_ms(int a, int b);
struct rs_spin *rs_wait_spin(void);
int   rs_ts_ms(const struct timespec *ts);

/* ---- rs_hooks_epoll.c ------------------------------------------------------------- */
void rs_ep_forget(int fd);
void rs_ep_forget_range(unsigned first, unsigned last);
int  rs_ep_is_set(int fd);
void rs_ep_fd_fresh(int fd);
void rs_ep_fresh_range(unsigned first, unsigned last);
int  rs_ep_adopt(int fd);
void rs_ep_after_fork_child(void);

#endif
