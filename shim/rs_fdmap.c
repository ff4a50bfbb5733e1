/* rs_fdmap.c - growing the descriptor map (lookups are inline in rs_fdmap.h). */
#include <stdlib.h>
#include "rs_fdmap.h"

void *rs_fdmap_swap(struct rs_fdmap *m, int fd, void *p)
{
    if ((unsigned)fd >= RS_FDMAP_MAX) return RS_FDMAP_FAIL;
    void **slot = rs_fdmap_slot(m, fd);
    if (!slot) {
        if (!p) return 0;                           /* nothing stored there, nothing to store */
        pthread_mutex_lock(&m->grow);
        unsigned hi = (unsigned)fd >> (2 * RS_FDMAP_BITS), lo = ((unsigned)fd >> RS_FDMAP_BITS) & (RS_FDMAP_FAN - 1);
        void **mid = m->mid[hi];
        if (!mid) {
            mid = calloc(RS_FDMAP_FAN, sizeof *mid);
            if (mid) __atomic_store_n(&m->mid[hi], mid, __ATOMIC_RELEASE);
        }
        if (mid && !mid[lo]) {
            void **leaf = calloc(RS_FDMAP_FAN, sizeof *leaf);
            if (leaf) __atomic_store_n((void ***)&mid[lo], leaf, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&m->grow);
        slot = rs_fdmap_slot(m, fd);
        if (!slot) return RS_FDMAP_FAIL;
    }
    return __atomic_exchange_n(slot, p, __ATOMIC_ACQ_REL);
}

void rs_fdmap_each(struct rs_fdmap *m, void (*fn)(int fd, void *p, void *arg), void *arg)
{
    for (unsigned hi = 0; hi < RS_FDMAP_FAN; hi++) {
        void **mid = __atomic_load_n(&m->mid[hi], __ATOMIC_ACQUIRE);
        if (!mid) continue;
        for (unsigned lo = 0; lo < RS_FDMAP_FAN; lo++) {
            void **leaf = __atomic_load_n((void ***)&mid[lo], __ATOMIC_ACQUIRE);
            if (!leaf) continue;
            for (unsigned i = 0; i < RS_FDMAP_FAN; i++) {
                void *p = __atomic_load_n(&leaf[i], __ATOMIC_ACQUIRE);
                if (p) fn((int)((hi << (2 * RS_FDMAP_BITS)) | (lo << RS_FDMAP_BITS) | i), p, arg);
            }
        }
    }
}

void rs_fdmap_after_fork(struct rs_fdmap *m)
{
    pthread_mutex_init(&m->grow, NULL);
}
