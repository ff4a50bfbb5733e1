"""cffi builder for rdmasock._native: the C data path (shim/) for the Python API.

Run by the package install (cffi_modules in pyproject.toml); paths are relative to the
project root, where setuptools runs it."""
import glob
import os

import cffi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every file of the data path (shim/rs_*.c), the same set the preload library links.
SOURCES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "shim", "rs_*.c")))
# ...and the Python API's side of the socket object (shim/api/): the preload has its hooks
API_SOURCES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "shim", "api", "rs_*.c")))

CDEF = """
#define RS_STEP_PENDING ...
#define RS_STEP_RING ...
#define RS_STEP_TCP ...
#define RS_STEP_PRE_RX ...
#define RS_STEP_CONNECTING ...
#define RS_ROLE_CLIENT ...
#define RS_ROLE_SERVER ...
#define RS_TRANSPORT_TCP ...
#define RS_TRANSPORT_SHM ...
#define RS_TRANSPORT_RDMA ...
#define RS_HS_MAGIC ...
#define RS_HS_VERSION ...
#define RS_HS_LEN ...
#define RS_HS_MAX_LEN ...
#define RS_HS_AT_VERSION ...
#define RS_HS_AT_OP ...
#define RS_HS_AT_LEN ...
#define RS_HS_AT_FEATURES ...
#define RS_HS_AT_TRANSPORTS ...
#define RS_HS_AT_REASON ...
#define RS_HS_AT_NONCE ...
#define RS_HS_AT_RING_LOG2 ...
#define RS_HS_AT_PID ...
#define RS_HS_AT_SALT ...
#define RS_HS_HELLO ...
#define RS_HS_ACCEPT ...
#define RS_HS_DECLINE ...
#define RS_HS_T_SHM ...
#define RS_HS_T_RDMA ...
#define RS_HS_F_SALTED_FOOTER ...
#define RS_HS_F_LAZY_CREDIT ...
#define RS_HS_F_INBAND_FIN ...
#define RS_HS_F_SPIN_SKIP ...
#define RS_HS_F_PREAMBLE ...
#define RS_HS_F_LAZY_SWITCH ...
#define RS_HS_F_SPILL ...
#define RS_HS_F_FUTEX_WAKE ...
#define RS_HS_F_EVENT_BELL ...
#define RS_HS_F_QUIET_WAKE ...
#define RS_HS_REQUIRED ...
#define RS_HS_SUPPORTED ...
#define RS_STAT_MAGIC ...
struct rs_stat_slot {
    uint32_t used;
    int32_t fd;
    uint8_t transport;
    uint8_t role;
    uint16_t reason;
    uint8_t local[28];
    uint8_t peer[28];
    uint64_t tx_bytes, rx_bytes;
    uint64_t tx_spilled;
    ...;
};
struct rs_stat_hdr {
    uint32_t magic, version, nslots, slot_size;
    uint32_t pid;
    uint64_t ring_bytes, ring_max;
    ...;
};
struct rs_answer {
    int32_t engine_fd;
    int32_t link_fd;
    uint32_t features;
    uint32_t spin_ns;
    uint8_t ring_log2;
    uint8_t log_level;
    uint8_t name_len;
    char name[107];
    ...;
};
const char *rs_fd_tag(void);
const char *rs_reason_name(int code);
const char *rs_reason_text(int code);
int rs_config_count(void);
const char *rs_config_name(int key);
const char *rs_config_default(int key);
struct rs_tx {
    uint64_t bytes;
    uint64_t records;
    uint64_t spilled;
    uint64_t spills;
    uint8_t fin_sent;
    ...;
};
struct rs_rx_pre {
    uint8_t active;
    uint8_t lazy;
    uint32_t left;
    uint64_t bytes;
    ...;
};
struct rs_rx {
    uint64_t bytes;
    uint64_t records;
    uint64_t sleeps;
    uint64_t word_sleeps;
    uint64_t word_timeouts;
    uint64_t bells_drained;
    uint64_t spilled;
    uint8_t fin_seen;
    struct rs_rx_pre pre;
    ...;
};
typedef struct rs_conn {
    int fd;
    uint32_t ring_size;
    uint32_t max_payload;
    uint64_t salt;
    int err;
    uint8_t tcp_eof;
    uint8_t fb;
    uint8_t fb_reason;
    uint8_t fb_done;
    uint8_t spill_ok;
    uint8_t word_wake_ok;
    uint8_t quiet_wake_ok;
    uint64_t bells_sent;
    struct rs_tx tx;
    struct rs_rx rx;
    ...;
} rs_conn;
rs_conn *rs_conn_new_tcp(int fd);
int rs_pre_switch(int fd);
void rs_pre_switch_later(rs_conn *c);
struct rs_seg { void *base; size_t len; uint32_t ring_size; uint64_t salt; };
rs_conn *rs_conn_attach_shm(const struct rs_seg *seg, int fd, int is_server, uint32_t spin_ns);
void rs_conn_free(rs_conn *c);
void rs_conn_move_fd(rs_conn *c, int newfd);
const char *rs_conn_errmsg(const rs_conn *c);
int rs_conn_describe(rs_conn *c, char *buf, size_t n);
void rs_quiesce_bells(rs_conn *c);
long rs_fd_recv(int fd, void *buf, size_t n, int flags);
ssize_t rs_send(rs_conn *c, const void *buf, size_t len, int nonblock, int timeout_ms);
int rs_send_fin(rs_conn *c);
int rs_fb_move_tx(rs_conn *c, int reason, int timeout_ms);
void rs_shutdown_rd(rs_conn *c);
int rs_tx_writable(rs_conn *c);
ssize_t rs_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);
ssize_t rs_rx_available(rs_conn *c);
void rs_conn_tcp_info(rs_conn *c, uint64_t in, uint64_t out, void *info, unsigned len);
size_t rs_conn_rx_ancillary(rs_conn *c, int fd, void *ctl, size_t room, int *trunc);
void rs_conn_sockopt_set(rs_conn *c);
int rs_rx_ready(rs_conn *c);
int rs_shm_create(uint32_t ring_size, uint64_t salt, size_t *len_out);
struct rs_rdma_params {
    void *qp; void *cq;
    uint32_t lkey_own, lkey_sync, lkey_shadow;
    uint32_t rkey_ring, rkey_mirror, rkey_words;
    uint64_t raddr_ring, raddr_mirror, raddr_words;
    uint32_t max_inline, sq_depth, sync_timeout_ms;
};
#define RS_RDMA_OFF_OWN 0
#define RS_RDMA_OFF_MIRROR 64
#define RS_RDMA_OFF_SYNC 128
#define RS_RDMA_HDR 4096
#define RS_SEG_HDR_SIZE ...
int rs_rdma_supported(void);
void *rs_rdma_alloc(uint32_t ring_size, size_t *len_out);
void rs_rdma_unalloc(void *base, size_t len);
rs_conn *rs_conn_attach_rdma(void *base, size_t len, uint32_t ring_size, uint64_t salt, int fd,
                             uint32_t spin_ns, const struct rs_rdma_params *p);
int rs_rdma_quiesce(rs_conn *c, int timeout_ms);
void rs_rdma_drain(rs_conn *c);


int rs_shm_map(int memfd, struct rs_seg *seg, size_t reserved);
int rs_bells_create(int fds[2]);
int rs_conn_set_bells(rs_conn *c, int own, int peer);

#define RS_PLAIN ...
#define RS_LISTEN ...
#define RS_CLIENT_HS ...
#define RS_SERVER_HS ...
#define RS_RING ...
#define RS_PRE_RX ...
#define RS_BROKEN ...
struct rs_sock {
    int state;
    int err;
    int handle;
    uint8_t role;
    uint8_t app_nodelay;
    uint8_t app_cork;
    uint8_t hello_pending;
    uint16_t reason;
    uint32_t gen;
    int fd;
    rs_conn *conn;
    struct rs_stat_slot *stat;
    ...;
};
extern "Python+C" int rs_api_py_step(int handle, int wait_ms, uintptr_t *out);
extern "Python+C" void rs_api_py_drop(int handle);
extern "Python+C" void rs_api_py_unlisten(int handle);
extern "Python+C" void rs_api_py_release(rs_conn *c);
extern "Python+C" void rs_api_py_fell_back(int fd, int role, rs_conn *c);
int rs_sock_get_gen(struct rs_sock *s, uint32_t gen);
void rs_sock_put(struct rs_sock *s);
void rs_sock_release_fd(struct rs_sock *s, int fd);
void rs_sock_abandon_fd(struct rs_sock *s, int fd);
int rs_sock_so_error(struct rs_sock *s, int err);
void rs_sock_tcp_info(struct rs_sock *s, void *info, unsigned len);
void rs_sock_setopt_seen(struct rs_sock *s, int level, int name, const void *val, unsigned len);
int rs_sock_at_mark(struct rs_sock *s, int *plain);
int rs_tx_stamps_asked(int level, int name, const void *val, size_t len);
int rs_ring_memory_reserve(size_t n);
void rs_ring_memory_release(size_t n);
uint64_t rs_ring_memory_in_use(void);
#define RS_DIAG_NO_UID ...
int rs_diag_tcp_owner(int family, const uint8_t src[16], uint16_t sport, const uint8_t dst[16], uint16_t dport);
int rs_diag_unix_scan(const uint8_t *buf, size_t len, const uint8_t *names, const uint32_t *lens, int n,
                      int64_t *uids);
"""



def header_decls(name):
    """A header's declarations as cffi reads them: without its guard and includes (so the
    C set-up interface of shim/rs_verbs.h is written once)."""
    with open(os.path.join(ROOT, "shim", name), encoding="utf-8") as f:
        lines = f.readlines()
    guard = next(line.split()[1] for line in lines if line.startswith("#ifndef"))
    return "".join(line for line in lines
                   if not line.startswith(("#ifndef", "#endif", "#include", "#define %s" % guard)))


ffibuilder = cffi.FFI()
ffibuilder.cdef(CDEF + header_decls("rs_verbs.h") + header_decls("api/rs_api.h"))
ffibuilder.set_source(
    "rdmasock._native",
    '#include "rs_conn.h"\n#include "rs_contract.h"\n#include "rs_verbs.h"\n#include "rs_api.h"\n#include "rs_diag.h"',
    sources=SOURCES + API_SOURCES,
    include_dirs=["shim", "shim/api"],
    depends=sorted(glob.glob("shim/*.h") + glob.glob("shim/api/*.h")),             # a header change rebuilds the module
    define_macros=[("RS_NO_VERBS", "1")] if os.environ.get("RDMASOCK_BUILD_RDMA") == "0" else [],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-ffile-prefix-map=%s=." % ROOT],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
