/* rs_conn.h - per-connection state of an upgraded socket and the data-path API.
 *
 * A connection is one TCP socket (kept open: it carries doorbell bytes and tells us when
 * the peer dies) plus a transmit ring in the peer's memory and a receive ring in ours.
 * All functions return >= 0 on success or a negative errno; none allocates or makes a
 * system call while the ring has room (send) or data (receive).
 */
#ifndef RS_CONN_H
#define RS_CONN_H
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <sys/types.h>
#include "rs_wire.h"
#include "rs_contract.h"
#include "rs_rdma.h"
#include "rs_transport.h"
#include "rs_wait.h"
#include "rs_lock.h"

#define RS_ERRMSG_LEN 160
#define RS_BELL_SETS 4         /* epoll instances one event bell may be added to (rs_bells.c) */
#define RS_WINDOW_MIN 16384u   /* a producer's first window (rs_produce.c) */

/* A direction that moves from its ring to the TCP socket (rs_fallback.c). */
struct rs_tx_move {
    uint8_t  state;           /* 0 ring, 1 RESYNC frame and resend pending, 2 plain TCP */
    uint8_t  shut_pending;    /* FIN to send as a TCP half-close once the resend is out */
    uint8_t  out_len, out_sent;
    uint8_t  out[16];         /* our RESYNC frame */
    uint32_t resend_off;      /* payload bytes of the record at resend_pos already resent */
    uint64_t resend_pos, resend_end;   /* shadow ring positions still to resend */
};
struct rs_rx_move {
    uint8_t  state;           /* 0 ring, 1 doorbells before the frame, 2 frame, 3 repeat, 4 plain TCP */
    uint8_t  in_got;
    uint8_t  in[16];          /* the peer's RESYNC frame */
    uint64_t skip;            /* bytes the peer repeats that we already delivered */
};

#define RS_PRE_HDR 8          /* a preamble frame header: kind, zero[3], u32 length (rs_preamble.c) */

/* Server: the client's first bytes, sent before our answer, come as preamble frames on the
 * TCP socket, ended by a SWITCH frame (rs_preamble.c). */
struct rs_rx_pre {
    uint8_t  active;          /* preamble frames come first */
    uint8_t  lazy;            /* ... and the client sends SWITCH only with records or bytes after it */
    uint8_t  seen;            /* a preamble frame header (DATA or SWITCH) was read */
    uint8_t  ended;           /* the client's stream ended inside a frame: a half-close, and
                               * its TCP FIN says nothing more (rs_peer_gone) */
    uint8_t  hdr_got;         /* bytes of the next frame header taken off the socket so far */
    uint8_t  hdr[RS_PRE_HDR]; /* ... and they */
    uint32_t left;            /* payload bytes left in the open preamble frame */
    uint64_t bytes;           /* payload handed to the application from preamble frames */
};

/* Transmit state: records go into the peer's receive ring.  Changed under `lock`. */
struct rs_tx {
    rs_lock_t lock;
    uint8_t *ring;            /* the peer's receive ring (rdma: its shadow here) */
    struct rs_dir_ctl *ctl;
    uint64_t pos;             /* absolute ring position of the next record */
    uint64_t seq;             /* sequence number of the next record */
    uint64_t bytes;           /* payload bytes published (read unlocked: relaxed) */
    uint64_t head_seen;       /* last credit read from ctl->head */
    uint64_t last_data;       /* ring position of the last data record written */
    uint64_t last_rec;        /* ... and of the last record of any kind */
    uint32_t grace_ns;        /* how long a doorbell may wait for the consumer to take the last
                               * record first (rs_shm.c taken_in_grace), 0: never */
    uint32_t grace_off;       /* doorbells still to ring at once after a wait that did not pay */
    uint64_t records;
    uint32_t window;          /* records stay below this ring offset, then a WRAP: a connection
                               * that never waits for credit touches only these pages (rs_produce.c) */
    uint32_t window_max;      /* how far it may grow: the ring, or the first window for a
                               * program that shrank its send buffer (rs_sock.c cap_window;
                               * relaxed atomic) */
    uint8_t  fin_sent;        /* our FIN/RESET record written: writes fail with EPIPE */
    uint8_t  wrote_to_gone;   /* the one write TCP accepts after the peer closed was made */
    uint64_t stall_head;      /* credit when the ring was first seen full (rs_tx_stalled) */
    uint64_t stall_since;     /* ... and when, 0 if not full */
    uint64_t spilled;         /* stream bytes sent over the socket by SPILL (relaxed) */
    uint64_t spills;          /* SPILL records written (relaxed) */
    uint8_t  spill_settle;    /* this send spilled, or waited after a spill: rs_spill_settle due */
    int      bell_fd;         /* the peer's event bell (an eventfd) we raise, -1 none (rs_bells.c) */
    uint64_t event_bells;     /* ... raised (relaxed) */
    struct rs_tx_move move;   /* the direction's move to TCP */
} __attribute__((aligned(64)));

/* Receive state: records arrive in our ring.  Changed under `lock`. */
struct rs_rx {
    rs_lock_t lock;
    uint8_t *ring;
    struct rs_dir_ctl *ctl;
    uint64_t pos;             /* absolute ring position of the current record */
    uint64_t seq;
    uint64_t bytes;           /* payload bytes taken from the ring: handed to the application or held */
    uint64_t head_pub;        /* credit last published (ctl->head) */
    uint32_t credit_lag;      /* publish credit once this much is unpublished: a quarter of the
                               * producer's window, as its last WRAP showed (rs_rx_saw_wrap) */
    uint32_t cur_len;         /* payload length of the current, validated record (0: none) */
    uint32_t cur_off;         /* bytes of it already consumed */
    uint64_t bells_drained;   /* doorbell bytes read off the TCP socket */
    uint8_t  fin_seen;        /* peer's FIN (or RESET) record consumed: reads end */
    uint8_t  peer_reset;      /* ... and it was RESET: ECONNRESET after the data before it */
    uint8_t  shut_rd;         /* shutdown(SHUT_RD): reads take what is there, then 0 */
    uint8_t  lazy_tidy;       /* preload: its hooks answer readiness from the ring, so doorbells of
                               * consumed records may stay pending (no tidy system calls), and a
                               * non-blocking receive that finds nothing does not arm (rs_doorbell.c) */
    uint8_t  bell_every;      /* the program takes SIGIO (O_ASYNC): a doorbell for every publication */
    uint8_t  flags_unseen;    /* the program's fcntl calls are not seen (Python API): O_ASYNC is
                               * looked up on the socket when going idle */
    uint8_t  anc_opts;        /* receive options the program set (rs_report.c), 0 unknown */
    uint64_t last_peek_ns;    /* when going idle last peeked at the socket for EOF (rs_shm.c) */
    uint64_t suspect_pos, suspect_since;     /* rdma: a record that looked corrupt (rs_consume.c) */
    uint32_t suspect_lw, suspect_footer;
    struct rs_spin spin;      /* spin-then-block budget of a receive, at most spin_ns (rs_wait.h) */
    uint64_t records, sleeps;
    uint64_t word_sleeps;     /* receives asleep on the shared word (FUTEX_WAKE) */
    uint64_t word_timeouts;   /* ... that its window ended, not the peer: then on the socket */
    uint32_t quiet_sleepers;  /* receives inside a sleep armed with RS_WANT_QUIET (rs_shm.c) */
    struct rs_rx_pre pre;     /* the client's preamble */
    struct rs_rx_move move;   /* the direction's move to TCP */
    uint64_t spill_left;      /* stream bytes of the current SPILL still to read from the socket */
    uint8_t  spill_state;     /* RS_SPILL_* (rs_spill.c): where in the socket's part of a SPILL */
    uint8_t  spill_got;       /* bytes of the SPILL mark read so far */
    uint8_t  spill_mark[RS_SPILL_MARK_LEN];
    uint64_t spilled;         /* stream bytes received over the socket by SPILL */
    uint8_t *hold;            /* bytes taken from the ring by a waiting writer (rs_hold.c) */
    size_t   hold_off, hold_cap;
    uint64_t hold_len;        /* held bytes not yet read (read unlocked: atomic) */
    uint64_t held;            /* stream bytes that went through the hold (relaxed) */
    uint32_t sock_readers;    /* threads in a receive that sleeps on the socket (the preamble's, or
                               * after a move to TCP): the socket's next bytes are theirs, nobody
                               * else takes them (the hold, a poll), or nothing would wake them */
    uint64_t hold_seen;       /* rx.bytes when the holder thread last looked (rs_hold.c) */
    int      bell_fd;         /* our event bell (an eventfd) the peer raises, -1 none (rs_bells.c) */
    uint8_t  bell_nsets;      /* epoll instances it was added to, left at free */
    struct { int epfd; uint32_t id; int fd; } bell_sets[RS_BELL_SETS];   /* fd: in its epoll data */
} __attribute__((aligned(64)));

/* One upgraded connection.  A sender and a receiver thread each work on their own half
 * (tx, rx), under its lock, on cache lines of their own; the fields here are set up once
 * or changed with atomic operations.  Lock order: rx.lock, then tx.lock. */
struct rs_conn {
    int      fd;              /* the TCP socket (doorbells, liveness): use rs_fd_enter */
    int      fd_users;        /* short system calls in progress on fd (rs_conn_move_fd) */
    uint32_t ring_size, mask, max_payload;
    uint64_t salt;
    uint32_t spin_ns;         /* busy-poll budget before sleeping in the kernel (maximum) */
    int      err;             /* sticky error (positive errno), 0 if healthy (rs_conn_set_error) */
    uint8_t  tcp_eof;         /* the TCP socket reported EOF/HUP: the peer process is gone */
    uint8_t  fb;              /* the stream moves to TCP: set once, by whichever side noticed */
    uint8_t  fb_reason;       /* why: the first cause (RS_REASON_*), rs_fb_begin */
    uint8_t  fb_done;         /* both directions plain TCP: the kernel socket tells readiness */
    uint8_t  err_claimed;
    uint8_t  reset_reported;  /* the peer's reset was reported (rs_conn_reset_once) */
    uint8_t  switch_due;      /* client: SWITCH goes before our next TCP byte or after our first
                               * records (1 due, 2 being sent; rs_preamble.c) */
    uint8_t  switch_sent;     /* bytes of that SWITCH frame on the socket so far */
    uint8_t  spill_ok;        /* both ends speak SPILL (handshake feature): a ring that stays
                               * full spills to the socket for a while (rs_spill.c) */
    uint8_t  quiet_wake_ok;   /* both ends speak QUIET_WAKE: a blocking receive that will take all
                               * that arrives is woken without a doorbell byte (rs_shm.c) */
    uint8_t  word_wake_ok;    /* both ends speak FUTEX_WAKE (handshake feature): a waiting
                               * receiver may sleep on a shared word instead of the socket */
    char     errmsg[RS_ERRMSG_LEN];

    const struct rs_transport *ops;   /* how records travel (rs_transport.h) */
    /* memory owned by this connection: the shm mapping, or the rdma rings and words */
    void    *map_base;
    size_t   map_len;
    struct rs_rdma *rdma;     /* the rdma transport's own state (rs_rdma.c only) */
    uint64_t bells_sent;      /* doorbell bytes sent (both directions; relaxed atomic) */
    /* The process's connections a waiting writer may fill the holds of (rs_hold.c): the
     * list is that of the copy of this code that owns the connection, which may not be
     * the copy that made it (the engine's, for the preload library). */
    struct rs_live *live;
    struct rs_conn *live_prev, *live_next;

    struct rs_tx tx;
    struct rs_rx rx;
};
typedef struct rs_conn rs_conn;

/* A flag changed under a direction's lock and read without it (a stale value only sends
 * the reader round its loop once more). */
#define RS_GET(f)    __atomic_load_n(&(f), __ATOMIC_ACQUIRE)
#define RS_SET(f, v) __atomic_store_n(&(f), (v), __ATOMIC_RELEASE)
#define RS_SEEN(f)   ((unsigned long long)__atomic_load_n(&(f), __ATOMIC_RELAXED))   /* for a report */

/* The connection's descriptor for one short (non-blocking) system call.  While a call is
 * between enter and leave, rs_conn_move_fd does not let the number go. */
static inline int rs_fd_enter(rs_conn *c)
{
    __atomic_add_fetch(&c->fd_users, 1, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&c->fd, __ATOMIC_SEQ_CST);
}
static inline void rs_fd_leave(rs_conn *c) { __atomic_sub_fetch(&c->fd_users, 1, __ATOMIC_RELEASE); }
/* For a wait that may block: the number to poll.  The caller re-reads c->fd afterwards; if
 * it changed, what the poll said is about a number that is no longer ours. */
static inline int rs_fd_peek(rs_conn *c) { return __atomic_load_n(&c->fd, __ATOMIC_ACQUIRE); }

/* The ring walk's step: bytes from the record at absolute position pos (length word lw)
 * to the next record; a WRAP record spans the rest of the ring. */
static inline uint32_t rs_rec_span(const rs_conn *c, uint64_t pos, uint32_t lw)
{
    return lw == RS_LEN_WRAP ? c->ring_size - (uint32_t)(pos & c->mask) : rs_rec_size(lw);
}

/* Consumer: the producer's WRAP at ring offset off ends its window there.  Credit goes back
 * every quarter window, so a caught-up consumer never holds back what the producer needs
 * to wrap (PROTOCOL 5.6). */
static inline void rs_rx_saw_wrap(rs_conn *c, uint32_t off)
{
    uint32_t w = off + 8 > RS_WINDOW_MIN ? off + 8 : RS_WINDOW_MIN;
    c->rx.credit_lag = w / 4 < c->ring_size / 4 ? w / 4 : c->ring_size / 4;
}

/* rs_conn.c */
void     rs_conn_set_ring(rs_conn *c, uint32_t ring_size, int windowed);
void     rs_conn_move_fd(rs_conn *c, int newfd);
void     rs_conn_after_fork_child(rs_conn *c);
long     rs_c_send(rs_conn *c, const void *b, size_t n, int flags);
long     rs_c_recv(rs_conn *c, void *b, size_t n, int flags);
int      rs_c_poll(rs_conn *c, short events, int timeout_ms, short *revents);
int      rs_c_sockerr(rs_conn *c);
rs_conn *rs_conn_alloc(void);
void     rs_conn_free(rs_conn *c);
const char *rs_conn_errmsg(const rs_conn *c);
int      rs_conn_describe(rs_conn *c, char *buf, size_t n);    /* one line of state, for diagnosis */

/* A front-end that does not see the program's fcntl calls (flags_unseen) learns of an
 * O_NONBLOCK set on the descriptor behind its back only here, asked when an untimed call
 * is about to wait: 1 if it must not wait.  (A timed call waits whatever the flag: the
 * Python API, like CPython, keeps sockets with a timeout in O_NONBLOCK mode itself.) */
int      rs_conn_app_nonblocking(rs_conn *c);
/* The descriptor's flags (F_GETFL) where the front-end does not see them, else -1. */
long     rs_conn_app_flags(rs_conn *c);

/* rs_report.c: the socket's reports about the stream */
void     rs_conn_tcp_info(rs_conn *c, uint64_t in, uint64_t out, void *info, unsigned len);
size_t   rs_conn_rx_ancillary(rs_conn *c, int fd, void *ctl, size_t room, int *trunc);
void     rs_conn_sockopt_set(rs_conn *c);       /* the program set an option: look again */
long     rs_fd_recv(int fd, void *buf, size_t n, int flags);
void     rs_conn_set_error(rs_conn *c, int err, const char *fmt, ...);
/* Set by a host whose user would not see a connection's error otherwise (the preload
 * library: its log); the Python API raises it with the message instead. */
extern void (*rs_conn_failed)(const rs_conn *c);
void     rs_note_silent_change(void);
uint64_t rs_silent_changes(void);

/* rs_produce.c */
ssize_t  rs_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms);
int      rs_send_fin(rs_conn *c);
int      rs_send_reset(rs_conn *c);
void     rs_shutdown_rd(rs_conn *c);
void     rs_tx_flush_bell(rs_conn *c);
int      rs_tx_writable(rs_conn *c);
int      rs_tx_writable_locked(rs_conn *c);
int      rs_tx_stalled(rs_conn *c);
uint64_t rs_tx_full_ns(rs_conn *c);
int      rs_tx_spill_room(rs_conn *c);
void     rs_tx_put_spill(rs_conn *c, uint32_t count);
int      rs_tx_unread_at_peer(rs_conn *c);
int      rs_tx_tail_is_ours(rs_conn *c);
int      rs_tx_credit_unread(rs_conn *c);
int      rs_conn_reset_once(rs_conn *c);
void     rs_tx_put_moved(rs_conn *c);

/* rs_consume.c */
ssize_t  rs_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);
ssize_t  rs_rx_available(rs_conn *c);
int      rs_rx_reach_tcp(rs_conn *c);
int      rs_rx_ready(rs_conn *c);
int      rs_rx_maybe_ready(rs_conn *c);
void     rs_rx_drop_stale_bells(rs_conn *c);
int      rs_rx_ready_locked(rs_conn *c);
size_t   rs_rx_take(rs_conn *c, uint8_t *dst, size_t len, int peek);
size_t   rs_rx_take_ring(rs_conn *c, uint8_t *dst, size_t len);
/* Returns consumed ring bytes to the producer (caller holds rx_lock): every quarter ring,
 * when the producer waits for them, or (force) whenever any are unpublished. */
static inline void rs_rx_publish_credit(rs_conn *c, int force) { c->ops->publish_credit(c, force); }
/* A credit value from the consumer, which it may set to anything: taken only if it is a
 * record boundary between the last credit and what we wrote; anything else is ignored,
 * and the writer waits for credit as long as its timeout lets it. */
static inline void rs_take_credit(rs_conn *c, uint64_t head)
{
    if (head > c->tx.head_seen && head <= c->tx.pos && !(head & 7)) c->tx.head_seen = head;
}
uint64_t rs_rx_produced(rs_conn *c);

/* rs_preamble.c: client bytes sent before the server's answer travel as TCP frames */
#define RS_PRE_DATA         0xDAu
#define RS_PRE_SWITCH       0x5Au
#define RS_PRE_MAX          65536u
#define RS_PRE_NONBLOCK_MAX 16384u     /* what a nonblocking write puts in one frame */
#define RS_PRE_OVER         (-100000)  /* rs_pre_recv: SWITCH consumed, go on with the ring */
/* Client: the frame a non-blocking write began and the socket could not take whole; its
 * tail is owed by the next writes (rs_pre_send). */
struct rs_pre_open {
    uint32_t owed;            /* payload bytes the frame still needs */
    uint8_t  hdr_left;        /* bytes at the end of hdr not sent yet */
    uint8_t  hdr[RS_PRE_HDR];
};
static inline int rs_pre_is_open(const struct rs_pre_open *o) { return o->owed || o->hdr_left; }
ssize_t  rs_pre_send(int fd, const void *buf, size_t len, int nonblock, int timeout_ms, struct rs_pre_open *open);
int      rs_pre_switch(int fd);
void     rs_pre_switch_later(rs_conn *c);
int      rs_tx_switch_now(rs_conn *c);
/* Before any byte of ours on the TCP socket, and once our first records are in the ring:
 * 1 if the SWITCH is out (or none is due), 0 if the socket has no room for it yet (no
 * byte of ours may go before it; the caller acts as for a full socket). */
static inline int rs_tx_switch(rs_conn *c)
{
    if (__builtin_expect(__atomic_load_n(&c->switch_due, __ATOMIC_ACQUIRE), 0)) return rs_tx_switch_now(c);
    return 1;
}
ssize_t  rs_pre_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);
int      rs_pre_settle(rs_conn *c);
int      rs_pre_settle_locked(rs_conn *c);   /* the same, caller holds rx.lock */
int      rs_pre_quiesce(rs_conn *c, uint64_t ns);
ssize_t  rs_tcp_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);

/* 1 if the peer producing into our ring last ran on the CPU we run on: spinning then only
 * takes the CPU from the very process we wait for. */
int      rs_peer_shares_cpu(rs_conn *c);

/* rs_doorbell.c */
int      rs_bell_send(rs_conn *c, uint8_t kind);
long     rs_bell_scan(const uint8_t *buf, long n, int *next, uint64_t *kinds);
void     rs_bell_garbage(rs_conn *c, int byte);
int      rs_bell_read_result(rs_conn *c, long n);
void     rs_note_sock_error(rs_conn *c, int e);
int      rs_rx_go_idle(rs_conn *c);
int      rs_rx_go_idle_event(rs_conn *c);
int      rs_rx_arm_word_locked(rs_conn *c, const uint32_t **word, uint32_t *seen, size_t room, long app_flags);
int      rs_rx_word_woken_locked(rs_conn *c);
int      rs_rx_go_idle_locked(rs_conn *c, long app_flags);
int      rs_rx_nonblock_empty(rs_conn *c);
void     rs_rx_tidy(rs_conn *c);
int      rs_wait_fd(rs_conn *c, int timeout_ms);
int      rs_peer_gone(rs_conn *c);
void     rs_quiesce_bells(rs_conn *c);
void     rs_rx_bell_every(rs_conn *c, int on);
int      rs_tx_arm_credit(rs_conn *c);
int      rs_tx_arm_credit_locked(rs_conn *c);

/* rs_bells.c: event bells (an eventfd per direction, shm) */
/* The epoll data of an event bell: "rsbll" and the number of the socket it was added for,
 * so the instance's reports say which ring to look at (rs_hooks_epoll.c). */
#define RS_BELL_TAG 0x7273626c6c000000ull
#define RS_BELL_FD_MASK 0xffffffull
#define RS_BELL_EPOLL_DATA(fd) (RS_BELL_TAG | ((uint64_t)(fd) & RS_BELL_FD_MASK))
#define RS_IS_BELL(data) (((data) & ~RS_BELL_FD_MASK) == RS_BELL_TAG)
#define RS_BELL_FD(data) ((int)((data) & RS_BELL_FD_MASK))
/* fd moved to a number in the top eighth of the soft RLIMIT_NOFILE, close-on-exec (where
 * programs that count on low numbers, select() for one, do not meet it); fd if it cannot be. */
int      rs_fd_move_high(int fd);
int      rs_bells_create(int fds[2]);
int      rs_conn_set_bells(rs_conn *c, int own, int peer);
int      rs_bell_raise(rs_conn *c);
int      rs_bell_in_epoll(rs_conn *c, int epfd, uint32_t id, int fd);
void     rs_bells_release(rs_conn *c);
void     rs_bells_drop_own(rs_conn *c);
void     rs_bells_after_fork_child(rs_conn *c);

/* How long a close waits for doorbell bytes still in flight to it (rs_quiesce_bells). */
#define RS_QUIESCE_NS 20000000ull

/* 1 once this side's receive direction reads the TCP socket: after a transport failure
 * that may have lost records at once, after a move only from the peer's MOVED record on. */
static inline int rs_rx_on_tcp(rs_conn *c)
{
    return c->ops->lossy_failure ? RS_GET(c->fb) : __atomic_load_n(&c->rx.move.state, __ATOMIC_ACQUIRE) != 0;
}

/* The control block's advisory CPU words (tx_cpu, rx_cpu): 1 + a CPU, 0 unknown.
 * sched_getcpu reads the rseq area: no system call. */
static inline unsigned rs_cpu_word(void) { return (unsigned)sched_getcpu() + 1u; }
static inline void rs_cpu_note(uint32_t *word)       /* stored only if it changed: a shared line */
{
    unsigned cpu = rs_cpu_word();
    if (__atomic_load_n(word, __ATOMIC_RELAXED) != cpu) __atomic_store_n(word, cpu, __ATOMIC_RELAXED);
}
static inline int rs_cpu_is_mine(const uint32_t *word)
{
    unsigned k = __atomic_load_n(word, __ATOMIC_RELAXED);
    return k && k == rs_cpu_word();
}

/* rs_spill.c */
int      rs_spill_due(rs_conn *c);
size_t   rs_spill_send(rs_conn *c, const void *src, size_t len);
void     rs_spill_settle(rs_conn *c);
void     rs_spill_begin_rx(rs_conn *c, uint32_t count);
int      rs_spill_rx_active(rs_conn *c);
ssize_t  rs_spill_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);
int      rs_spill_rx_ready(rs_conn *c);
long     rs_spill_available(rs_conn *c);

/* rs_hold.c */
#define  RS_HOLD_AFTER_MS 10           /* a writer without room this long takes in what it can read */
int      rs_hold_applies(rs_conn *c);
int      rs_hold_due(rs_conn *c);
int      rs_hold_recheck_ms(rs_conn *c);
void     rs_hold_fill(rs_conn *c);
size_t   rs_hold_take(rs_conn *c, uint8_t *dst, size_t len, int peek);
void     rs_hold_free(rs_conn *c);
void     rs_hold_list(rs_conn *c);     /* a connection its socket object now owns */
void     rs_hold_unlist(rs_conn *c);   /* before it is freed (rs_conn_free) */

/* rs_fallback.c */
void     rs_fb_update_done(rs_conn *c);
void     rs_fb_begin(rs_conn *c, int reason);
void     rs_fb_kick(rs_conn *c);
void     rs_fb_rx_moved(rs_conn *c);
ssize_t  rs_fb_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms);
ssize_t  rs_fb_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);
int      rs_fb_move_tx(rs_conn *c, int reason, int timeout_ms);
int      rs_fb_rx_plain(rs_conn *c);
int      rs_fb_rx_ready(rs_conn *c);
int      rs_fb_tx_writable(rs_conn *c);
int      rs_fb_tx_pending(rs_conn *c);
int      rs_fb_finish_tx(rs_conn *c, int timeout_ms);
void     rs_fb_shutdown(rs_conn *c);
long     rs_fb_rx_available(rs_conn *c);
size_t   rs_fb_rx_take(rs_conn *c, uint8_t *dst, size_t len);
void     rs_fb_settle_rx(rs_conn *c);

/* rs_tcp.c */
rs_conn *rs_conn_new_tcp(int fd);

/* rs_shm.c */
/* A mapped shm segment, as rs_shm_map found and checked it. */
struct rs_seg { void *base; size_t len; uint32_t ring_size; uint64_t salt; };
rs_conn *rs_conn_attach_shm(const struct rs_seg *seg, int fd, int is_server, uint32_t spin_ns);
int      rs_shm_create(uint32_t ring_size, uint64_t salt, size_t *len_out);
int      rs_shm_map(int memfd, struct rs_seg *seg, size_t reserved);
/* rs_ring_budget.c */
struct rs_ring_budget { uint64_t used, max; };
int      rs_ring_memory_reserve(size_t n);      /* -ENOBUFS over RDMASOCK_RING_MEMORY_MAX */
void     rs_ring_memory_release(size_t n);
void     rs_ring_unmap(void *base, size_t len);   /* a ring mapping, and its share of the budget */
uint64_t rs_ring_memory_in_use(void);
uint64_t rs_ring_memory_max(void);

/* recv flags understood by rs_recv (values of the Linux MSG_* flags) */
#define RS_MSG_PEEK     0x02
#define RS_MSG_WAITALL  0x100
#define RS_MSG_DONTWAIT 0x40
#define RS_MSG_TRUNC    0x20

#endif
