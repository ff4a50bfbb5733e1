/* rs_shm.c - the shared-memory transport's segment: one anonymous memfd per connection.
 *
 * A memfd has no name in any file system, so nothing is left behind after a close, a
 * crash or SIGKILL, and only processes that hold the descriptor (passed with SCM_RIGHTS
 * to the peer alone) can map it.  The size is sealed so neither side can shrink the
 * segment under the other (which would turn the peer's next access into SIGBUS).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <dlfcn.h>
#include "rs_conn.h"

/* ---- the process's budget of ring memory ---------------------------------------------
 * Bytes of rings (and segment headers) mapped by this process's connections, against
 * RDMASOCK_RING_MEMORY_MAX (default 8 GiB; address space, not memory: pages are committed
 * only as data touches them).  A connection that would go over it stays plain TCP, with
 * reason ring_memory_limit, rather than fail.
 *
 * This file is compiled into the preload library and into the engine's module
 * (rdmasock/_native); in a preloaded process one maps a ring and the other may unmap it.
 * The preload exports its budget (rdmasock_ring_budget, shim/preload/rs_stats.c) and both
 * copies use that one; a process without the preload uses the module's own. */
static struct rs_ring_budget own_budget, *budget_in_use;

static struct rs_ring_budget *budget(void)
{
    struct rs_ring_budget *b = __atomic_load_n(&budget_in_use, __ATOMIC_ACQUIRE);
    if (b) return b;
    b = dlsym(RTLD_DEFAULT, "rdmasock_ring_budget");
    if (!b) b = &own_budget;
    if (!__atomic_load_n(&b->max, __ATOMIC_RELAXED)) {
        const char *v = rs_config_get(RS_CFG_RING_MEMORY_MAX);
        char *end;
        unsigned long long x = strtoull(v, &end, 10);
        if (!x || *end) x = strtoull(rs_config_default(RS_CFG_RING_MEMORY_MAX), NULL, 10);
        uint64_t m = x, zero = 0;
        __atomic_compare_exchange_n(&b->max, &zero, m, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&budget_in_use, b, __ATOMIC_RELEASE);
    return b;
}

int rs_ring_memory_reserve(size_t n)
{
    struct rs_ring_budget *b = budget();
    if (__atomic_add_fetch(&b->used, n, __ATOMIC_ACQ_REL) <= __atomic_load_n(&b->max, __ATOMIC_RELAXED)) return 0;
    __atomic_sub_fetch(&b->used, n, __ATOMIC_ACQ_REL);
    return -ENOBUFS;
}

void rs_ring_memory_release(size_t n) { __atomic_sub_fetch(&budget()->used, n, __ATOMIC_ACQ_REL); }
uint64_t rs_ring_memory_in_use(void) { return __atomic_load_n(&budget()->used, __ATOMIC_RELAXED); }
uint64_t rs_ring_memory_max(void) { return __atomic_load_n(&budget()->max, __ATOMIC_RELAXED); }

static int ring_size_ok(uint32_t n)
{
    return n >= RS_RING_MIN && n <= RS_RING_MAX && (n & (n - 1)) == 0;
}

/* Creates and initialises a segment; returns the memfd or -errno. */
int rs_shm_create(uint32_t ring_size, uint64_t salt, size_t *len_out)
{
    if (!ring_size_ok(ring_size)) return -EINVAL;
    size_t len = RS_SEG_HDR_SIZE + 2 * (size_t)ring_size;
    int fd = memfd_create("rdmasock", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return -errno;
    if (ftruncate(fd, (off_t)len) < 0) goto fail;
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) goto fail;
    struct rs_seg_hdr *h = mmap(NULL, RS_SEG_HDR_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) goto fail;
    h->version = RS_PROTO_VERSION;
    h->ring_size = ring_size;
    h->hdr_size = RS_SEG_HDR_SIZE;
    h->salt = salt;
    h->dir[0].want_bell = h->dir[1].want_bell = 1;   /* no doorbell pending yet */
    __atomic_store_n(&h->magic, RS_SEG_MAGIC, __ATOMIC_RELEASE);
    munmap(h, RS_SEG_HDR_SIZE);
    *len_out = len;
    return fd;
fail:;
    int e = errno;
    close(fd);
    return -e;
}

/* Maps a segment received from the peer after checking that it is one: magic, version,
 * ring size and file size must agree, and the size must be sealed. */
/* Maps a segment received from the peer after checking that it is one: magic, version,
 * ring size and file size must agree, and the size must be sealed.  The header is the
 * peer's to rewrite at any time: what it says is copied into *seg once, checked there,
 * and never read again.  The pages are not populated: an idle connection commits only
 * what is touched.  Returns 0 or -errno (EBADMSG: not a valid segment). */
int rs_shm_map(int memfd, struct rs_seg *seg, size_t reserved)
{
    struct stat st;
    if (fstat(memfd, &st) < 0) return -errno;
    int seals = fcntl(memfd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) return -EBADMSG;
    if (st.st_size < (off_t)RS_SEG_HDR_SIZE) return -EBADMSG;
    /* The mapping counts against the budget: the caller's reservation first (a client made
     * one before it offered shm), the rest now. */
    size_t need = (size_t)st.st_size;
    if (need > reserved && rs_ring_memory_reserve(need - reserved) < 0) return -ENOBUFS;
    if (need < reserved) rs_ring_memory_release(reserved - need);
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (p == MAP_FAILED) { int e = errno; rs_ring_memory_release(need); return -e; }
    const struct rs_seg_hdr *h = p;
    uint32_t magic = __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE);
    uint32_t version = __atomic_load_n(&h->version, __ATOMIC_RELAXED);
    uint32_t hdr_size = __atomic_load_n(&h->hdr_size, __ATOMIC_RELAXED);
    uint32_t ring_size = __atomic_load_n(&h->ring_size, __ATOMIC_RELAXED);
    uint64_t salt = __atomic_load_n(&h->salt, __ATOMIC_RELAXED);
    if (magic != RS_SEG_MAGIC || version != RS_PROTO_VERSION || hdr_size != RS_SEG_HDR_SIZE ||
        !ring_size_ok(ring_size) || (off_t)(RS_SEG_HDR_SIZE + 2 * (size_t)ring_size) != st.st_size) {
        munmap(p, (size_t)st.st_size);
        rs_ring_memory_release(need);
        return -EBADMSG;
    }
    seg->base = p;
    seg->len = (size_t)st.st_size;
    seg->ring_size = ring_size;
    seg->salt = salt;
    return 0;
}
