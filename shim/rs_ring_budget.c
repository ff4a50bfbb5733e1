/* rs_ring_budget.c - the process's budget of ring memory, shared by every transport. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include "rs_conn.h"

/* Bytes of rings (and segment headers) mapped by this process's connections, against
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

void rs_ring_unmap(void *base, size_t len)
{
    munmap(base, len);
    rs_ring_memory_release(len);
}
uint64_t rs_ring_memory_in_use(void) { return __atomic_load_n(&budget()->used, __ATOMIC_RELAXED); }
uint64_t rs_ring_memory_max(void) { return __atomic_load_n(&budget()->max, __ATOMIC_RELAXED); }
