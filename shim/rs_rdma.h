/* rs_rdma.h - the `rdma` transport's data path (docs/PROTOCOL.md section 5).
 *
 * The ring format is the one of rs_wire.h.  What differs from `shm` is only how bytes reach
 * the peer: the producer builds each record in a local shadow of the peer's ring and copies
 * it there with one RDMA WRITE; the control words that `shm` shares in one page are here
 * per side: each side stores its own counters locally ("own", which the peer may RDMA READ)
 * and pushes them into the peer's "mirror" with RDMA WRITE.  A mirror only ever lags, so
 * every decision that must not miss an update (going to sleep, waiting for credit) first
 * announces itself with a push and then RDMA READs the peer's own words: the READ executes
 * at the peer after the push has landed there, which gives the same store/load ordering a
 * shared page gives with a fence.
 */
#ifndef RS_RDMA_H
#define RS_RDMA_H
#include <stdint.h>
#include <stddef.h>

struct rs_conn;

/* One side's published counters (64 bytes, little endian, 8-byte aligned words). */
struct rs_rdma_words {
    uint64_t rx_head;      /* consumer: bytes of its ring consumed and re-zeroed (the peer's credit) */
    uint64_t want_seq;     /* consumer: idle episodes, each asking for one data doorbell */
    uint64_t tx_wait_seq;  /* producer: full-ring episodes, each asking for one credit doorbell */
    uint64_t tx_seq;       /* producer: records posted into the peer's ring (WRAP and FIN included) */
    uint64_t tx_bytes;     /* producer: payload bytes posted */
    uint64_t bells_sent;   /* doorbell bytes sent on the TCP socket */
    uint64_t failed;       /* non-zero once this side's RDMA transport failed */
    uint64_t reserved;
};

/* Layout of the memory one side allocates (rs_rdma_alloc) and registers. */
#define RS_RDMA_OFF_OWN     0u       /* struct rs_rdma_words: the peer may READ it */
#define RS_RDMA_OFF_MIRROR  64u      /* the peer's words, which the peer WRITEs */
#define RS_RDMA_OFF_SYNC    128u     /* where our READ of the peer's words lands */
#define RS_RDMA_OFF_CTL     1024u    /* two private struct rs_dir_ctl (rx, tx) */
#define RS_RDMA_HDR         4096u    /* then the receive ring, then the transmit shadow */

/* What the control plane (rdmasock/transport_rdma.py, pyverbs) set up for one connection. */
struct rs_rdma_params {
    void    *qp;            /* struct ibv_qp *, RC, in RTS */
    void    *cq;            /* struct ibv_cq * of its send queue */
    uint32_t lkey_own, lkey_sync, lkey_shadow;
    uint32_t rkey_ring, rkey_mirror, rkey_words;        /* the peer's */
    uint64_t raddr_ring, raddr_mirror, raddr_words;     /* the peer's */
    uint32_t max_inline;    /* records up to this size are posted inline */
    uint32_t sq_depth;      /* send queue capacity */
    uint32_t sync_timeout_ms;
};

void    *rs_rdma_alloc(uint32_t ring_size, size_t *len_out);
void     rs_rdma_unalloc(void *base, size_t len);
struct rs_conn *rs_conn_attach_rdma(void *base, size_t len, uint32_t ring_size, uint64_t salt, int fd,
                                    uint32_t spin_ns, const struct rs_rdma_params *p);
int      rs_rdma_supported(void);

/* For the control plane (rdmasock/transport_rdma.py), before it destroys the verbs
 * objects: wait for our last WRITEs to leave, then read doorbells the peer still rang.
 * The data path reaches this transport only through its table, rs_transport_rdma. */
int      rs_rdma_quiesce(struct rs_conn *c, int timeout_ms);
void     rs_rdma_drain(struct rs_conn *c);
#endif
