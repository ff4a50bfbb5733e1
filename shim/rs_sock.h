/* rs_sock.h - one TCP socket that rdmasock looks after: the reference-counted object every
 * interposed call acts on, and the owner of its link state machine.
 *
 * A socket is in one state (enum rs_state).  The states that matter to the data path:
 * CLIENT_HS/SERVER_HS (the control plane is still choosing), RING (data through
 * `conn`), PRE_RX (a declined server unwraps the client's preamble frames, then PLAIN),
 * BROKEN (the handshake failed: every call reports `err`).
 *
 * Lifetime.  `refs` holds two counts: holders (descriptor numbers of the application
 * that refer to the socket; rs_sock_hold/rs_sock_unhold) in the high half, and calls in
 * progress (rs_sock_get/rs_sock_put) in the low half.  The object is torn down when both
 * reach zero, so a close() in one thread never frees what a recv() in another thread is
 * still using.  Objects are never returned to malloc (they go to a free list), which is
 * what lets rs_sock_get take a reference without a lock on a pointer it just read.
 *
 * The descriptor.  Our own system calls (doorbells, waits) use `conn->fd` (see rs_conn.h
 * rs_conn_fd_*): while the application keeps a number open that is one of its numbers;
 * when the application closes its last one while a call is still inside, the socket
 * moves to a private duplicate first, so no system call ever lands on a number the
 * application may already have reused.
 */
#ifndef RS_SOCK_H
#define RS_SOCK_H
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include "rs_conn.h"
#include "rs_contract.h"

enum rs_state {
    RS_PLAIN = 0,     /* nothing to do: the kernel socket is the whole story */
    RS_LISTEN,        /* listener with a rendezvous registration (handle) */
    RS_CLIENT_HS,     /* client: HELLO (to be) sent, answer not yet read */
    RS_SERVER_HS,     /* server: accepted from an rdmasock client, HELLO not yet read */
    RS_RING,          /* upgraded: data through conn */
    RS_PRE_RX,        /* server declined: unwrap the client's preamble frames, then plain */
    RS_BROKEN,        /* handshake failed: I/O reports err (the kernel socket is shut for reading) */
};

/* What the host offers: the control plane (rdmasock/engine.py, reached through the
 * embedded engine in a preloaded program) and the statistics table.  Any may be NULL. */
struct rs_host_ops {
    int  (*step)(int handle, int wait_ms, uintptr_t *out);   /* RS_STEP_*; out[0] conn, out[1] reason */
    void (*drop)(int handle);                                 /* a handshake nobody finishes */
    void (*unlisten)(int handle);                             /* a listener's registration */
    void (*release)(rs_conn *c);                              /* before an rdma conn is freed */
    void (*fell_back)(int fd, int role, rs_conn *c);          /* rdma went on over TCP: log it */
    /* A handshake that could be answered in C (rs_answer.c) is over without the control
     * plane: answered on fd (logged), or fd -1, closed before.  Closes a->engine_fd; the
     * control plane forgets the handshake later, without touching that descriptor. */
    void (*answer_done)(int handle, int fd, const struct rs_answer *a);
    /* A handshake C planned at accept (handle 0) that C cannot finish: the control plane
     * takes it over.  Its handle, or <= 0 (plain TCP, -reason). */
    int  (*accept_late)(int fd);
    struct rs_stat_slot *(*stat_open)(int fd, int role, int transport, int reason);
    void (*stat_close)(struct rs_stat_slot *slot);
    /* A fork is about to happen: a copy of a row as it is (used 0: the row is free).  In
     * the child, a row of its own with that copy's content, or NULL. */
    void (*stat_copy)(const struct rs_stat_slot *row, struct rs_stat_slot *out);
    struct rs_stat_slot *(*stat_inherit)(const struct rs_stat_slot *at_fork);
};
extern const struct rs_host_ops *rs_host;

struct rs_sock {
    uint64_t refs;            /* holders << 32 | calls in progress */
    uint64_t ino;             /* the socket's inode: which descriptors are it, where we were
                               * not told (a vfork child's dup2 before exec) */
    int      state;           /* enum rs_state; published with release stores */
    int      err;             /* BROKEN: positive errno */
    int      handle;          /* control-plane handle (CLIENT_HS, SERVER_HS, LISTEN); 0 for a
                               * SERVER_HS that C planned (rs_answer_plan) */
    uint8_t  role;            /* RS_ROLE_CLIENT / RS_ROLE_SERVER once known */
    uint8_t  nonblock;        /* O_NONBLOCK as the application set it */
    uint8_t  forked;          /* a fork happened while it existed: another process may hold it */
    uint8_t  passed;          /* sent to another process (SCM_RIGHTS), which may hold it after us:
                               * no close of ours is the last, the kernel's ends the stream */
    uint8_t  app_nodelay;     /* TCP_NODELAY as the application set it (RING) */
    uint8_t  app_cork;        /* TCP_CORK as the application set it (RING) */
    uint8_t  hello_pending;   /* client: nonblocking connect not finished, HELLO not sent */
    struct rs_pre_open pre_open; /* client: a preamble frame a non-blocking write left open
                               * (rs_preamble.c); changed under lock */
    uint8_t  ep_unknown;      /* registered with epoll before connect in a way we could not
                               * take over: non-blocking reads keep arming */
    uint8_t  own_fd;          /* fd is our private duplicate: closed with the object */
    uint8_t  hello_met_eof;   /* plain: our HELLO met the peer's end of stream (rs_sock_so_error) */
    uint8_t  kernel_readiness;/* the program waits on the kernel socket itself, not through
                               * readiness hooks (Python API): every doorbell is read at once,
                               * and O_ASYNC is looked up, not told */
    uint8_t  ended;           /* end_stream done: the peer was told (FIN or RESET record) */
    uint8_t  let_go;          /* this process's count in *holders is dropped */
    uint8_t  shut_pending;    /* half-closes (1 read, 2 write) a non-blocking caller asked for
                               * while the handshake was open: done when it ends */
    uint16_t reason;          /* why the handshake ended as it did (RS_REASON_*), 0: none */
    uint32_t gen;             /* which life of this (pooled) object: a host that keeps a
                               * pointer checks it (rs_sock_get_gen) */
    int      rcvtimeo_ms;     /* SO_RCVTIMEO, -1: none */
    int      sndtimeo_ms;     /* SO_SNDTIMEO, -1: none */
    int      fd;              /* a descriptor of this socket for our own calls */
    int      nfds, capfds;    /* the application's numbers that refer here */
    int     *fds;
    rs_conn *conn;            /* RING, PRE_RX */
    struct rs_answer *answer; /* SERVER_HS: the HELLO may be answered in C; LISTEN: the template
                               * of its accepted sockets' (rs_answer.c; malloc'd, ours) */
    struct rs_stat_slot *stat;
    struct rs_stat_slot stat_at_fork;   /* `stat` as a fork found it: a child's row starts from
                                         * this copy (the parent may reuse its row at once) */
    struct holders *holders;  /* forked: the processes that hold it, in memory this process
                               * shares with its forked children only; NULL: not counted */
    uint64_t rx_bytes;        /* payload the application received and sent that `stat` does not
                               * count: all of it while the socket has no row (TCP_INFO adds
                               * both; rs_sock.c rx_count, rs_sock_open_stat) */
    uint64_t tx_bytes;
    uint64_t write_stops;     /* writes that returned EAGAIN or less than asked (relaxed):
                               * room after one is an EPOLLOUT edge (rs_hooks_epoll.c out_mark) */
    pthread_mutex_t lock;     /* state transitions and the descriptor list */
    struct rs_sock *all_next; /* every object ever made (fork fix-up) */
    struct rs_sock *free_next;
};

/* Lifetime */
/* One holder (fd), no call.  Complete when it appears: fork's settle walks every object. */
struct rs_sock *rs_sock_new(int fd, int state, int handle, int role);
struct rs_sock *rs_sock_ref(struct rs_sock *s);   /* a call on a socket already referenced */
void rs_sock_put(struct rs_sock *s);              /* ends a call */
void rs_sock_hold(struct rs_sock *s, int fd);     /* another application number refers here */
/* The application closes fd (one of s's numbers).  Moves our own calls off it, then drops
 * its hold; the caller closes fd afterwards. */
void rs_sock_release_fd(struct rs_sock *s, int fd);
void rs_sock_mark_all_forked(void);
void rs_sock_after_fork_parent(void);
void rs_sock_at_exit(struct rs_sock *s);          /* exit: ends the stream as close would */
void rs_sock_after_fork_child(void);
void rs_sock_open_stat(struct rs_sock *s, struct rs_stat_slot *row);   /* NULL: none */
int  rs_sock_try_get(struct rs_sock *s);          /* a call on an object that may be dying: 1 ok */
int  rs_sock_get_gen(struct rs_sock *s, uint32_t gen);   /* try_get of that life of it: 1 ok */
/* The host lost fd without telling us while it was open (its number is closed already and
 * may be reused): drops its hold, and no system call of ours uses that number again. */
void rs_sock_abandon_fd(struct rs_sock *s, int fd);

static inline int rs_sock_state(const struct rs_sock *s) { return __atomic_load_n(&s->state, __ATOMIC_ACQUIRE); }

/* Handshake */
int  rs_sock_step(struct rs_sock *s, int wait_ms);   /* 1 over (state updated), 0 pending, -1 errno */
int  rs_sock_in_handshake(struct rs_sock *s);        /* bytes on the kernel socket may not be data */
void rs_sock_settle(struct rs_sock *s);              /* one non-blocking step towards data */

/* I/O.  Return bytes or -errno; *plain = 1 means the socket is plain TCP: the caller
 * makes the real call (and nothing was done).  rs_sock_recv/send wait as the socket's
 * flags and SO_RCVTIMEO/SO_SNDTIMEO say; the _within forms wait timeout_ms (-1: no
 * limit, 0: not at all), for a host that keeps its own timeouts (Python's settimeout). */
ssize_t rs_sock_recv(struct rs_sock *s, void *buf, size_t n, int flags, int *plain);
ssize_t rs_sock_send(struct rs_sock *s, const void *buf, size_t n, int flags, int *plain);
ssize_t rs_sock_recv_within(struct rs_sock *s, void *buf, size_t n, int flags, int timeout_ms, int *plain);
ssize_t rs_sock_send_within(struct rs_sock *s, const void *buf, size_t n, int flags, int timeout_ms, int *plain);
/* The answer of a client handshake under way waited for (until deadline), a lazy SWITCH
 * sent: before the socket is shared with another process.  rs_settle_deadline: how long
 * such a wait may last from now (200 ms). */
void     rs_sock_finish_client(struct rs_sock *s, uint64_t deadline);
uint64_t rs_settle_deadline(void);
/* The stream to plain TCP, both ways, for a program that will use only the kernel socket
 * (reason: RS_REASON_EXEC, RS_REASON_PASSED). */
int     rs_sock_to_kernel(struct rs_sock *s, int reason, int timeout_ms);
void    rs_sock_note_fallback(struct rs_sock *s);   /* after the ring went on over TCP: stat + log */
int     rs_sock_shutdown(struct rs_sock *s, int how, int *plain);
int     rs_sock_shutdown_nonblock(struct rs_sock *s, int how, int nonblock, int *plain);
int     rs_sock_move_tx(struct rs_sock *s, int reason, int flags, int *plain);  /* then the kernel's call */
/* 1 if this option (setsockopt) or control message (sendmsg) asks for transmit
 * timestamps, which only the kernel's path of the bytes can make (RS_REASON_TX_TIMESTAMPS) */
int     rs_tx_stamps_asked(int level, int name, const void *val, size_t len);
int     rs_sock_at_mark(struct rs_sock *s, int *plain);             /* SIOCATMARK */
int     rs_sock_so_error(struct rs_sock *s, int err);                 /* after the kernel's SO_ERROR */
void    rs_sock_tcp_info(struct rs_sock *s, void *info, unsigned len);  /* after the kernel's TCP_INFO */
void    rs_sock_setopt_seen(struct rs_sock *s, int level, int name, const void *val, unsigned len);
void    rs_sock_flags_seen(struct rs_sock *s, int fl);                  /* after F_SETFL */

#endif
