/* shmspin.c - the physical limit of a 64-byte ping-pong on this machine: two processes
 * (fork), one shared page, each pinned to its CPU, busy-spinning on a sequence number.
 * Each side copies the 64-byte message out of and into the page, like a ring would.
 *   shmspin CPU_A CPU_B SECONDS     prints "round_trips_per_s N" */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "benchutil.h"

#define MSG 64
struct slot { _Atomic uint64_t seq; char pad[56]; char data[MSG]; };
struct page { struct slot ping, pong; _Atomic int stop; };

int main(int argc, char **argv)
{
    if (argc < 4) { fprintf(stderr, "usage: shmspin CPU_A CPU_B SECONDS\n"); return 2; }
    double secs = atof(argv[3]);
    struct page *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); return 1; }
    memset(p, 0, sizeof *p);
    char local[MSG];
    pid_t child = fork();
    if (child == 0) {                                     /* echo side */
        pin(atoi(argv[2]));
        uint64_t seen = 0;
        for (;;) {
            uint64_t s;
            while ((s = atomic_load_explicit(&p->ping.seq, memory_order_acquire)) == seen)
                if (atomic_load_explicit(&p->stop, memory_order_relaxed)) _exit(0);
            seen = s;
            memcpy(local, p->ping.data, MSG);
            memcpy(p->pong.data, local, MSG);
            atomic_store_explicit(&p->pong.seq, s, memory_order_release);
        }
    }
    pin(atoi(argv[1]));
    memset(local, 'x', MSG);
    uint64_t seq = 0;
    long n = 0;
    double t0 = 0, t;
    for (int phase = 0; phase < 2; phase++) {            /* 0: warm-up, 1: timed */
        double len = phase ? secs : secs / 10;
        n = 0;
        t0 = now();
        do {
            for (int i = 0; i < 1024; i++, n++) {
                memcpy(p->ping.data, local, MSG);
                atomic_store_explicit(&p->ping.seq, ++seq, memory_order_release);
                while (atomic_load_explicit(&p->pong.seq, memory_order_acquire) != seq) {}
                memcpy(local, p->pong.data, MSG);
            }
            t = now();
        } while (t - t0 < len);
    }
    atomic_store(&p->stop, 1);
    waitpid(child, NULL, 0);
    printf("round_trips_per_s %.0f\n", n / (t - t0));
    return 0;
}
