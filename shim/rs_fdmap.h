/* rs_fdmap.h - descriptor number -> pointer, for every number the kernel can hand out.
 *
 * Three levels of 1024 entries (numbers below 2^30, above any fs.nr_open).  The two lower
 * levels are allocated on first store and never freed, so a lookup takes no lock: three
 * dependent loads, and a descriptor that was never stored costs at most one of them.
 * The static part is the top level, 8 KiB; each further 1024 descriptors that ever held a
 * tracked socket cost 8 KiB (plus 8 KiB per 2^20 numbers).
 */
#ifndef RS_FDMAP_H
#define RS_FDMAP_H
#include <pthread.h>
#include <stdint.h>

#define RS_FDMAP_BITS 10
#define RS_FDMAP_FAN  (1u << RS_FDMAP_BITS)
#define RS_FDMAP_MAX  (1u << (3 * RS_FDMAP_BITS))   /* first number it cannot hold */

struct rs_fdmap {
    void **mid[RS_FDMAP_FAN];       /* mid[i][j] is a leaf: void *[RS_FDMAP_FAN] */
    pthread_mutex_t grow;           /* allocating levels; slot stores are atomic */
};
#define RS_FDMAP_INIT { { 0 }, PTHREAD_MUTEX_INITIALIZER }

static inline void **rs_fdmap_slot(struct rs_fdmap *m, int fd)
{
    if ((unsigned)fd >= RS_FDMAP_MAX) return 0;
    void **mid = __atomic_load_n(&m->mid[(unsigned)fd >> (2 * RS_FDMAP_BITS)], __ATOMIC_ACQUIRE);
    if (!mid) return 0;
    void **leaf = __atomic_load_n((void ***)&mid[((unsigned)fd >> RS_FDMAP_BITS) & (RS_FDMAP_FAN - 1)], __ATOMIC_ACQUIRE);
    return leaf ? &leaf[(unsigned)fd & (RS_FDMAP_FAN - 1)] : 0;
}

static inline void *rs_fdmap_get(struct rs_fdmap *m, int fd)
{
    void **slot = rs_fdmap_slot(m, fd);
    return slot ? __atomic_load_n(slot, __ATOMIC_ACQUIRE) : 0;
}

/* Stores p at fd and returns what was there.  -1 (as a pointer) if fd is negative or
 * memory for a level could not be had. */
void *rs_fdmap_swap(struct rs_fdmap *m, int fd, void *p);
/* Calls fn for every stored entry (lowest number first); fn may store into the map. */
void rs_fdmap_each(struct rs_fdmap *m, void (*fn)(int fd, void *p, void *arg), void *arg);
/* After fork: the lock may have been held by a thread that does not exist in the child. */
void rs_fdmap_after_fork(struct rs_fdmap *m);

#define RS_FDMAP_FAIL ((void *)-1)
#endif
