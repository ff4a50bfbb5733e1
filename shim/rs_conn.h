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
#include <stdint.h>
#include <sys/types.h>
#include "rs_wire.h"
#include "rs_rdma.h"

#define RS_ERRMSG_LEN 160

struct rs_conn {
    int      fd;              /* the application's TCP socket: doorbell + liveness */
    uint32_t ring_size, mask, max_payload;
    uint64_t salt;

    /* transmit side: records go into tx_ring (peer's receive ring) */
    uint8_t *tx_ring;
    struct rs_dir_ctl *tx_ctl;
    uint64_t tx_pos;          /* absolute ring position of the next record */
    uint64_t tx_seq;          /* sequence number of the next record */
    uint64_t tx_bytes;        /* payload bytes published */
    uint64_t tx_head_seen;    /* last credit read from tx_ctl->head */

    /* receive side: records arrive in rx_ring */
    uint8_t *rx_ring;
    struct rs_dir_ctl *rx_ctl;
    uint64_t rx_pos;          /* absolute ring position of the current record */
    uint64_t rx_seq;
    uint64_t rx_bytes;        /* payload bytes handed to the application */
    uint64_t rx_head_pub;     /* credit last published (rx_ctl->head) */
    uint32_t rx_cur_len;      /* payload length of the current, validated record (0: none) */
    uint32_t rx_cur_off;      /* bytes of it already consumed */
    uint64_t bells_drained;   /* doorbell bytes read off the TCP socket */

    /* state */
    uint8_t  fin_seen;        /* peer's FIN record consumed: reads return 0 */
    uint8_t  fin_sent;        /* our FIN record written: writes fail with EPIPE */
    uint8_t  tcp_eof;         /* the TCP socket reported EOF/HUP: the peer process is gone */
    uint8_t  shut_rd;
    uint8_t  rx_pre;          /* server: the client's preamble frames come first (rs_preamble.c) */
    uint8_t  lazy_tidy;       /* preload: its hooks answer readiness from the ring, so doorbells of
                               * consumed records may stay pending (no tidy system calls), and a
                               * non-blocking receive that finds nothing does not arm (rs_doorbell.c) */
    uint64_t last_peek_ns;    /* lazy: when a non-blocking receive last looked for EOF */
    uint32_t pre_left;        /* payload bytes left in the open preamble frame */
    int      err;             /* sticky error (positive errno), 0 if healthy */
    uint64_t suspect_pos, suspect_since;     /* rdma: a record that looked corrupt (rs_consume.c) */
    uint32_t suspect_lw, suspect_footer;
    char     errmsg[RS_ERRMSG_LEN];

    /* rdma transport failed mid-stream: both directions go on over the TCP socket
     * (rs_fallback.c).  tx_lock (rdma only) makes a producing thread and a thread that
     * starts the fallback take turns on the transmit state. */
    uint8_t  fb;              /* set once, by whichever side noticed the failure first */
    uint8_t  fb_tx;           /* transmit: 0 ring, 1 RESYNC frame and resend pending, 2 plain TCP */
    uint8_t  fb_rx;           /* receive: 0 ring, 1 doorbells before the frame, 2 frame, 3 repeat, 4 plain TCP */
    uint8_t  fb_done;         /* both directions plain TCP: the kernel socket tells readiness */
    uint8_t  fb_shut_pending; /* FIN to send as a TCP half-close once the resend is out */
    uint8_t  fb_out_len, fb_out_sent, fb_in_got;
    uint8_t  fb_out[16], fb_in[16];  /* our RESYNC frame, the peer's */
    uint32_t fb_resend_off;   /* payload bytes of the record at fb_resend_pos already resent */
    uint64_t fb_resend_pos, fb_resend_end;   /* shadow ring positions still to resend */
    uint64_t fb_skip;         /* bytes the peer repeats that we already delivered */
    uint8_t  tx_locking;      /* rdma: the two locks below are initialised */
    pthread_mutex_t tx_lock;  /* transmit state, between a producing thread and rs_fb_kick */
    pthread_mutex_t rx_lock;  /* the socket's read side while doorbells turn into stream bytes */

    /* tuning */
    uint32_t spin_ns;         /* busy-poll budget before sleeping in the kernel (maximum) */
    uint32_t spin_cur;        /* current adaptive budget, <= spin_ns */

    /* memory owned by this connection: the shm mapping, or the rdma rings and words */
    void    *map_base;
    size_t   map_len;
    struct rs_rdma *rdma;     /* rdma transport state (rs_rdma.c), NULL for shm */

    /* statistics */
    uint64_t stat_bells_sent, stat_sleeps, stat_records_tx, stat_records_rx;
};
typedef struct rs_conn rs_conn;

/* rs_conn.c */
rs_conn *rs_conn_new_tcp(int fd);
rs_conn *rs_conn_attach_shm(void *base, size_t len, int fd, int is_server, uint32_t spin_ns);
void     rs_conn_free(rs_conn *c);
const char *rs_conn_errmsg(const rs_conn *c);
long     rs_fd_recv(int fd, void *buf, size_t n, int flags);
void     rs_conn_set_error(rs_conn *c, int err, const char *fmt, ...);

/* rs_produce.c */
ssize_t  rs_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms);
int      rs_send_fin(rs_conn *c);
void     rs_tx_flush_bell(rs_conn *c);
int      rs_tx_writable(rs_conn *c);

/* rs_consume.c */
ssize_t  rs_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);
ssize_t  rs_rx_available(rs_conn *c);
int      rs_rx_ready(rs_conn *c);
size_t   rs_rx_take(rs_conn *c, uint8_t *dst, size_t len, int peek);
void     rs_rx_publish_credit(rs_conn *c, int force);
uint64_t rs_rx_produced(rs_conn *c);

/* rs_preamble.c: client bytes sent before the server's answer travel as TCP frames */
#define RS_PRE_HDR          8
#define RS_PRE_DATA         0xDAu
#define RS_PRE_SWITCH       0x5Au
#define RS_PRE_MAX          65536u
#define RS_PRE_NONBLOCK_MAX 16384u     /* a nonblocking write never waits long for a frame's tail */
#define RS_PRE_OVER         (-100000)  /* rs_pre_recv: SWITCH consumed, go on with the ring */
ssize_t  rs_pre_send(int fd, const void *buf, size_t len, int nonblock, int timeout_ms);
int      rs_pre_switch(int fd);
ssize_t  rs_pre_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);
int      rs_pre_settle(rs_conn *c);
ssize_t  rs_tcp_recv(int fd, void *buf, size_t len, int flags, int timeout_ms);

/* 1 if the peer producing into our ring last ran on the CPU we run on: spinning then only
 * takes the CPU from the very process we wait for. */
int      rs_peer_shares_cpu(rs_conn *c);

/* rs_doorbell.c */
uint64_t rs_now_ns(void);
void     rs_ring_bell(rs_conn *c, struct rs_dir_ctl *ctl, uint64_t *counter, uint8_t kind);
int      rs_rx_go_idle(rs_conn *c);
int      rs_rx_nonblock_empty(rs_conn *c);
void     rs_rx_tidy(rs_conn *c);
int      rs_wait_fd(rs_conn *c, int timeout_ms);
int      rs_tx_arm_credit(rs_conn *c);
void     rs_relax(void);
/* A spinning wait, `spun_ns` into it: pure spinning for RS_PURE_SPIN_NS, then every round
 * yields the CPU, since the peer we wait for may share it (2-core machines). */
#define RS_PURE_SPIN_NS 2000u
void     rs_spin_pause(uint64_t spun_ns);

/* rs_fallback.c */
void     rs_fb_begin(rs_conn *c);
void     rs_fb_kick(rs_conn *c);
ssize_t  rs_fb_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms);
ssize_t  rs_fb_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);
int      rs_fb_rx_ready(rs_conn *c);
int      rs_fb_tx_writable(rs_conn *c);
int      rs_fb_tx_pending(rs_conn *c);
int      rs_fb_finish_tx(rs_conn *c, int timeout_ms);
void     rs_fb_shutdown(rs_conn *c);
long     rs_fb_rx_available(rs_conn *c);
void     rs_tx_lock(rs_conn *c);
void     rs_tx_unlock(rs_conn *c);

/* rs_shm.c */
int      rs_shm_create(uint32_t ring_size, uint64_t salt, size_t *len_out);
void    *rs_shm_map(int memfd, size_t *len_out, int *err);

/* recv flags understood by rs_recv (values of the Linux MSG_* flags) */
#define RS_MSG_PEEK     0x02
#define RS_MSG_WAITALL  0x100
#define RS_MSG_DONTWAIT 0x40

#endif
