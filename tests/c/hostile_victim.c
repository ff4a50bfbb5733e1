/* hostile_victim.c - the side a hostile peer attacks (issue 15, point 1; tests/test_hostile.py).
 *
 *   hostile_victim server PORT SECONDS     accept connections on 127.0.0.1:PORT (0: any)
 *   hostile_victim client PORT SECONDS     connect to 127.0.0.1:PORT, again and again
 *
 * Run under the preload library (built with AddressSanitizer and UBSan), against a peer
 * that rewrites every field of the shared segment while both sides send and receive.
 * Every socket has SO_RCVTIMEO and SO_SNDTIMEO of 1 s; every call, and every poll with a
 * 1 s timeout, must return within its timeout (plus scheduling slack).  A connection that
 * reports an error is closed and the next one made.  Prints one summary line:
 *   done sessions=N calls=M slow=K worst_ms=W errors=errno:count,...
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define TIMEOUT_MS 1000
#define SLACK_MS 400

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static long long calls, slow, worst;
static int errs[256];

static void timed(long long t0, const char *what)
{
    long long d = now_ms() - t0;
    calls++;
    if (d > worst) worst = d;
    if (d > TIMEOUT_MS + SLACK_MS) {
        slow++;
        fprintf(stderr, "slow %s: %lld ms\n", what, d);
    }
}

/* One connection: mixed calls until an error or the end.  Returns 0 to go on. */
static int session(int fd, long long end)
{
    struct timeval tv = { TIMEOUT_MS / 1000, (TIMEOUT_MS % 1000) * 1000 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    static char buf[1 << 17];
    for (unsigned i = 0; now_ms() < end; i++) {
        long long t0 = now_ms();
        ssize_t r;
        const char *what;
        switch (i % 5) {
        case 0: what = "send-small"; r = send(fd, buf, 1 + i % 200, MSG_NOSIGNAL); break;
        case 1: what = "send-large"; r = send(fd, buf, sizeof buf, MSG_NOSIGNAL); break;
        case 2: what = "recv"; r = recv(fd, buf, sizeof buf, 0); break;
        case 3: {
            what = "poll";
            struct pollfd p = { .fd = fd, .events = POLLIN | POLLOUT };
            r = poll(&p, 1, TIMEOUT_MS);
            if (r > 0 && (p.revents & (POLLERR | POLLNVAL))) { r = -1; errno = EPROTO; }
            break;
        }
        default: what = "recv-dontwait"; r = recv(fd, buf, 4096, MSG_DONTWAIT); break;
        }
        int e = errno;
        timed(t0, what);
        if (r == 0 && (i % 5 == 2)) return 0;                  /* end of stream: next one */
        if (r < 0 && e != EAGAIN && e != EINTR) {
            errs[e & 255]++;
            return 0;
        }
    }
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 4) { fprintf(stderr, "usage: hostile_victim server|client PORT SECONDS\n"); return 2; }
    int server = !strcmp(argv[1], "server");
    int port = atoi(argv[2]);
    long long end = now_ms() + atoi(argv[3]) * 1000LL;
    signal(SIGPIPE, SIG_IGN);
    alarm((unsigned)atoi(argv[3]) + 30);                     /* a hang is a failure, not a stuck test */
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    int lfd = -1;
    if (server) {
        lfd = socket(AF_INET, SOCK_STREAM, 0);
        int one = 1;
        setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 16)) { perror("listen"); return 1; }
        socklen_t l = sizeof a;
        getsockname(lfd, (struct sockaddr *)&a, &l);
        struct timeval tv = { 1, 0 };
        setsockopt(lfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);       /* accept gives up each second */
    }
    printf("port %d\n", ntohs(a.sin_port));
    fflush(stdout);
    int sessions = 0;
    while (now_ms() < end) {
        int fd;
        if (server) {
            fd = accept(lfd, NULL, NULL);
            if (fd < 0) continue;
        } else {
            fd = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(fd, (struct sockaddr *)&a, sizeof a)) { close(fd); usleep(50000); continue; }
        }
        sessions++;
        session(fd, end);
        long long t0 = now_ms();
        close(fd);
        timed(t0, "close");
    }
    printf("done sessions=%d calls=%lld slow=%lld worst_ms=%lld errors=", sessions, calls, slow, worst);
    for (int e = 0; e < 256; e++)
        if (errs[e]) printf("%s:%d,", strerrorname_np(e) ? strerrorname_np(e) : "?", errs[e]);
    printf("\n");
    return 0;
}
