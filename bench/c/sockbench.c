/* sockbench.c - one endpoint of the suite's socket benchmarks (bench/pingpong.py, stream.py, rdma_vm.py), plain
 * blocking read/write so that it runs unmodified with and without rdmasock's LD_PRELOAD.
 *   sockbench server tcp|unix ADDR            ADDR: port (0 = any; prints "port N") or path;
 *                                             serves one connection
 *   sockbench client tcp|unix ADDR pingpong SIZE SECONDS
 *   sockbench client tcp|unix ADDR stream   SIZE SECONDS
 * The client sends a 16-byte header (mode, size), warms up (1000 round trips, or 2000 writes
 * but at most 64 MiB, acknowledged by the server), then runs for SECONDS and prints one line:
 *   pingpong: "round_trips_per_s N"   stream: "bytes_per_s N writes N"
 * stream: after the timed writes the client shuts down writing; the server counts bytes to
 * EOF and answers with the total (8 bytes), so the time includes draining the pipe. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "benchutil.h"

static int mksock(const char *kind, const char *addr, int server)
{
    int one = 1, s;
    if (!strcmp(kind, "unix")) {
        struct sockaddr_un u = { .sun_family = AF_UNIX };
        snprintf(u.sun_path, sizeof u.sun_path, "%s", addr);
        s = socket(AF_UNIX, SOCK_STREAM, 0);
        if (server) {
            unlink(addr);
            if (bind(s, (void *)&u, sizeof u) || listen(s, 1)) { perror("bind/listen"); exit(1); }
            printf("ready\n");
            fflush(stdout);
        } else if (connect(s, (void *)&u, sizeof u)) { perror("connect"); exit(1); }
        return s;
    }
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(addr)),
                             .sin_addr.s_addr = htonl(0x7f000001) };
    s = socket(AF_INET, SOCK_STREAM, 0);
    if (server) {
        setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(s, (void *)&a, sizeof a) || listen(s, 1)) { perror("bind/listen"); exit(1); }
        socklen_t len = sizeof a;
        getsockname(s, (void *)&a, &len);
        printf("port %d\n", ntohs(a.sin_port));
        fflush(stdout);
    } else {
        if (connect(s, (void *)&a, sizeof a)) { perror("connect"); exit(1); }
        setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    return s;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: sockbench server tcp|unix ADDR | client tcp|unix ADDR pingpong|stream SIZE SECONDS\n");
        return 2;
    }
    int server = !strcmp(argv[1], "server");
    int s = mksock(argv[2], argv[3], server);
    uint64_t hdr[2];
    if (server) {
        int one = 1;
        int c = accept(s, NULL, NULL);
        if (c < 0) { perror("accept"); return 1; }
        if (strcmp(argv[2], "unix")) setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (rd_full(c, hdr, sizeof hdr)) return 1;
        size_t size = hdr[1];
        char *buf = malloc(size > (1 << 20) ? size : (1 << 20));
        if (hdr[0] == 1) {
            while (rd_full(c, buf, size) == 0 && wr_full(c, buf, size) == 0) {}
        } else {
            uint64_t warm;                                   /* warm-up bytes, then ack */
            if (rd_full(c, &warm, 8)) return 1;
            while (warm > 0) {
                ssize_t r = read(c, buf, warm < (1 << 20) ? warm : (1 << 20));
                if (r <= 0) return 1;
                warm -= (uint64_t)r;
            }
            if (wr_full(c, "k", 1)) return 1;
            uint64_t total = 0;
            for (;;) {
                ssize_t r = read(c, buf, 1 << 20);
                if (r < 0) { perror("read"); return 1; }
                if (r == 0) break;
                total += (uint64_t)r;
            }
            if (wr_full(c, &total, 8)) return 1;
        }
        close(c);
        close(s);
        return 0;
    }
    if (argc < 7) { fprintf(stderr, "client needs MODE SIZE SECONDS\n"); return 2; }
    int pp = !strcmp(argv[4], "pingpong");
    size_t size = (size_t)atol(argv[5]);
    double secs = atof(argv[6]), t0, t;
    char *buf = malloc(size);
    memset(buf, 'x', size);
    hdr[0] = pp ? 1 : 2;
    hdr[1] = size;
    if (wr_full(s, hdr, sizeof hdr)) return 1;
    if (pp) {
        if (timed_pingpong(s, buf, size, secs)) return 1;
    } else {
        uint64_t warm = (uint64_t)size * 2000;        /* 2000 writes, at most 64 MiB */
        char ack;
        if (warm > (64u << 20)) warm = (64u << 20) / size * size;
        if (warm < size) warm = size;
        if (wr_full(s, &warm, 8)) return 1;
        for (uint64_t w = 0; w < warm; w += size)
            if (wr_full(s, buf, size)) { perror("warm-up"); return 1; }
        if (rd_full(s, &ack, 1)) { perror("warm-up ack"); return 1; }
        uint64_t n = 0, total;
        t0 = now();
        do {
            for (int i = 0; i < 64; i++, n++)
                if (wr_full(s, buf, size)) { perror("write"); return 1; }
        } while (now() - t0 < secs);
        shutdown(s, SHUT_WR);
        if (rd_full(s, &total, 8)) { perror("total"); return 1; }
        t = now();
        if (total != n * size) { fprintf(stderr, "server counted %llu of %llu bytes\n",
                                         (unsigned long long)total, (unsigned long long)(n * size)); return 1; }
        printf("bytes_per_s %.0f writes %llu\n", total / (t - t0), (unsigned long long)n);
    }
    close(s);
    return 0;
}
