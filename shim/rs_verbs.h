/* rs_verbs.h - the `rdma` transport's verbs objects (rs_verbs.c), for the control plane. */
#ifndef RS_VERBS_H
#define RS_VERBS_H
#include <stddef.h>
#include <stdint.h>
#include "rs_rdma.h"

struct rs_verbs;

/* The peer's side of the path, from its PARAMS (docs/RDMA.md), and our choices. */
struct rs_verbs_path {
    uint32_t dest_qpn, rq_psn, sq_psn;   /* the peer's QP and PSN; our own PSN */
    uint16_t dlid;                        /* InfiniBand LID, 0 on RoCE */
    uint8_t  path_mtu;                    /* enum ibv_mtu: the smaller of both ports' */
    uint8_t  sgid_index;                  /* our GID */
    uint8_t  dgid[16];                    /* the peer's GID */
};

struct rs_verbs_wc { uint64_t wr_id; int status, opcode; uint32_t byte_len; };

#define RS_VERBS_SIGNALED 1
#define RS_VERBS_INLINE   2

/* Memory region access bits: the kernel ABI's IBV_ACCESS_* values (checked in rs_verbs.c). */
#define RS_VERBS_LOCAL_WRITE  1
#define RS_VERBS_REMOTE_WRITE 2
#define RS_VERBS_REMOTE_READ  4

int      rs_verbs_available(char *err, size_t errlen);
struct rs_verbs *rs_verbs_open(const char *device, int port, uint32_t sq_depth, uint32_t rq_depth, uint32_t want_inline,
                               char *err, size_t errlen);
uint32_t rs_verbs_qp_num(struct rs_verbs *v);
uint32_t rs_verbs_max_inline(struct rs_verbs *v);
int      rs_verbs_reg(struct rs_verbs *v, void *addr, size_t len, int access, uint32_t *lkey, uint32_t *rkey);
int      rs_verbs_connect(struct rs_verbs *v, const struct rs_verbs_path *p, char *err, size_t errlen);
int      rs_verbs_post_write(struct rs_verbs *v, uint64_t laddr, uint32_t len, uint32_t lkey, uint64_t raddr,
                             uint32_t rkey, int flags, uint64_t wr_id);
int      rs_verbs_poll(struct rs_verbs *v, struct rs_verbs_wc *wc, int n);
int      rs_verbs_qp_state(struct rs_verbs *v);
int      rs_verbs_qp_access(struct rs_verbs *v);          /* the QP's remote access flags, or -errno */
int      rs_verbs_qp_error(struct rs_verbs *v);
int      rs_verbs_stop_qp(void *qp);                      /* struct ibv_qp * into ERR; 0 or -errno */
int      rs_verbs_async_fd(struct rs_verbs *v);
int      rs_verbs_port_state(struct rs_verbs *v);
int      rs_verbs_async_event(struct rs_verbs *v);
void     rs_verbs_params(struct rs_verbs *v, struct rs_rdma_params *p);     /* qp, cq, max_inline */
void     rs_verbs_close(struct rs_verbs *v);
#endif
