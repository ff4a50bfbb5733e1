/* rs_stats.c - per-process connection table for `rdmasock stat`.
 *
 * One anonymous memfd per process ("rdmasock-stats"), created on the first tracked
 * connection.  `rdmasock stat` finds it through /proc/PID/fd (so only the process's own
 * user and root can read it) and nothing is left behind when the process ends.  The data
 * path only adds byte counts to its slot.
 */
#include "rs_preload.h"
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* One slot per possible descriptor at most; the mapping reserves that much address space,
 * the memfd grows a chunk at a time, so a process pays for the slots it has used. */
#define RS_STAT_MAX_SLOTS  (1u << 20)
#define RS_STAT_CHUNK      1024u
#define TABLE_RESERVE      (sizeof(struct rs_stat_hdr) + (size_t)RS_STAT_MAX_SLOTS * sizeof(struct rs_stat_slot))


/* The process's one ring memory budget (shim/rs_shm.c): exported so that the engine's
 * module, loaded into this process, counts into it too. */
__attribute__((visibility("default"))) struct rs_ring_budget rdmasock_ring_budget;

static struct rs_stat_hdr *table;
static struct rs_stat_slot *slots;
static int table_fd = -1;
static uint32_t free_hint;                  /* no free slot below it */
static pthread_mutex_t stat_lock = PTHREAD_MUTEX_INITIALIZER;

static int table_open(void)
{
    if (table) return 1;
    int fd = memfd_create("rdmasock-stats", MFD_CLOEXEC);
    if (fd < 0) return 0;
    if (ftruncate(fd, (off_t)(sizeof(struct rs_stat_hdr) + RS_STAT_CHUNK * sizeof(struct rs_stat_slot))) < 0) {
        rs_real.close(fd);
        return 0;
    }
    void *p = mmap(NULL, TABLE_RESERVE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (p == MAP_FAILED) { rs_real.close(fd); return 0; }
    /* The descriptor stays open: it is how `rdmasock stat` finds the table.  Moved high so
     * it does not take a number a program expects to get (e.g. 3 right after start). */
    int high = rs_real.fcntl(fd, F_DUPFD_CLOEXEC, 900);
    if (high >= 0) { rs_real.close(fd); fd = high; }
    table = p;
    table_fd = fd;
    slots = (struct rs_stat_slot *)(table + 1);
    table->version = 2;
    table->nslots = RS_STAT_CHUNK;
    table->slot_size = sizeof(struct rs_stat_slot);
    table->pid = (uint32_t)getpid();
    __atomic_store_n(&table->magic, RS_STAT_MAGIC, __ATOMIC_RELEASE);
    return 1;
}

/* After fork the child would write into the same table (MAP_SHARED): it gets its own.  The
 * parent's stays mapped until the connections the child inherited have moved their rows
 * (rs_stat_inherit), then goes (rs_stats_forget_parent). */
static struct rs_stat_hdr *parent_table;
static int parent_fd = -1;

void rs_stats_after_fork(void)
{
    pthread_mutex_init(&stat_lock, NULL);
    if (!table) return;
    parent_table = table;
    parent_fd = table_fd;
    table = NULL;
    slots = NULL;
    table_fd = -1;
    free_hint = 0;
}

void rs_stats_forget_parent(void)
{
    if (!parent_table) return;
    munmap(parent_table, TABLE_RESERVE);
    rs_real.close(parent_fd);
    parent_table = NULL;
    parent_fd = -1;
}

static struct rs_stat_slot *free_slot(void)
{
    uint32_t n = table->nslots;
    for (uint32_t i = free_hint; i < n; i++)
        if (!slots[i].used) { free_hint = i + 1; return &slots[i]; }
    if (n >= RS_STAT_MAX_SLOTS) return NULL;
    size_t bytes = sizeof(struct rs_stat_hdr) + (size_t)(n + RS_STAT_CHUNK) * sizeof(struct rs_stat_slot);
    if (ftruncate(table_fd, (off_t)bytes) < 0) return NULL;
    __atomic_store_n(&table->nslots, n + RS_STAT_CHUNK, __ATOMIC_RELEASE);
    free_hint = n + 1;
    return &slots[n];
}

static void note_ring_memory(void)
{
    table->ring_bytes = rs_ring_memory_in_use();
    table->ring_max = rs_ring_memory_max();
}

struct rs_stat_slot *rs_stat_open(int fd, int role, int transport, int reason)
{
    pthread_mutex_lock(&stat_lock);
    struct rs_stat_slot *s = table_open() ? free_slot() : NULL;
    if (s) {
        memset(s, 0, sizeof *s);
        s->fd = fd;
        s->role = (uint8_t)role;
        s->transport = (uint8_t)transport;
        s->reason = (uint16_t)reason;
        socklen_t l = sizeof s->local;
        getsockname(fd, (struct sockaddr *)s->local, &l);
        l = sizeof s->peer;
        getpeername(fd, (struct sockaddr *)s->peer, &l);
        __atomic_store_n(&s->used, 1, __ATOMIC_RELEASE);
        note_ring_memory();
    }
    pthread_mutex_unlock(&stat_lock);
    return s;
}

/* Before a fork, the row of a socket the child will inherit, as it is now: other threads
 * count into it meanwhile, and the parent may give it to another connection as soon as the
 * fork returns (rs_stat_inherit makes the child's from this copy). */
void rs_stat_copy(const struct rs_stat_slot *row, struct rs_stat_slot *out)
{
    pthread_mutex_lock(&stat_lock);
    out->used = __atomic_load_n(&row->used, __ATOMIC_ACQUIRE);
    out->fd = row->fd;
    out->role = row->role;
    out->transport = __atomic_load_n(&row->transport, __ATOMIC_RELAXED);
    out->reason = __atomic_load_n(&row->reason, __ATOMIC_RELAXED);
    memcpy(out->local, row->local, sizeof out->local);
    memcpy(out->peer, row->peer, sizeof out->peer);
    out->rx_bytes = __atomic_load_n(&row->rx_bytes, __ATOMIC_RELAXED);
    out->tx_bytes = __atomic_load_n(&row->tx_bytes, __ATOMIC_RELAXED);
    out->tx_spilled = __atomic_load_n(&row->tx_spilled, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&stat_lock);
}

/* In a child, a connection it inherited: its row in the parent's table, as the fork found
 * it, becomes a row of this process's table, counts so far included.  The parent's row
 * stays the parent's, which reuses it for another connection once it closes its copy. */
struct rs_stat_slot *rs_stat_inherit(const struct rs_stat_slot *at_fork)
{
    pthread_mutex_lock(&stat_lock);
    struct rs_stat_slot *s = table_open() ? free_slot() : NULL;
    if (s) {
        struct rs_stat_slot row = *at_fork;
        row.used = 0;                           /* `rdmasock stat` reads it once it is whole */
        memcpy(s, &row, sizeof *s);
        __atomic_store_n(&s->used, 1, __ATOMIC_RELEASE);
        note_ring_memory();
    }
    pthread_mutex_unlock(&stat_lock);
    return s;
}

void rs_stat_close(struct rs_stat_slot *s)
{
    if (!s) return;
    pthread_mutex_lock(&stat_lock);
    if (table && s >= slots && s < slots + table->nslots) {
        __atomic_store_n(&s->used, 0, __ATOMIC_RELEASE);
        uint32_t i = (uint32_t)(s - slots);
        if (i < free_hint) free_hint = i;
        note_ring_memory();
    }
    pthread_mutex_unlock(&stat_lock);
}
