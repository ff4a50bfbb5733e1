/* shmstream.c - the physical limit of a stream between two CPUs: two processes (fork), one
 * shared 4 MiB ring, each pinned to its CPU.  The producer copies chunks of SIZE bytes into
 * the ring and publishes its position; the consumer copies each chunk out into its own
 * buffer and publishes credit.  Two copies per byte and nothing else: no framing, no
 * re-zeroing, no doorbells.  memcpybw.c is one copy on one CPU; a socket moves each byte
 * from one CPU's cache to another's, which this measures.
 *   shmstream CPU_A CPU_B SIZE SECONDS     prints "bytes_per_s N" */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "benchutil.h"

#define RING (4u << 20)

struct ctl { _Atomic uint64_t tail; char pad0[56]; _Atomic uint64_t head; char pad1[56]; _Atomic int stop; };

int main(int argc, char **argv)
{
    if (argc < 5) { fprintf(stderr, "usage: shmstream CPU_A CPU_B SIZE SECONDS\n"); return 2; }
    size_t size = (size_t)atol(argv[3]);
    double secs = atof(argv[4]);
    if (size < 64 || size > RING / 4 || RING % size) { fprintf(stderr, "SIZE: 64 .. 1 MiB, a power of 2\n"); return 2; }
    struct ctl *k = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    char *ring = mmap(NULL, RING, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (k == MAP_FAILED || ring == MAP_FAILED) { perror("mmap"); return 1; }
    memset(ring, 0, RING);
    pid_t child = fork();
    if (child == 0) {                                     /* consumer */
        pin(atoi(argv[2]));
        char *dst = aligned_alloc(64, size);
        uint64_t head = 0;
        for (;;) {
            uint64_t tail;
            while ((tail = atomic_load_explicit(&k->tail, memory_order_acquire)) == head)
                if (atomic_load_explicit(&k->stop, memory_order_relaxed)) _exit(dst[0] == 1);
            for (; head < tail; head += size) {
                memcpy(dst, ring + (head & (RING - 1)), size);
                atomic_store_explicit(&k->head, head + size, memory_order_release);
            }
        }
    }
    pin(atoi(argv[1]));
    char *src = aligned_alloc(64, size);
    memset(src, 'x', size);
    uint64_t tail = 0;
    unsigned long n = 0;
    double t0 = 0, t;
    for (int phase = 0; phase < 2; phase++) {            /* 0: warm-up, 1: timed */
        n = 0;
        t0 = now();
        do {
            for (int i = 0; i < 64; i++, n++) {
                while (tail + size - atomic_load_explicit(&k->head, memory_order_acquire) > RING) {}
                memcpy(ring + (tail & (RING - 1)), src, size);
                tail += size;
                atomic_store_explicit(&k->tail, tail, memory_order_release);
            }
            t = now();
        } while (t - t0 < (phase ? secs : secs / 10));
    }
    while (atomic_load_explicit(&k->head, memory_order_acquire) != tail) {}   /* all of it copied out */
    t = now();
    atomic_store(&k->stop, 1);
    waitpid(child, NULL, 0);
    printf("bytes_per_s %.0f\n", (double)n * size / (t - t0));
    return 0;
}
