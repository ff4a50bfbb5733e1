/* rs_verbs.c - the `rdma` transport's verbs objects, made through libibverbs' public API.
 *
 * One struct rs_verbs per connection side: its own protection domain (so a peer's rkeys
 * reach that connection's memory and nothing else), one CQ, one RC queue pair, and the
 * memory regions the control plane registers.  Device contexts are heavy (a uverbs file,
 * doorbell pages) and shared, one per device per process, closed with their last user: a
 * device being removed (`rdma link delete` waits for every open context) is released as
 * soon as its connections end.
 *
 * The control plane (rdmasock/rdma_setup.py) chooses device, port and GID with pyverbs and
 * exchanges the parameters; everything the data path (rs_rdma.c) posts on is created here,
 * so the pointers it uses are ours and no pyverbs object layout matters.  libibverbs is
 * loaded with dlopen on first use: the preload library, which contains this file too,
 * never loads it in a program that does not use RDMA.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "rs_conn.h"
#include "rs_verbs.h"

#if defined(__has_include) && !defined(RS_NO_VERBS)
#if __has_include(<infiniband/verbs.h>)
#include <infiniband/verbs.h>
#define RS_HAVE_VERBS 1
#endif
#endif

static void say(char *err, size_t len, const char *fmt, ...)
{
    if (!err || !len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

#ifndef RS_HAVE_VERBS

int rs_verbs_available(char *err, size_t errlen) { say(err, errlen, "built without libibverbs headers"); return 0; }
struct rs_verbs *rs_verbs_open(const char *device, int port, uint32_t sq_depth, uint32_t rq_depth, uint32_t want_inline,
                               char *err, size_t errlen)
{
    (void)device; (void)port; (void)sq_depth; (void)rq_depth; (void)want_inline;
    say(err, errlen, "built without libibverbs headers");
    errno = ENOTSUP;
    return NULL;
}
uint32_t rs_verbs_qp_num(struct rs_verbs *v) { (void)v; return 0; }
uint32_t rs_verbs_max_inline(struct rs_verbs *v) { (void)v; return 0; }
int rs_verbs_reg(struct rs_verbs *v, void *addr, size_t len, int access, uint32_t *lkey, uint32_t *rkey)
{
    (void)v; (void)addr; (void)len; (void)access; (void)lkey; (void)rkey;
    return -ENOTSUP;
}
int rs_verbs_connect(struct rs_verbs *v, const struct rs_verbs_path *p, char *err, size_t errlen)
{
    (void)v; (void)p; say(err, errlen, "built without libibverbs headers");
    return -ENOTSUP;
}
int rs_verbs_post_write(struct rs_verbs *v, uint64_t laddr, uint32_t len, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                        int flags, uint64_t wr_id)
{
    (void)v; (void)laddr; (void)len; (void)lkey; (void)raddr; (void)rkey; (void)flags; (void)wr_id;
    return -ENOTSUP;
}
int rs_verbs_poll(struct rs_verbs *v, struct rs_verbs_wc *wc, int n) { (void)v; (void)wc; (void)n; return -ENOTSUP; }
int rs_verbs_qp_state(struct rs_verbs *v) { (void)v; return -ENOTSUP; }
int rs_verbs_qp_access(struct rs_verbs *v) { (void)v; return -ENOTSUP; }
int rs_verbs_qp_error(struct rs_verbs *v) { (void)v; return -ENOTSUP; }
int rs_verbs_stop_qp(void *qp) { (void)qp; return -ENOTSUP; }
int rs_verbs_async_fd(struct rs_verbs *v) { (void)v; return -1; }
int rs_verbs_port_state(struct rs_verbs *v) { (void)v; return -ENOTSUP; }
int rs_verbs_async_event(struct rs_verbs *v) { (void)v; return -1; }
void rs_verbs_params(struct rs_verbs *v, struct rs_rdma_params *p) { (void)v; (void)p; }
void rs_verbs_close(struct rs_verbs *v) { (void)v; }

#else

/* The libibverbs entry points we call (all exported, stable since IBVERBS_1.1). */
static struct {
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
    int (*destroy_cq)(struct ibv_cq *);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*destroy_qp)(struct ibv_qp *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
    int (*query_qp)(struct ibv_qp *, struct ibv_qp_attr *, int, struct ibv_qp_init_attr *);
    int (*query_port)(struct ibv_context *, uint8_t, struct _compat_ibv_port_attr *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    int (*dereg_mr)(struct ibv_mr *);
    int (*get_async_event)(struct ibv_context *, struct ibv_async_event *);
    void (*ack_async_event)(struct ibv_async_event *);
} ib;
static int ib_state;                 /* 0 not tried, 1 loaded, -1 failed */
static char ib_why[160];
static pthread_mutex_t ib_lock = PTHREAD_MUTEX_INITIALIZER;

static int load_verbs(void)
{
    pthread_mutex_lock(&ib_lock);
    if (!ib_state) {
        void *h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!h) {
            snprintf(ib_why, sizeof ib_why, "cannot load libibverbs.so.1: %s", dlerror());
            ib_state = -1;
        } else {
#define SYM(field, name) \
            if (ib_state == 0 && !(*(void **)&ib.field = dlsym(h, name))) { \
                snprintf(ib_why, sizeof ib_why, "libibverbs.so.1 has no %s", name); ib_state = -1; }
            SYM(get_device_list, "ibv_get_device_list") SYM(free_device_list, "ibv_free_device_list")
            SYM(get_device_name, "ibv_get_device_name") SYM(open_device, "ibv_open_device")
            SYM(close_device, "ibv_close_device") SYM(alloc_pd, "ibv_alloc_pd") SYM(dealloc_pd, "ibv_dealloc_pd")
            SYM(create_cq, "ibv_create_cq") SYM(destroy_cq, "ibv_destroy_cq") SYM(create_qp, "ibv_create_qp")
            SYM(destroy_qp, "ibv_destroy_qp") SYM(modify_qp, "ibv_modify_qp") SYM(query_qp, "ibv_query_qp")
            SYM(query_port, "ibv_query_port")
            SYM(reg_mr, "ibv_reg_mr") SYM(dereg_mr, "ibv_dereg_mr") SYM(get_async_event, "ibv_get_async_event")
            SYM(ack_async_event, "ibv_ack_async_event")
#undef SYM
            if (!ib_state) ib_state = 1;
        }
    }
    int ok = ib_state == 1;
    pthread_mutex_unlock(&ib_lock);
    return ok;
}

int rs_verbs_available(char *err, size_t errlen)
{
    if (load_verbs()) return 1;
    say(err, errlen, "%s", ib_why);
    return 0;
}

/* ---- shared device contexts --------------------------------------------------------- */

struct shared_ctx {
    struct shared_ctx *next;
    char name[64];
    struct ibv_context *ctx;
    int users;
};
static struct shared_ctx *contexts;
static pthread_mutex_t contexts_lock = PTHREAD_MUTEX_INITIALIZER;

static struct shared_ctx *context_get(const char *name, char *err, size_t errlen)
{
    pthread_mutex_lock(&contexts_lock);
    struct shared_ctx *s = contexts;
    while (s && strcmp(s->name, name)) s = s->next;
    if (!s) {
        int n = 0;
        struct ibv_device **list = ib.get_device_list(&n);
        struct ibv_context *ctx = NULL;
        for (int i = 0; list && i < n && !ctx; i++)
            if (!strcmp(ib.get_device_name(list[i]), name)) ctx = ib.open_device(list[i]);
        if (list) ib.free_device_list(list);
        if (ctx && (s = calloc(1, sizeof *s))) {
            snprintf(s->name, sizeof s->name, "%s", name);
            s->ctx = ctx;
            s->next = contexts;
            contexts = s;
        } else {
            if (ctx) ib.close_device(ctx);
            say(err, errlen, "cannot open RDMA device %s", name);
        }
    }
    if (s) s->users++;
    pthread_mutex_unlock(&contexts_lock);
    return s;
}

static void context_put(struct shared_ctx *s)
{
    pthread_mutex_lock(&contexts_lock);
    int last = --s->users == 0;
    if (last) {
        struct shared_ctx **p = &contexts;
        while (*p != s) p = &(*p)->next;
        *p = s->next;
    }
    pthread_mutex_unlock(&contexts_lock);
    if (last) {
        ib.close_device(s->ctx);
        free(s);
    }
}

/* ---- one side's objects --------------------------------------------------------------- */

#define RS_VERBS_MAX_MR 8

struct rs_verbs {
    struct shared_ctx *dev;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_mr *mr[RS_VERBS_MAX_MR];
    int nmr;
    int port;
    uint32_t max_inline;
    pthread_mutex_t lock;            /* rs_verbs_post_write / rs_verbs_poll: one thread at a time */
};

/* RC timers: local ACK timeout 4.096 us * 2**14 = 67 ms, 6 retries: a peer that vanished
 * without closing its QP is noticed after about half a second. */
#define ACK_TIMEOUT   14
#define RETRY_CNT     6
#define RNR_RETRY     6
#define MIN_RNR_TIMER 12
#define HOP_LIMIT     64

struct rs_verbs *rs_verbs_open(const char *device, int port, uint32_t sq_depth, uint32_t rq_depth, uint32_t want_inline,
                               char *err, size_t errlen)
{
    if (!rs_verbs_available(err, errlen)) { errno = ENOTSUP; return NULL; }
    struct rs_verbs *v = calloc(1, sizeof *v);
    if (!v) { say(err, errlen, "out of memory"); errno = ENOMEM; return NULL; }
    pthread_mutex_init(&v->lock, NULL);
    v->port = port;
    v->dev = context_get(device, err, errlen);
    if (!v->dev) goto fail;
    v->pd = ib.alloc_pd(v->dev->ctx);
    v->cq = v->pd ? ib.create_cq(v->dev->ctx, (int)(sq_depth + rq_depth + 1), NULL, NULL, 0) : NULL;
    if (!v->cq) { say(err, errlen, "PD/CQ on %s: %s", device, strerror(errno)); goto fail; }
    /* The largest inline size the device takes, up to the one asked for. */
    for (uint32_t n = want_inline;; n /= 2) {
        struct ibv_qp_init_attr a = {
            .send_cq = v->cq, .recv_cq = v->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
            .cap = { .max_send_wr = sq_depth, .max_recv_wr = rq_depth, .max_send_sge = 1, .max_recv_sge = 1,
                     .max_inline_data = n },
        };
        v->qp = ib.create_qp(v->pd, &a);
        if (v->qp) { v->max_inline = a.cap.max_inline_data > n ? a.cap.max_inline_data : n; break; }
        if (n == 0) { say(err, errlen, "cannot create an RC QP on %s: %s", device, strerror(errno)); goto fail; }
    }
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = (uint8_t)port,
                             /* Remote READ reaches only regions registered for it (our counters);
                              * the rings are remote-write only; no atomics. */
                             .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ };
    int rc = ib.modify_qp(v->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc) { say(err, errlen, "QP to INIT: %s", strerror(rc)); goto fail; }
    return v;
fail:;
    int e = errno ? errno : EIO;
    rs_verbs_close(v);
    errno = e;
    return NULL;
}

uint32_t rs_verbs_qp_num(struct rs_verbs *v) { return v->qp->qp_num; }
uint32_t rs_verbs_max_inline(struct rs_verbs *v) { return v->max_inline; }

/* Registers [addr, addr+len) with `access` (IBV_ACCESS_* bits).  0, or -errno: ENOMEM,
 * EPERM or EAGAIN mean the memlock limit. */
int rs_verbs_reg(struct rs_verbs *v, void *addr, size_t len, int access, uint32_t *lkey, uint32_t *rkey)
{
    if (v->nmr == RS_VERBS_MAX_MR) return -ENOSPC;
    errno = 0;
    struct ibv_mr *mr = ib.reg_mr(v->pd, addr, len, access);
    if (!mr) return -(errno ? errno : EIO);
    v->mr[v->nmr++] = mr;
    *lkey = mr->lkey;
    *rkey = mr->rkey;
    return 0;
}

/* INIT -> RTR -> RTS towards the peer described by p. */
int rs_verbs_connect(struct rs_verbs *v, const struct rs_verbs_path *p, char *err, size_t errlen)
{
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTR, .path_mtu = (enum ibv_mtu)p->path_mtu, .dest_qp_num = p->dest_qpn,
        .rq_psn = p->rq_psn, .max_dest_rd_atomic = 1,          /* one READ of our counters at a time */
        .min_rnr_timer = MIN_RNR_TIMER,
        .ah_attr = { .dlid = p->dlid, .sl = 0, .is_global = 1, .port_num = (uint8_t)v->port,
                     .grh = { .sgid_index = p->sgid_index, .hop_limit = HOP_LIMIT } },
    };
    memcpy(a.ah_attr.grh.dgid.raw, p->dgid, 16);
    int rc = ib.modify_qp(v->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc) { say(err, errlen, "QP to RTR: %s", strerror(rc)); return -rc; }
    struct ibv_qp_attr b = { .qp_state = IBV_QPS_RTS, .timeout = ACK_TIMEOUT, .retry_cnt = RETRY_CNT,
                             .rnr_retry = RNR_RETRY, .sq_psn = p->sq_psn,
                             .max_rd_atomic = 1 };            /* we READ the peer's counters, one at a time */
    rc = ib.modify_qp(v->qp, &b, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                 IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc) { say(err, errlen, "QP to RTS: %s", strerror(rc)); return -rc; }
    return 0;
}

/* One RDMA WRITE (flags: RS_VERBS_SIGNALED, RS_VERBS_INLINE).  For the control plane's own
 * use and tests; the connection's data path posts in rs_rdma.c. */
int rs_verbs_post_write(struct rs_verbs *v, uint64_t laddr, uint32_t len, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                        int flags, uint64_t wr_id)
{
    struct ibv_sge s = { .addr = laddr, .length = len, .lkey = lkey };
    struct ibv_send_wr w = { .wr_id = wr_id, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE }, *bad = NULL;
    if (flags & RS_VERBS_SIGNALED) w.send_flags |= IBV_SEND_SIGNALED;
    if (flags & RS_VERBS_INLINE) w.send_flags |= IBV_SEND_INLINE;
    w.wr.rdma.remote_addr = raddr;
    w.wr.rdma.rkey = rkey;
    pthread_mutex_lock(&v->lock);
    int rc = ibv_post_send(v->qp, &w, &bad);
    pthread_mutex_unlock(&v->lock);
    return -rc;
}

/* Completions now available, up to n (never blocks): their count, or -errno. */
int rs_verbs_poll(struct rs_verbs *v, struct rs_verbs_wc *out, int n)
{
    struct ibv_wc wc[16];
    if (n > 16) n = 16;
    pthread_mutex_lock(&v->lock);
    int got = ibv_poll_cq(v->cq, n, wc);
    pthread_mutex_unlock(&v->lock);
    for (int i = 0; i < got; i++) {
        out[i].wr_id = wc[i].wr_id;
        out[i].status = (int)wc[i].status;
        out[i].opcode = (int)wc[i].opcode;
        out[i].byte_len = wc[i].byte_len;
    }
    return got < 0 ? -EIO : got;
}

_Static_assert(RS_VERBS_LOCAL_WRITE == IBV_ACCESS_LOCAL_WRITE && RS_VERBS_REMOTE_WRITE == IBV_ACCESS_REMOTE_WRITE &&
               RS_VERBS_REMOTE_READ == IBV_ACCESS_REMOTE_READ, "IBV_ACCESS_* values");

int rs_verbs_qp_state(struct rs_verbs *v)
{
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;
    int rc = ib.query_qp(v->qp, &a, IBV_QP_STATE, &ia);
    return rc ? -rc : (int)a.qp_state;
}

int rs_verbs_qp_access(struct rs_verbs *v)
{
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;
    int rc = ib.query_qp(v->qp, &a, IBV_QP_ACCESS_FLAGS, &ia);
    return rc ? -rc : (int)a.qp_access_flags;
}

/* Moves a QP to the error state: its posted work completes flushed, new posts fail.  The
 * data path stops a failed transport's QP this way, so the provider stops retrying work
 * nobody waits for (Soft-RoCE retries a send on a port without carrier without end). */
int rs_verbs_stop_qp(void *qp)
{
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
    if (!qp || !load_verbs()) return -ENOTSUP;
    return -ib.modify_qp(qp, &a, IBV_QP_STATE);
}

/* Fault injection: how the tests make a transport fail mid-stream. */
int rs_verbs_qp_error(struct rs_verbs *v)
{
    return rs_verbs_stop_qp(v->qp);
}

int rs_verbs_async_fd(struct rs_verbs *v) { return v->dev->ctx->async_fd; }

/* The state of our port (enum ibv_port_state: 4 active), or -errno. */
int rs_verbs_port_state(struct rs_verbs *v)
{
    struct ibv_port_attr a;
    memset(&a, 0, sizeof a);
    struct verbs_context *vctx = verbs_get_ctx_op(v->dev->ctx, query_port);
    int rc = vctx ? vctx->query_port(v->dev->ctx, (uint8_t)v->port, &a, sizeof a)
                  : ib.query_port(v->dev->ctx, (uint8_t)v->port, (struct _compat_ibv_port_attr *)&a);
    return rc ? -rc : (int)a.state;
}

/* The next pending asynchronous event of the device context (enum ibv_event_type), or -1
 * if none is pending.  The context is shared by the process's connections on that
 * device, so a device or port event reaches whichever side asks first. */
int rs_verbs_async_event(struct rs_verbs *v)
{
    struct pollfd p = { .fd = v->dev->ctx->async_fd, .events = POLLIN };
    if (poll(&p, 1, 0) <= 0) return -1;
    struct ibv_async_event ev;
    if (ib.get_async_event(v->dev->ctx, &ev)) return -1;
    int type = (int)ev.event_type;
    ib.ack_async_event(&ev);
    return type;
}

void rs_verbs_params(struct rs_verbs *v, struct rs_rdma_params *p)
{
    p->qp = v->qp;
    p->cq = v->cq;
    p->max_inline = v->max_inline;
}

/* QP, memory regions, CQ, PD, in that order; then our use of the device context. */
void rs_verbs_close(struct rs_verbs *v)
{
    if (!v) return;
    if (v->qp) ib.destroy_qp(v->qp);
    for (int i = v->nmr - 1; i >= 0; i--) ib.dereg_mr(v->mr[i]);
    if (v->cq) ib.destroy_cq(v->cq);
    if (v->pd) ib.dealloc_pd(v->pd);
    if (v->dev) context_put(v->dev);
    pthread_mutex_destroy(&v->lock);
    free(v);
}
#endif
