"""A tiny cffi-compiled helper, independent of rdmasock's own C code, that posts RDMA WRITEs
and polls completions with libibverbs directly on the QP/CQ of an rdmasock.rdma_setup
Endpoint (pointers from Endpoint.native()): a second user of those pointers shows that they
are the live verbs objects the data path posts on.

    python tests/rdma/native_post.py      # build (on the host, before booting the VM)
    import native_post; lib = native_post.load()

The module is built once into .cache/rdma-native/ under a name derived from the source hash.
"""
import hashlib
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BUILD = os.path.join(REPO, ".cache", "rdma-native")

CDEF = """
int rs_post_write(uintptr_t qp, uint64_t laddr, uint32_t len, uint32_t lkey,
                  uint64_t raddr, uint32_t rkey, int flags, uint64_t wr_id);
int rs_poll(uintptr_t cq, int max, uint64_t *wr_ids, int *statuses);
int rs_write_loop(uintptr_t qp, uintptr_t cq, uint64_t laddr, uint32_t lkey, uint64_t raddr,
                  uint32_t rkey, uint32_t len, int use_inline, int count, int signal_every,
                  int window, uint64_t *post_ns, uint64_t *total_ns);
#define RS_SIGNALED ...
#define RS_INLINE ...
"""

SOURCE = r"""
#include <infiniband/verbs.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sched.h>

#define RS_SIGNALED IBV_SEND_SIGNALED
#define RS_INLINE IBV_SEND_INLINE

static uint64_t rs_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int rs_post_write(uintptr_t qp, uint64_t laddr, uint32_t len, uint32_t lkey,
                  uint64_t raddr, uint32_t rkey, int flags, uint64_t wr_id)
{
    struct ibv_sge sge;
    struct ibv_send_wr wr, *bad = NULL;
    sge.addr = laddr;
    sge.length = len;
    sge.lkey = lkey;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = (unsigned)flags;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    return ibv_post_send((struct ibv_qp *)qp, &wr, &bad);
}

int rs_poll(uintptr_t cq, int max, uint64_t *wr_ids, int *statuses)
{
    struct ibv_wc wc[16];
    int n, i;
    if (max > 16)
        max = 16;
    n = ibv_poll_cq((struct ibv_cq *)cq, max, wc);
    for (i = 0; i < n; i++) {
        wr_ids[i] = wc[i].wr_id;
        statuses[i] = wc[i].status;
    }
    return n;
}

/* count WRITEs of len bytes; every signal_every-th is signaled; at most `window` posts
 * outstanding (waits for a signaled completion beyond that).  Returns 0, or the failing
 * ibv_post_send errno (> 0), or -(wc status) - 1000 on an error completion. */
int rs_write_loop(uintptr_t qp, uintptr_t cq, uint64_t laddr, uint32_t lkey, uint64_t raddr,
                  uint32_t rkey, uint32_t len, int use_inline, int count, int signal_every,
                  int window, uint64_t *post_ns, uint64_t *total_ns)
{
    uint64_t t_start = rs_now(), in_post = 0, done = 0;
    int i, rc;
    for (i = 0; i < count; i++) {
        int flags = (use_inline ? IBV_SEND_INLINE : 0) |
                    ((i % signal_every == signal_every - 1 || i == count - 1) ? IBV_SEND_SIGNALED : 0);
        while ((uint64_t)i - done >= (uint64_t)window) {
            struct ibv_wc wc;
            int n = ibv_poll_cq((struct ibv_cq *)cq, 1, &wc);
            if (n < 0)
                return -2000;
            if (n == 0) {
                sched_yield();
                continue;
            }
            if (wc.status != IBV_WC_SUCCESS)
                return -1000 - (int)wc.status;
            done = wc.wr_id + 1;
        }
        uint64_t t0 = rs_now();
        rc = rs_post_write(qp, laddr, len, lkey, raddr, rkey, flags, (uint64_t)i);
        in_post += rs_now() - t0;
        if (rc)
            return rc;
    }
    while (done < (uint64_t)count) {
        struct ibv_wc wc;
        int n = ibv_poll_cq((struct ibv_cq *)cq, 1, &wc);
        if (n < 0)
            return -2000;
        if (n == 0) {
            sched_yield();
            continue;
        }
        if (wc.status != IBV_WC_SUCCESS)
            return -1000 - (int)wc.status;
        done = wc.wr_id + 1;
    }
    *post_ns = in_post;
    *total_ns = rs_now() - t_start;
    return 0;
}
"""


def module_name():
    return "_rs_post_" + hashlib.sha256((CDEF + SOURCE).encode()).hexdigest()[:10]


def build():
    """Compile the helper (needs gcc, cffi and libibverbs-dev); returns the module name."""
    import cffi
    name = module_name()
    os.makedirs(BUILD, exist_ok=True)
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(name, SOURCE, libraries=["ibverbs"], extra_compile_args=["-O2"])
    ffi.compile(tmpdir=BUILD, verbose=False)
    return name


def load():
    """(ffi, lib) of the helper, building it first if needed."""
    name = module_name()
    if BUILD not in sys.path:
        sys.path.insert(0, BUILD)
    try:
        mod = importlib.import_module(name)
    except ImportError:
        build()
        importlib.invalidate_caches()
        mod = importlib.import_module(name)
    return mod.ffi, mod.lib


if __name__ == "__main__":
    print(os.path.join(BUILD, build()))
