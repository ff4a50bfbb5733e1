/* rs_preload.h - the LD_PRELOAD front library: interposed libc calls, the fd table, and
 * the bridge to the Python engine (control plane, loaded on first INET stream use).
 *
 * Layering: rs_real.c (the real libc functions), rs_links.c (fd -> connection state,
 * shared by dup and fork), rs_bridge.c (engine loading, re-entrancy guard, handshake
 * steps), rs_hooks_sock.c (socket set-up calls), rs_hooks_io.c (data calls),
 * rs_hooks_wait.c (poll/select/epoll).  The data path itself is shim/rs_*.c.
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

#define RS_EXPORT __attribute__((visibility("default")))
#define RS_MAXFD  65536

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
    int (*poll)(struct pollfd *, nfds_t, int);
    int (*ppoll)(struct pollfd *, nfds_t, const struct timespec *, const sigset_t *);
    int (*select)(int, fd_set *, fd_set *, fd_set *, struct timeval *);
    int (*pselect)(int, fd_set *, fd_set *, fd_set *, const struct timespec *, const sigset_t *);
    int (*epoll_wait)(int, struct epoll_event *, int, int);
    int (*epoll_pwait)(int, struct epoll_event *, int, int, const sigset_t *);
    int (*epoll_pwait2)(int, struct epoll_event *, int, const struct timespec *, const sigset_t *);
    int (*epoll_ctl)(int, int, int, struct epoll_event *);
};
extern struct rs_real rs_real;
void rs_real_init(void);

/* ---- rs_stats.c ------------------------------------------------------------------ */
/* One row of `rdmasock stat` (layout read by rdmasock/stat.py). */
struct rs_stat_slot {
    uint32_t used;
    int32_t  fd;
    uint8_t  transport;     /* 0 tcp, 1 shm, 2 rdma */
    uint8_t  role;          /* 1 client, 2 server */
    uint16_t reason;        /* fallback reason code (rdmasock/reasons.py), 0 = none */
    uint8_t  local[28];     /* struct sockaddr_in or sockaddr_in6 */
    uint8_t  peer[28];
    uint64_t tx_bytes, rx_bytes;
    uint8_t  pad[8];
};
struct rs_stat_slot *rs_stat_open(int fd, int role, int transport, int reason);
void rs_stat_close(struct rs_stat_slot *s);
void rs_stats_after_fork(void);

/* ---- rs_links.c ----------------------------------------------------------------- */
enum rs_state {
    RS_PLAIN = 0,     /* nothing to do (kept only while dups share the entry) */
    RS_LISTEN,        /* listener with a rendezvous registration */
    RS_CLIENT_HS,     /* client: HELLO (to be) sent, answer not yet read */
    RS_SERVER_HS,     /* server: accepted from an rdmasock client, HELLO not yet read */
    RS_RING,          /* upgraded: data through conn */
    RS_PRE_RX,        /* server declined: unwrap the client's preamble frames, then plain */
    RS_BROKEN,        /* handshake failed: I/O reports err */
};

/* Connection state of one open file: every fd (dup, dup2, fcntl F_DUPFD) that refers to
 * it points here.  After fork both processes hold a copy; `forked` makes close leave
 * the in-band FIN to the last process (the kernel's TCP FIN then ends the stream). */
struct rs_link {
    int refs;
    int state;
    int handle;            /* engine handshake handle (CLIENT_HS, SERVER_HS, LISTEN: fd) */
    int err;               /* BROKEN: positive errno */
    rs_conn *conn;         /* RING, PRE_RX */
    uint8_t nonblock;      /* O_NONBLOCK as the application set it */
    uint8_t forked;
    uint8_t app_nodelay;   /* TCP_NODELAY as the application set it (RING) */
    uint8_t hello_pending; /* client: nonblocking connect not finished, HELLO not sent */
    uint8_t ep_unknown;    /* registered with epoll before connect in a way we could not
                            * take over: non-blocking reads keep arming (rs_bridge.c) */
    pthread_mutex_t lock;  /* handshake steps */
    struct rs_stat_slot *stat;
};
extern struct rs_link *rs_fdmap[RS_MAXFD];
extern int rs_nlinks;

static inline struct rs_link *rs_link_of(int fd)
{
    return (unsigned)fd < RS_MAXFD ? __atomic_load_n(&rs_fdmap[fd], __ATOMIC_ACQUIRE) : NULL;
}
struct rs_link *rs_link_new(int fd, int state);
void rs_link_share(int newfd, struct rs_link *l);
struct rs_link *rs_link_detach(int fd);         /* fd closed: returns link if it was the last ref */
void rs_link_free(struct rs_link *l, int fd);   /* fd: the descriptor being closed, or -1 */
void rs_links_mark_forked(void);

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
int  rs_br_listen(int fd);
void rs_br_unlisten(int fd);
int  rs_br_connect_plan(int fd, const struct sockaddr *sa, socklen_t len);
void rs_br_hello(int handle);
int  rs_br_accept(int lfd, int fd);
void rs_br_drop(int handle);
void rs_br_plain(int fd, int reason);
void rs_br_conn_free(rs_conn *c, int forked);
#define RS_REASON_RDMA_FAILED 19   /* rdmasock/reasons.py */
void rs_note_fallback(struct rs_link *l);
/* Advances the handshake of fd's link.  Returns 1 when it is over (state updated),
 * 0 still pending, -1 with errno set. */
int  rs_step(int fd, struct rs_link *l, int wait_ms);

/* ---- rs_hooks_wait.c -------------------------------------------------------------- */
void rs_ep_forget(int fd);
int  rs_ep_is_set(int fd);
void rs_ep_fd_fresh(int fd);
int  rs_ep_adopt(int fd);

/* ---- rs_hooks_io.c --------------------------------------------------------------- */
/* For an fd whose link is in a handshake state: settles what can be settled and tells
 * the caller where the data goes.  Returns the link state to act on, or -1 (errno). */
int rs_io_prepare(int fd, struct rs_link *l, int for_write);
int rs_io_timeout(struct rs_link *l, int flags);

#endif
