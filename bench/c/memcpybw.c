/* memcpybw.c - memcpy bandwidth for chunks of SIZE bytes copied into a 4 MiB ring (as a
 * shared-memory ring would be filled), the limit for the stream benchmark.
 *   memcpybw SIZE SECONDS     prints "bytes_per_s N" */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "benchutil.h"

int main(int argc, char **argv)
{
    if (argc < 3) { fprintf(stderr, "usage: memcpybw SIZE SECONDS\n"); return 2; }
    size_t size = (size_t)atol(argv[1]), ring = 4u << 20, off = 0;
    if (size > ring) ring = size;
    double secs = atof(argv[2]), t0, t;
    char *src = malloc(size), *dst = malloc(ring);
    memset(src, 'x', size);
    memset(dst, 0, ring);
    unsigned long n = 0;
    for (int phase = 0; phase < 2; phase++) {
        n = 0;
        t0 = now();
        do {
            for (int i = 0; i < 64; i++, n++) {
                if (off + size > ring) off = 0;
                memcpy(dst + off, src, size);
                off += size;
                __asm__ __volatile__("" ::: "memory");
            }
            t = now();
        } while (t - t0 < (phase ? secs : secs / 10));
    }
    printf("bytes_per_s %.0f\n", (double)n * size / (t - t0));
    return dst[off / 2] == 1;
}
