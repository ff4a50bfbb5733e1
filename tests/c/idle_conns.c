/* idle_conns.c - many upgraded connections held open by one process, for the resource
 * tests (tests/test_resources.py).
 *
 *   idle_conns server PORT N [ROUNDS]   accepts N connections, echoes one byte on each;
 *                                       prints "ready PORT" (PORT 0: the kernel picks)
 *   idle_conns client PORT N [ROUNDS]   opens N connections, one byte round trip on each
 *
 * With ROUNDS > 1, all N are closed and made again, ROUNDS times; the last round's stay.
 * Prints "mem ANON SHMEM" (kB, /proc/self/status) after the first connection and again
 * after all N of the last round, then waits for a line on stdin: "verify" makes one more
 * round trip on every connection (in the order they were made) and prints "ok"; end of
 * input exits.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void die(const char *what)
{
    perror(what);
    exit(1);
}

static void memory(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long anon = -1, shmem = -1;
    if (!f) die("status");
    while (fgets(line, sizeof line, f)) {
        sscanf(line, "RssAnon: %ld", &anon);
        sscanf(line, "RssShmem: %ld", &shmem);
    }
    fclose(f);
    printf("mem %ld %ld\n", anon, shmem);
    fflush(stdout);
}

static void round_trip(int fd, int server, char c)
{
    char b = c;
    if (server) {
        if (recv(fd, &b, 1, MSG_WAITALL) != 1) die("recv");
        if (send(fd, &b, 1, 0) != 1) die("send");
    } else {
        if (send(fd, &b, 1, 0) != 1) die("send");
        if (recv(fd, &b, 1, MSG_WAITALL) != 1 || b != c) die("recv");
    }
}

static void open_all(int *fds, int n, int server, int lfd, const struct sockaddr_in *a, int first)
{
    for (int i = 0; i < n; i++) {
        if (server) {
            fds[i] = accept(lfd, NULL, NULL);
            if (fds[i] < 0) die("accept");
        } else {
            fds[i] = socket(AF_INET, SOCK_STREAM, 0);
            if (fds[i] < 0) die("socket");
            if (connect(fds[i], (const struct sockaddr *)a, sizeof *a) < 0) die("connect");
        }
        round_trip(fds[i], server, 'a');
        if (i == 0 && first) memory();
    }
}

int main(int argc, char **argv)
{
    if (argc != 4 && argc != 5) { fprintf(stderr, "usage: idle_conns server|client PORT N [ROUNDS]\n"); return 2; }
    int server = !strcmp(argv[1], "server"), n = atoi(argv[3]), rounds = argc == 5 ? atoi(argv[4]) : 1;
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[2])) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int *fds = calloc((size_t)n, sizeof *fds), lfd = -1, one = 1;
    if (!fds) die("calloc");
    if (server) {
        lfd = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(lfd, (struct sockaddr *)&a, sizeof a) < 0 || listen(lfd, 128) < 0) die("listen");
        socklen_t al = sizeof a;
        getsockname(lfd, (struct sockaddr *)&a, &al);
        printf("ready %d\n", ntohs(a.sin_port));
        fflush(stdout);
    }
    for (int r = 0; r < rounds; r++) {
        if (r)
            for (int i = 0; i < n; i++) close(fds[i]);
        open_all(fds, n, server, lfd, &a, r == 0);
    }
    memory();
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "verify", 6)) continue;
        for (int i = 0; i < n; i++) round_trip(fds[i], server, 'v');
        printf("ok\n");
        fflush(stdout);
    }
    return 0;
}
