/* pingpong.c - 64-byte round trips over TCP with blocking read/write (the program the
 * LD_PRELOAD benchmark runs unmodified, with and without rdmasock).
 *   pingpong server PORT            serves one connection, echoing
 *   pingpong client PORT SECONDS    prints "round_trips_per_s N" */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MSG 64

static int full(ssize_t (*io)(int, void *, size_t), int fd, char *b)
{
    size_t got = 0;
    while (got < MSG) {
        ssize_t r = io(fd, b + got, MSG - got);
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}
static ssize_t wr(int fd, void *b, size_t n) { return write(fd, b, n); }

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    if (argc < 3) { fprintf(stderr, "usage: pingpong server|client PORT [SECONDS]\n"); return 2; }
    int port = atoi(argv[2]), one = 1;
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(0x7f000001) };
    char buf[MSG];
    memset(buf, 'x', sizeof buf);
    if (!strcmp(argv[1], "server")) {
        int l = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (void *)&a, sizeof a) || listen(l, 1)) { perror("bind/listen"); return 1; }
        printf("ready\n");
        fflush(stdout);
        int c = accept(l, NULL, NULL);
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        while (full(read, c, buf) == 0 && full(wr, c, buf) == 0) {}
        close(c);
        close(l);
        return 0;
    }
    double secs = argc > 3 ? atof(argv[3]) : 2.0;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (void *)&a, sizeof a)) { perror("connect"); return 1; }
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    for (int i = 0; i < 1000; i++)                    /* warm-up */
        if (full(wr, s, buf) || full(read, s, buf)) return 1;
    long n = 0;
    double t0 = now(), t;
    do {
        for (int i = 0; i < 256; i++, n++)
            if (full(wr, s, buf) || full(read, s, buf)) { perror("io"); return 1; }
        t = now();
    } while (t - t0 < secs);
    printf("round_trips_per_s %.0f\n", n / (t - t0));
    close(s);
    return 0;
}
