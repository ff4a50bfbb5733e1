/* benchutil.h - what the C programs of bench/c share.  Header-only (static inline), so each
 * program still builds from its one .c file: cc -O2 -Wall -o X bench/c/X.c. */
#ifndef BENCHUTIL_H
#define BENCHUTIL_H
#include <stdio.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#ifdef _GNU_SOURCE
#include <sched.h>

/* Pins the calling process to one CPU (the programs that fork their two sides). */
static inline void pin(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set)) perror("sched_setaffinity");
}
#endif

static inline double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* read/write exactly n bytes; -1 on error or EOF */
static inline int rd_full(int fd, void *b, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)b + got, n - got);
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}

static inline int wr_full(int fd, const void *b, size_t n)
{
    size_t put = 0;
    while (put < n) {
        ssize_t r = write(fd, (const char *)b + put, n - put);
        if (r <= 0) return -1;
        put += (size_t)r;
    }
    return 0;
}

/* Client side of a ping-pong with an echoing peer: 1000 warm-up round trips of size bytes,
 * then round trips for secs seconds; prints "round_trips_per_s N".  0, or 1 on an I/O error. */
static inline int timed_pingpong(int s, char *buf, size_t size, double secs)
{
    for (int i = 0; i < 1000; i++)
        if (wr_full(s, buf, size) || rd_full(s, buf, size)) { perror("warm-up"); return 1; }
    long n = 0;
    double t0 = now(), t;
    do {
        for (int i = 0; i < 256; i++, n++)
            if (wr_full(s, buf, size) || rd_full(s, buf, size)) { perror("io"); return 1; }
        t = now();
    } while (t - t0 < secs);
    printf("round_trips_per_s %.0f\n", n / (t - t0));
    return 0;
}
#endif
