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

#define RS_STAT_MAGIC  0x5453534Bu       /* "KSST" */
#define RS_STAT_SLOTS  4096

struct rs_stat_hdr { uint32_t magic, version, nslots, slot_size; uint32_t pid, pad[11]; };

static struct rs_stat_hdr *table;
static struct rs_stat_slot *slots;
static pthread_mutex_t stat_lock = PTHREAD_MUTEX_INITIALIZER;

static int table_open(void)
{
    if (table) return 1;
    size_t len = sizeof(struct rs_stat_hdr) + RS_STAT_SLOTS * sizeof(struct rs_stat_slot);
    int fd = memfd_create("rdmasock-stats", MFD_CLOEXEC);
    if (fd < 0) return 0;
    if (ftruncate(fd, (off_t)len) < 0) { rs_real.close(fd); return 0; }
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { rs_real.close(fd); return 0; }
    /* The descriptor stays open: it is how `rdmasock stat` finds the table.  Moved high so
     * it does not take a number a program expects to get (e.g. 3 right after start). */
    int high = rs_real.fcntl(fd, F_DUPFD_CLOEXEC, 900);
    if (high >= 0) { rs_real.close(fd); fd = high; }
    table = p;
    slots = (struct rs_stat_slot *)(table + 1);
    table->version = 1;
    table->nslots = RS_STAT_SLOTS;
    table->slot_size = sizeof(struct rs_stat_slot);
    table->pid = (uint32_t)getpid();
    __atomic_store_n(&table->magic, RS_STAT_MAGIC, __ATOMIC_RELEASE);
    return 1;
}

/* After fork the child writes into the same table (MAP_SHARED): it gets its own. */
void rs_stats_after_fork(void)
{
    if (!table) return;
    table = NULL;
    slots = NULL;
}

struct rs_stat_slot *rs_stat_open(int fd, int role, int transport, int reason)
{
    pthread_mutex_lock(&stat_lock);
    struct rs_stat_slot *s = NULL;
    if (table_open()) {
        for (int i = 0; i < RS_STAT_SLOTS; i++)
            if (!slots[i].used) { s = &slots[i]; break; }
    }
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
    }
    pthread_mutex_unlock(&stat_lock);
    return s;
}

void rs_stat_close(struct rs_stat_slot *s)
{
    if (s) __atomic_store_n(&s->used, 0, __ATOMIC_RELEASE);
}
