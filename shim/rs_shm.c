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
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "rs_conn.h"

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
void *rs_shm_map(int memfd, size_t *len_out, int *err)
{
    struct stat st;
    *err = 0;
    if (fstat(memfd, &st) < 0) { *err = errno; return NULL; }
    int seals = fcntl(memfd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) { *err = EBADMSG; return NULL; }
    if (st.st_size < (off_t)RS_SEG_HDR_SIZE) { *err = EBADMSG; return NULL; }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, memfd, 0);
    if (p == MAP_FAILED) { *err = errno; return NULL; }
    struct rs_seg_hdr *h = p;
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != RS_SEG_MAGIC || h->version != RS_PROTO_VERSION ||
        h->hdr_size != RS_SEG_HDR_SIZE || !ring_size_ok(h->ring_size) ||
        (off_t)(RS_SEG_HDR_SIZE + 2 * (size_t)h->ring_size) != st.st_size) {
        munmap(p, (size_t)st.st_size);
        *err = EBADMSG;
        return NULL;
    }
    *len_out = (size_t)st.st_size;
    return p;
}
