/* preload_calls.c - every interposed libc call on a TCP loopback connection, checked
 * byte-exactly.  Run as a pair, each side optionally under `rdmasock run` (LD_PRELOAD):
 *
 *   preload_calls server CTLPATH               listens on 127.0.0.1:0, prints "port N"
 *   preload_calls client PORT CTLPATH TMPDIR   connects, runs the same test list
 *   preload_calls execcheck                    (exec'd by the exec test) lists its fds
 *
 * Each test has its own TCP connection (the one under test).  The two processes keep in
 * step over a separate AF_UNIX control connection (CTLPATH), which the preload library
 * passes straight through: "begin"/"end" of each test, "go" signals for delayed sends, and
 * the local port of each new data connection (so the server accepts the right one even
 * after a failed test).  Each check prints "ok NAME" or "FAIL NAME detail"; a per-test
 * watchdog (SIGALRM + siglongjmp) turns a hang into "FAIL test_<name>_timeout" and the run
 * goes on with the next test.  Exit status: 0 if every check passed, 1 otherwise.
 *
 * Compiled by tests/test_preload_calls.py twice: plain (-O0) and fortified
 * (-O2 -D_FORTIFY_SOURCE=2, so read/recv/recvfrom/poll/ppoll/FD_SET on fixed-size buffers
 * become __read_chk, __recv_chk, __recvfrom_chk, __poll_chk, __ppoll_chk, __fdelt_chk).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <linux/net_tstamp.h>
#include <linux/sockios.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WATCHDOG_S 5            /* per test, each side */
#define WAIT_MS    3000         /* "must become ready" waits */
#define DELAY_MS   100          /* peer's delay before a send that must wake a waiter */
#define EP_TAG     0xABCD0123456789ull

static int is_server;
static const char *g_test = "setup";
static int g_idx = -1;
static int g_failures;
static int ctl = -1;
static int lfd = -1;
static int g_port;
static const char *g_tmpdir = "/tmp";
static sigjmp_buf g_jmp;
static volatile sig_atomic_t g_in_test;
static volatile sig_atomic_t g_sigpipes;

/* ---------------------------------------------------------------------------------------- */
/* reporting */

static void report(int ok, const char *name, const char *fmt, ...)
{
    if (ok) {
        printf("ok %s\n", name);
    } else {
        char detail[600] = "";
        if (fmt) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(detail, sizeof detail, fmt, ap);
            va_end(ap);
        }
        printf("FAIL %s %s\n", name, detail);
        g_failures++;
    }
    fflush(stdout);
}
#define CHECK(name, cond, ...) report(!!(cond), name, __VA_ARGS__)

static void info(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("info %s: ", g_test);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
}

static void die(const char *what)
{
    printf("FAIL fatal_%s %s errno=%d (%s)\n", is_server ? "server" : "client", what, errno, strerror(errno));
    fflush(stdout);
    _exit(2);
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {}
}

/* ---------------------------------------------------------------------------------------- */
/* data patterns: byte i of stream `seed` */

static inline uint8_t pat(unsigned seed, size_t i)
{
    uint32_t x = (uint32_t)i * 2654435761u + seed * 40503u + 0x9e37u;
    x ^= x >> 15;
    x *= 0x2c1b3c6du;
    x ^= x >> 12;
    return (uint8_t)(x ^ (i >> 10));
}

static void fill(uint8_t *b, size_t n, unsigned seed, size_t off)
{
    for (size_t i = 0; i < n; i++) b[i] = pat(seed, off + i);
}

/* index of the first byte that differs from the pattern, or -1 */
static long mismatch(const uint8_t *b, size_t n, unsigned seed, size_t off)
{
    for (size_t i = 0; i < n; i++)
        if (b[i] != pat(seed, off + i)) return (long)i;
    return -1;
}

static uint64_t fnv1a(uint64_t h, const uint8_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 0x100000001b3ull; }
    return h;
}

/* ---------------------------------------------------------------------------------------- */
/* plain I/O helpers (read/write; EAGAIN waits in poll) */

static ssize_t wr_all(int fd, const void *buf, size_t n)
{
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, (const char *)buf + done, n - done);
        if (w < 0 && errno == EAGAIN) {
            struct pollfd p = { fd, POLLOUT, 0 };
            poll(&p, 1, 1000);
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return done ? (ssize_t)done : -1;
        done += (size_t)w;
    }
    return (ssize_t)done;
}

/* Reads n bytes unless EOF/error comes first; returns the count (errno kept on error). */
static ssize_t rd_full(int fd, void *buf, size_t n)
{
    size_t done = 0;
    while (done < n) {
        ssize_t r = read(fd, (char *)buf + done, n - done);
        if (r < 0 && errno == EAGAIN) {
            struct pollfd p = { fd, POLLIN, 0 };
            poll(&p, 1, 1000);
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return done ? (ssize_t)done : -1;
        if (r == 0) break;
        done += (size_t)r;
    }
    return (ssize_t)done;
}

static int send_pat(int fd, unsigned seed, size_t off, size_t n)
{
    uint8_t *b = malloc(n ? n : 1);
    fill(b, n, seed, off);
    ssize_t w = wr_all(fd, b, n);
    free(b);
    return w == (ssize_t)n;
}

/* Reads n bytes and compares them with the pattern.  Returns 1 if equal; else 0 with a
 * description in why. */
static int recv_pat(int fd, unsigned seed, size_t off, size_t n, char *why, size_t wl)
{
    uint8_t *b = malloc(n ? n : 1);
    errno = 0;
    ssize_t r = rd_full(fd, b, n);
    int e = errno;
    int ok = 0;
    if (r != (ssize_t)n) {
        snprintf(why, wl, "read %zd of %zu bytes, errno=%d (%s)", r, n, e, strerror(e));
    } else {
        long m = mismatch(b, n, seed, off);
        if (m >= 0) snprintf(why, wl, "byte %ld of %zu differs: got 0x%02x want 0x%02x", m, n, b[m], pat(seed, off + m));
        else ok = 1;
    }
    free(b);
    return ok;
}

static int set_nonblock(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) return -1;
    return fcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK);
}

/* ---------------------------------------------------------------------------------------- */
/* control channel: lines "idx tag value\n" over an AF_UNIX stream socket */

static void ctl_send(const char *tag, unsigned long long v)
{
    char line[128];
    int n = snprintf(line, sizeof line, "%d %s %llu\n", g_idx, tag, v);
    if (write(ctl, line, (size_t)n) != n) die("ctl_send");
}

static char ctl_buf[4096];
static size_t ctl_len;

/* Waits for message `tag` of the current test; drops stale ones.  0 ok, -1 timeout/EOF. */
static int ctl_wait(const char *tag, unsigned long long *v, int timeout_ms)
{
    long long end = now_ms() + timeout_ms;
    for (;;) {
        char *nl;
        while ((nl = memchr(ctl_buf, '\n', ctl_len))) {
            *nl = 0;
            int idx = -2;
            char t[64] = "";
            unsigned long long val = 0;
            int ok = sscanf(ctl_buf, "%d %63s %llu", &idx, t, &val) == 3 && idx == g_idx && !strcmp(t, tag);
            size_t used = (size_t)(nl - ctl_buf) + 1;
            memmove(ctl_buf, ctl_buf + used, ctl_len - used);
            ctl_len -= used;
            if (ok) { if (v) *v = val; return 0; }
        }
        long long left = end - now_ms();
        if (left <= 0) return -1;
        struct pollfd p = { ctl, POLLIN, 0 };
        int r = poll(&p, 1, (int)left);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        ssize_t n = read(ctl, ctl_buf + ctl_len, sizeof ctl_buf - ctl_len);
        if (n <= 0) return -1;
        ctl_len += (size_t)n;
    }
}

static void ctl_need(const char *tag, unsigned long long *v)
{
    if (ctl_wait(tag, v, WATCHDOG_S * 1000 + 2000) < 0) {
        report(0, "ctl_sync", "test %s: no '%s' from the peer", g_test, tag);
        if (g_in_test) siglongjmp(g_jmp, 2);
        _exit(2);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* connections of the tests */

static struct sockaddr_in server_addr(void)
{
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)g_port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
}

/* client: tells the server which connection is the test's */
static void announce(int fd)
{
    struct sockaddr_in a;
    socklen_t al = sizeof a;
    if (getsockname(fd, (struct sockaddr *)&a, &al) < 0) die("getsockname");
    ctl_send("conn", ntohs(a.sin_port));
    printf("conn %s %d\n", g_test, ntohs(a.sin_port));
    fflush(stdout);
}

static int client_connect(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    struct sockaddr_in a = server_addr();
    int r = connect(fd, (struct sockaddr *)&a, sizeof a);
    int e = errno;
    report(r == 0, "connect_blocking", "connect returned %d errno=%d (%s)", r, e, strerror(e));
    if (r < 0) return -1;
    announce(fd);
    return fd;
}

enum { ACC_PLAIN, ACC_ACCEPT4 };

static int server_accept(int kind)
{
    unsigned long long port;
    ctl_need("conn", &port);
    for (int tries = 0; tries < 8; tries++) {
        struct sockaddr_in a;
        socklen_t al = sizeof a;
        memset(&a, 0, sizeof a);
        int fd = kind == ACC_ACCEPT4 ? accept4(lfd, (struct sockaddr *)&a, &al, SOCK_NONBLOCK | SOCK_CLOEXEC)
                                     : accept(lfd, (struct sockaddr *)&a, &al);
        if (fd < 0) {
            if (errno == EINTR) continue;
            report(0, kind == ACC_ACCEPT4 ? "accept4" : "accept", "errno=%d (%s)", errno, strerror(errno));
            return -1;
        }
        if (a.sin_family == AF_INET && ntohs(a.sin_port) == port) {
            int ok = al == sizeof a && a.sin_addr.s_addr == htonl(INADDR_LOOPBACK);
            report(ok, kind == ACC_ACCEPT4 ? "accept4" : "accept", "peer address len %u family %d", (unsigned)al,
                   a.sin_family);
            return fd;
        }
        info("dropping a stale connection from port %d", ntohs(a.sin_port));
        close(fd);
    }
    report(0, "accept", "the test's connection never came");
    return -1;
}

/* Two one-byte round trips: afterwards both sides have finished the handshake (the upgrade
 * is lazy: each side completes it at its first I/O) and the server has consumed the end of
 * the client's preamble (the client's first byte, written before it had read the server's
 * answer, travels as a TCP frame followed by a SWITCH frame), so the test's calls run on
 * the ring of a fully upgraded connection, not on handshake-time paths. */
static int server_accept_warm(void)
{
    int fd = server_accept(ACC_PLAIN);
    if (fd < 0) return -1;
    char c = 0, d = 0;
    int ok = rd_full(fd, &c, 1) == 1 && c == 'W' && wr_all(fd, "w", 1) == 1 &&
             rd_full(fd, &d, 1) == 1 && d == 'X' && wr_all(fd, "x", 1) == 1;
    if (!ok) report(0, "warmup_s", "test %s: errno=%d", g_test, errno);
    return fd;
}

static int client_connect_warm(void)
{
    int fd = client_connect();
    if (fd < 0) return -1;
    char c = 0, d = 0;
    int ok = wr_all(fd, "W", 1) == 1 && rd_full(fd, &c, 1) == 1 && c == 'w' &&
             wr_all(fd, "X", 1) == 1 && rd_full(fd, &d, 1) == 1 && d == 'x';
    if (!ok) report(0, "warmup_c", "test %s: errno=%d", g_test, errno);
    return fd;
}

/* ======================================================================================== */
/* the tests: each has a server part and a client part, run at the same time */

/* ---- basic: accept, blocking connect, read/write ------------------------------------ */
#define BASIC_N 100000
static void basic_server(void)
{
    int fd = server_accept(ACC_PLAIN);
    if (fd < 0) return;
    char why[256];
    int ok = recv_pat(fd, 1, 0, BASIC_N, why, sizeof why);
    CHECK("read_c2s", ok, "%s", why);
    uint8_t *b = malloc(BASIC_N);
    fill(b, BASIC_N, 2, 0);
    size_t done = 0;
    while (done < BASIC_N) {                 /* write() in odd pieces */
        size_t n = BASIC_N - done < 7001 ? BASIC_N - done : 7001;
        ssize_t w = write(fd, b + done, n);
        if (w <= 0) break;
        done += (size_t)w;
    }
    CHECK("write_s2c", done == BASIC_N, "wrote %zu of %d, errno=%d", done, BASIC_N, errno);
    free(b);
    char c;
    ssize_t r = read(fd, &c, 1);
    CHECK("read_eof_s", r == 0, "read returned %zd errno=%d (%s)", r, errno, strerror(errno));
    CHECK("close_s", close(fd) == 0, "errno=%d", errno);
}

static void basic_client(void)
{
    int fd = client_connect();
    if (fd < 0) return;
    uint8_t *b = malloc(BASIC_N);
    fill(b, BASIC_N, 1, 0);
    size_t done = 0;
    while (done < BASIC_N) {
        size_t n = BASIC_N - done < 6007 ? BASIC_N - done : 6007;
        ssize_t w = write(fd, b + done, n);
        if (w <= 0) break;
        done += (size_t)w;
    }
    CHECK("write_c2s", done == BASIC_N, "wrote %zu of %d, errno=%d", done, BASIC_N, errno);
    free(b);
    char why[256];
    CHECK("read_s2c", recv_pat(fd, 2, 0, BASIC_N, why, sizeof why), "%s", why);
    CHECK("close_c", close(fd) == 0, "errno=%d", errno);
}

/* ---- nonblocking: socket(SOCK_NONBLOCK), connect + POLLOUT + SO_ERROR, accept4, F_SETFL */
static void nonblock_server(void)
{
    int fd = server_accept(ACC_ACCEPT4);
    if (fd < 0) return;
    int fl = fcntl(fd, F_GETFL), fdf = fcntl(fd, F_GETFD);
    CHECK("accept4_nonblock_cloexec", fl >= 0 && (fl & O_NONBLOCK) && fdf >= 0 && (fdf & FD_CLOEXEC),
          "F_GETFL=%#x F_GETFD=%#x", fl, fdf);
    char b[16];
    ssize_t r = read(fd, b, sizeof b);
    int e = errno;
    CHECK("read_nonblock_eagain", r < 0 && e == EAGAIN, "read returned %zd errno=%d (%s)", r, e, strerror(e));
    r = recv(fd, b, sizeof b, 0);
    e = errno;
    CHECK("recv_nonblock_eagain", r < 0 && e == EAGAIN, "recv returned %zd errno=%d (%s)", r, e, strerror(e));
    ctl_send("go", 0);
    size_t got = 0;
    long long end = now_ms() + WAIT_MS;
    while (got < 5 && now_ms() < end) {
        struct pollfd p = { fd, POLLIN, 0 };
        poll(&p, 1, WAIT_MS);
        r = read(fd, b + got, 5 - got);
        if (r > 0) got += (size_t)r;
        else if (r == 0 || errno != EAGAIN) break;
    }
    CHECK("read_nonblock_data", got == 5 && !memcmp(b, "hello", 5), "got %zu bytes", got);
    r = write(fd, "world", 5);
    CHECK("write_nonblock", r == 5, "write returned %zd errno=%d", r, errno);
    /* F_SETFL on and off */
    int r1 = set_nonblock(fd, 0);
    int fl2 = fcntl(fd, F_GETFL);
    CHECK("fcntl_setfl_clear_s", r1 == 0 && !(fl2 & O_NONBLOCK), "F_SETFL=%d F_GETFL=%#x", r1, fl2);
    r1 = set_nonblock(fd, 1);
    fl2 = fcntl(fd, F_GETFL);
    r = read(fd, b, sizeof b);
    e = errno;
    CHECK("fcntl_setfl_set_s", r1 == 0 && (fl2 & O_NONBLOCK) && r < 0 && e == EAGAIN,
          "F_SETFL=%d F_GETFL=%#x read=%zd errno=%d", r1, fl2, r, e);
    set_nonblock(fd, 0);
    sleep_ms(DELAY_MS);
    r = write(fd, "bye", 3);
    CHECK("write_blocking_s", r == 3, "write returned %zd errno=%d", r, errno);
    r = read(fd, b, sizeof b);            /* blocking: the client closes */
    e = errno;
    CHECK("read_blocking_eof_s", r == 0, "read returned %zd errno=%d (%s)", r, e, strerror(e));
    close(fd);
}

static void nonblock_client(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) die("socket");
    int fl = fcntl(fd, F_GETFL), fdf = fcntl(fd, F_GETFD);
    CHECK("socket_nonblock_cloexec", (fl & O_NONBLOCK) && (fdf & FD_CLOEXEC), "F_GETFL=%#x F_GETFD=%#x", fl, fdf);
    struct sockaddr_in a = server_addr();
    int r = connect(fd, (struct sockaddr *)&a, sizeof a);
    int e = errno;
    announce(fd);
    struct pollfd p = { fd, POLLOUT, 0 };
    int pr = poll(&p, 1, WAIT_MS);
    int soerr = -1;
    socklen_t sl = sizeof soerr;
    int gr = getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
    CHECK("connect_nonblock", (r == 0 || e == EINPROGRESS) && pr == 1 && (p.revents & POLLOUT) && gr == 0 && soerr == 0,
          "connect=%d errno=%d poll=%d revents=%#x getsockopt=%d SO_ERROR=%d", r, e, pr, p.revents, gr, soerr);
    ctl_need("go", NULL);
    ssize_t w;
    long long end = now_ms() + WAIT_MS;
    while ((w = write(fd, "hello", 5)) < 0 && errno == EAGAIN && now_ms() < end) {
        struct pollfd q = { fd, POLLOUT, 0 };
        poll(&q, 1, 100);
    }
    CHECK("write_nonblock_c", w == 5, "write returned %zd errno=%d (%s)", w, errno, strerror(errno));
    char b[16];
    size_t got = 0;
    while (got < 5 && now_ms() < end) {
        struct pollfd q = { fd, POLLIN, 0 };
        poll(&q, 1, WAIT_MS);
        ssize_t n = read(fd, b + got, 5 - got);
        if (n > 0) got += (size_t)n;
        else if (n == 0 || errno != EAGAIN) break;
    }
    CHECK("read_nonblock_c", got == 5 && !memcmp(b, "world", 5), "got %zu bytes", got);
    ssize_t n = read(fd, b, sizeof b);
    e = errno;
    CHECK("read_nonblock_eagain_c", n < 0 && e == EAGAIN, "read returned %zd errno=%d (%s)", n, e, strerror(e));
    int sr = set_nonblock(fd, 0);
    fl = fcntl(fd, F_GETFL);
    CHECK("fcntl_setfl_clear_c", sr == 0 && !(fl & O_NONBLOCK), "F_SETFL=%d F_GETFL=%#x", sr, fl);
    n = rd_full(fd, b, 3);
    CHECK("read_blocking_after_setfl_c", n == 3 && !memcmp(b, "bye", 3), "read %zd errno=%d", n, errno);
    close(fd);
}

/* ---- iov: writev/readv with many small iovecs --------------------------------------- */
#define IOV_SMALL 100
#define IOV_TINY  300
#define IOV_LARGE 300000       /* more than the ring (64 KiB in the tests) */
static size_t small_total(void)
{
    size_t t = 0;
    for (int i = 0; i < IOV_SMALL; i++) t += (size_t)(i % 13) + 1;
    return t;
}

/* readv into iovecs of sizes (i % mod) + 1 until n bytes arrived; compares with the pattern */
static int readv_pat(int fd, size_t n, int mod, unsigned seed, char *why, size_t wl)
{
    uint8_t *b = malloc(n);
    size_t got = 0;
    int calls = 0;
    while (got < n) {
        struct iovec iov[1024];
        int cnt = 0;
        size_t pos = got, k = 0;
        while (pos < n && cnt < 1024) {
            size_t sz = (k++ % (size_t)mod) + 1;
            if (sz > n - pos) sz = n - pos;
            iov[cnt].iov_base = b + pos;
            iov[cnt].iov_len = sz;
            pos += sz;
            cnt++;
        }
        ssize_t r = readv(fd, iov, cnt);
        calls++;
        if (r <= 0) {
            snprintf(why, wl, "readv returned %zd after %zu of %zu bytes, errno=%d (%s)", r, got, n, errno, strerror(errno));
            free(b);
            return 0;
        }
        got += (size_t)r;
    }
    long m = mismatch(b, n, seed, 0);
    if (m >= 0) snprintf(why, wl, "byte %ld differs (%d readv calls)", m, calls);
    free(b);
    return m < 0;
}

static void iov_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    char why[256];
    CHECK("readv_small_iovecs", readv_pat(fd, small_total(), 7, 60, why, sizeof why), "%s", why);
    CHECK("readv_mixed_iovecs", readv_pat(fd, 40015, 11, 61, why, sizeof why), "%s", why);
    CHECK("readv_large", readv_pat(fd, IOV_LARGE, 997, 63, why, sizeof why), "%s", why);
    uint8_t tiny[IOV_TINY];
    struct iovec iov[IOV_TINY];
    fill(tiny, IOV_TINY, 62, 0);
    for (int i = 0; i < IOV_TINY; i++) { iov[i].iov_base = tiny + i; iov[i].iov_len = 1; }
    ssize_t w = writev(fd, iov, IOV_TINY);
    CHECK("writev_tiny_iovecs", w == IOV_TINY, "writev returned %zd errno=%d", w, errno);
    if (w >= 0 && w < IOV_TINY) wr_all(fd, tiny + w, IOV_TINY - (size_t)w);
    close(fd);
}

static void iov_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    size_t tot = small_total();
    uint8_t *b = malloc(tot);
    fill(b, tot, 60, 0);
    struct iovec iov[IOV_SMALL];
    size_t pos = 0;
    for (int i = 0; i < IOV_SMALL; i++) {
        iov[i].iov_base = b + pos;
        iov[i].iov_len = (size_t)(i % 13) + 1;
        pos += iov[i].iov_len;
    }
    ssize_t w = writev(fd, iov, IOV_SMALL);
    CHECK("writev_small_iovecs", w == (ssize_t)tot, "writev returned %zd of %zu errno=%d", w, tot, errno);
    if (w >= 0 && w < (ssize_t)tot) wr_all(fd, b + w, tot - (size_t)w);
    free(b);
    b = malloc(40015);
    fill(b, 40015, 61, 0);
    struct iovec m[4] = { { b, 10 }, { b + 10, 0 }, { b + 10, 40000 }, { b + 40010, 5 } };
    w = writev(fd, m, 4);
    CHECK("writev_mixed_iovecs", w == 40015, "blocking writev of 10+0+40000+5 bytes returned %zd", w);
    if (w >= 0 && w < 40015) wr_all(fd, b + w, 40015 - (size_t)w);     /* stay in step */
    free(b);
    b = malloc(IOV_LARGE);
    fill(b, IOV_LARGE, 63, 0);
    struct iovec lg[3] = { { b, 10 }, { b + 10, IOV_LARGE - 15 }, { b + IOV_LARGE - 5, 5 } };
    w = writev(fd, lg, 3);
    CHECK("writev_large_blocking", w == IOV_LARGE, "blocking writev of 10+%d+5 bytes returned %zd (short count)",
          IOV_LARGE - 15, w);
    if (w >= 0 && w < IOV_LARGE) wr_all(fd, b + w, IOV_LARGE - (size_t)w);
    free(b);
    char why[256];
    CHECK("readv_tiny_c", readv_pat(fd, IOV_TINY, 5, 62, why, sizeof why), "%s", why);
    close(fd);
}

/* ---- flags: MSG_DONTWAIT, FIONREAD, MSG_PEEK, MSG_WAITALL, sendto/recvfrom, sendmsg/recvmsg */
static int wait_fionread(int fd, int want, int *last)
{
    long long end = now_ms() + WAIT_MS;
    int v = -1;
    while (now_ms() < end) {
        if (ioctl(fd, FIONREAD, &v) < 0) { v = -errno; break; }
        if (v >= want) break;
        sleep_ms(1);
    }
    *last = v;
    return v == want;
}

static void flags_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    char b[4096];
    ssize_t r = recv(fd, b, 10, MSG_DONTWAIT);
    int e = errno;
    CHECK("recv_dontwait_eagain", r < 0 && e == EAGAIN, "recv returned %zd errno=%d (%s)", r, e, strerror(e));
    int v = -1;
    CHECK("ioctl_fionread_empty", ioctl(fd, FIONREAD, &v) == 0 && v == 0, "FIONREAD=%d errno=%d", v, errno);
    ctl_send("go1", 0);
    CHECK("ioctl_fionread", wait_fionread(fd, 10, &v), "FIONREAD=%d, want 10", v);
    ssize_t p1 = recv(fd, b, 4, MSG_PEEK);
    int ok1 = p1 == 4 && !memcmp(b, "0123", 4);
    ssize_t p2 = recv(fd, b, 10, MSG_PEEK);
    int ok2 = p2 == 10 && !memcmp(b, "0123456789", 10);
    int v2 = -1;
    ioctl(fd, FIONREAD, &v2);
    CHECK("recv_peek", ok1 && ok2 && v2 == 10, "peek4=%zd peek10=%zd FIONREAD after=%d", p1, p2, v2);
    ssize_t a = recv(fd, b, 3, 0);
    int oka = a == 3 && !memcmp(b, "012", 3);
    ssize_t p3 = recv(fd, b, 100, MSG_PEEK);
    int ok3 = p3 == 7 && !memcmp(b, "3456789", 7);
    ssize_t c = recv(fd, b, 100, 0);
    int okc = c == 7 && !memcmp(b, "3456789", 7);
    v2 = -1;
    ioctl(fd, FIONREAD, &v2);
    CHECK("recv_after_peek", oka && ok3 && okc && v2 == 0, "recv3=%zd peek=%zd recv=%zd FIONREAD=%d", a, p3, c, v2);

    ctl_send("go2", 0);
    memset(b, 0, sizeof b);
    r = recv(fd, b, 3000, MSG_WAITALL);
    long m = r == 3000 ? mismatch((uint8_t *)b, 3000, 50, 0) : -2;
    CHECK("recv_waitall", r == 3000 && m < 0, "recv returned %zd errno=%d mismatch=%ld", r, errno, m);
    if (r > 0 && r < 3000) rd_full(fd, b, 3000 - (size_t)r);        /* stay in step */

    ctl_send("go3", 0);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    memset(b, 0, sizeof b);
    r = recvfrom(fd, b, 2000, MSG_WAITALL, (struct sockaddr *)&ss, &sl);
    m = r == 2000 ? mismatch((uint8_t *)b, 2000, 51, 0) : -2;
    CHECK("recvfrom", r == 2000 && m < 0 && sl == 0, "recvfrom returned %zd addrlen=%u mismatch=%ld errno=%d", r,
          (unsigned)sl, m, errno);
    if (r > 0 && r < 2000) rd_full(fd, b, 2000 - (size_t)r);

    ctl_send("go4", 0);
    memset(b, 0, sizeof b);
    struct iovec iov[2] = { { b, 1500 }, { b + 1500, 1601 } };
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_name = &ss;
    mh.msg_namelen = sizeof ss;
    mh.msg_iov = iov;
    mh.msg_iovlen = 2;
    r = recvmsg(fd, &mh, MSG_WAITALL);
    m = r == 3101 ? mismatch((uint8_t *)b, 3101, 52, 0) : -2;
    CHECK("recvmsg_waitall", r == 3101 && m < 0 && mh.msg_flags == 0 && mh.msg_namelen == 0,
          "recvmsg returned %zd (want 3101: MSG_WAITALL over two iovecs, sent 1500 then 1601 bytes 50 ms "
          "later) msg_flags=%#x namelen=%u mismatch=%ld",
          r, mh.msg_flags, (unsigned)mh.msg_namelen, m);
    if (r > 0 && r < 3101) rd_full(fd, b, 3101 - (size_t)r);

    fill((uint8_t *)b, 500, 53, 0);
    r = send(fd, b, 500, MSG_DONTWAIT);
    CHECK("send_dontwait", r == 500, "send returned %zd errno=%d", r, errno);
    fill((uint8_t *)b, 500, 54, 0);
    r = sendto(fd, b, 500, 0, NULL, 0);
    CHECK("sendto_s", r == 500, "sendto returned %zd errno=%d", r, errno);
    fill((uint8_t *)b, 500, 55, 0);
    struct iovec oi[3] = { { b, 250 }, { b + 250, 1 }, { b + 251, 249 } };
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = oi;
    mh.msg_iovlen = 3;
    r = sendmsg(fd, &mh, 0);
    CHECK("sendmsg_s", r == 500, "sendmsg returned %zd errno=%d", r, errno);
    r = recv(fd, b, 1, 0);                /* the client closes */
    CHECK("recv_eof_s", r == 0, "recv returned %zd errno=%d", r, errno);
    close(fd);
}

static void flags_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    uint8_t b[4096];
    ctl_need("go1", NULL);
    ssize_t r = send(fd, "0123456789", 10, 0);
    CHECK("send", r == 10, "send returned %zd errno=%d", r, errno);

    ctl_need("go2", NULL);
    int ok = 1;
    for (int i = 0; i < 3; i++) {
        fill(b, 1000, 50, (size_t)i * 1000);
        if (send(fd, b, 1000, 0) != 1000) ok = 0;
        if (i < 2) sleep_ms(30);
    }
    CHECK("send_pieces", ok, "errno=%d", errno);

    ctl_need("go3", NULL);
    fill(b, 2000, 51, 0);
    r = sendto(fd, b, 2000, 0, NULL, 0);
    CHECK("sendto", r == 2000, "sendto returned %zd errno=%d", r, errno);

    ctl_need("go4", NULL);
    fill(b, 3101, 52, 0);
    struct iovec iov[3] = { { b, 100 }, { b + 100, 1 }, { b + 101, 1399 } };
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov;
    mh.msg_iovlen = 3;
    ssize_t r1 = sendmsg(fd, &mh, 0);
    sleep_ms(50);
    struct iovec iov2[1] = { { b + 1500, 1601 } };
    mh.msg_iov = iov2;
    mh.msg_iovlen = 1;
    ssize_t r2 = sendmsg(fd, &mh, MSG_NOSIGNAL);
    CHECK("sendmsg", r1 == 1500 && r2 == 1601, "sendmsg returned %zd, %zd errno=%d", r1, r2, errno);

    memset(b, 0, sizeof b);
    r = recv(fd, b, 500, MSG_WAITALL);
    CHECK("recv_waitall_c", r == 500 && mismatch(b, 500, 53, 0) < 0, "recv returned %zd errno=%d", r, errno);
    memset(b, 0, sizeof b);
    r = recvfrom(fd, b, 500, MSG_WAITALL, NULL, NULL);
    CHECK("recvfrom_c", r == 500 && mismatch(b, 500, 54, 0) < 0, "recvfrom returned %zd errno=%d", r, errno);
    memset(b, 0, sizeof b);
    struct iovec ri[1] = { { b, 500 } };
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = ri;
    mh.msg_iovlen = 1;
    r = recvmsg(fd, &mh, MSG_WAITALL);
    CHECK("recvmsg_c", r == 500 && mismatch(b, 500, 55, 0) < 0 && mh.msg_flags == 0,
          "recvmsg returned %zd msg_flags=%#x errno=%d", r, mh.msg_flags, errno);
    close(fd);
}

/* ---- fresh: readiness and FIONREAD before the (lazy) handshake has finished ----------- */
static void fresh_server(void)
{
    int fd = server_accept(ACC_PLAIN);
    if (fd < 0) return;
    struct pollfd p = { fd, POLLIN, 0 };
    int pr = poll(&p, 1, 50);
    CHECK("poll_idle_fresh_s", pr == 0, "poll(POLLIN) on a just-accepted connection, the client sent nothing: "
          "returned %d revents %#x", pr, p.revents);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = { .events = EPOLLIN, .data.u64 = EP_TAG }, got;
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    int n = epoll_wait(ep, &got, 1, 50);
    CHECK("epoll_idle_fresh_s", n == 0, "epoll_wait on a just-accepted connection, the client sent nothing: "
          "returned %d events %#x", n, n > 0 ? got.events : 0);
    ctl_send("go1", 0);
    ctl_need("sent", NULL);
    int v = -1;
    long long end = now_ms() + 1000;
    while (now_ms() < end) {
        if (ioctl(fd, FIONREAD, &v) < 0) { v = -errno; break; }
        if (v >= 10) break;
        sleep_ms(2);
    }
    CHECK("ioctl_fionread_fresh", v == 10, "FIONREAD=%d for 1 s after the client's send of 10 bytes (no read yet)", v);
    char why[256] = "";
    int ok = recv_pat(fd, 150, 0, 10, why, sizeof why);
    CHECK("read_first_data", ok, "%s", why);
    n = epoll_wait(ep, &got, 1, 0);
    CHECK("epoll_idle_after_first_read_s", n == 0, "returned %d events %#x", n, n > 0 ? got.events : 0);
    ctl_send("go2", 0);
    ctl_need("go3", NULL);
    sleep_ms(DELAY_MS);
    CHECK("write_first_data", send_pat(fd, 151, 0, 10), "errno=%d", errno);
    ctl_need("done", NULL);
    close(ep);
    close(fd);
}

static void fresh_client(void)
{
    int fd = client_connect();
    if (fd < 0) return;
    struct pollfd p = { fd, POLLIN, 0 };
    int pr = poll(&p, 1, 50);
    CHECK("poll_idle_fresh_c", pr == 0, "poll(POLLIN) right after connect returned %d revents %#x", pr, p.revents);
    ctl_need("go1", NULL);
    CHECK("send_first_data", send_pat(fd, 150, 0, 10), "errno=%d", errno);
    ctl_send("sent", 0);
    ctl_need("go2", NULL);
    p.revents = 0;
    pr = poll(&p, 1, 50);
    CHECK("poll_idle_after_handshake_c", pr == 0, "poll(POLLIN) after the server read our data, before it wrote any: "
          "returned %d revents %#x", pr, p.revents);
    ctl_send("go3", 0);
    p.revents = 0;
    long long t0 = now_ms();
    pr = poll(&p, 1, WAIT_MS);
    long long dt = now_ms() - t0;
    char why[256] = "";
    int ok = recv_pat(fd, 151, 0, 10, why, sizeof why);
    CHECK("poll_readable_first_data_c", pr == 1 && (p.revents & POLLIN) && dt >= DELAY_MS / 2 && ok,
          "poll returned %d revents %#x after %lld ms (server writes after %d ms); %s", pr, p.revents, dt, DELAY_MS, why);
    ctl_send("done", 0);
    close(fd);
}

/* ---- preamble: readiness while the client's SWITCH frame is still unread --------------
 * The client writes before it has read the server's answer (as most request/response
 * clients do), so its bytes go as preamble frames and, once it reads the answer, a SWITCH
 * frame follows on the TCP stream.  If the server waits in poll() before reading again, the
 * SWITCH is still in its socket when the client's next bytes arrive in the ring. */
static void preamble_server(void)
{
    int fd = server_accept(ACC_PLAIN);
    if (fd < 0) return;
    char c = 0;
    int ok = rd_full(fd, &c, 1) == 1 && c == 'W' && wr_all(fd, "w", 1) == 1;
    CHECK("preamble_first_exchange_s", ok, "errno=%d", errno);
    ctl_send("go1", 0);
    ctl_need("switched", NULL);
    sleep_ms(20);
    struct pollfd p = { fd, POLLIN, 0 };
    int pr = poll(&p, 1, 50);
    CHECK("poll_idle_switch_pending", pr == 0, "poll returned %d revents %#x", pr, p.revents);
    ctl_send("go2", 0);
    long long t0 = now_ms();
    p.revents = 0;
    pr = poll(&p, 1, 1000);
    long long dt = now_ms() - t0;
    char why[256] = "";
    ok = recv_pat(fd, 160, 0, 100, why, sizeof why);
    CHECK("poll_readable_switch_pending", pr == 1 && (p.revents & POLLIN) && ok,
          "poll(POLLIN, 1000 ms) returned %d revents %#x after %lld ms; the client wrote 100 bytes after %d ms "
          "(read afterwards: %s)", pr, p.revents, dt, DELAY_MS, ok ? "all 100 bytes there" : why);
    ctl_need("done", NULL);
    close(fd);
}

static void preamble_client(void)
{
    /* 'W' is written before the server even accepts (we announce the connection after
     * it), so it cannot find the server's answer already there: it is a preamble frame. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    struct sockaddr_in a = server_addr();
    int r = connect(fd, (struct sockaddr *)&a, sizeof a);
    report(r == 0, "connect_blocking", "connect returned %d errno=%d (%s)", r, errno, strerror(errno));
    if (r < 0) return;
    char c = 0;
    int ok = wr_all(fd, "W", 1) == 1;
    announce(fd);
    ctl_need("go1", NULL);
    ok = ok && rd_full(fd, &c, 1) == 1 && c == 'w';        /* finishes our handshake: SWITCH goes out */
    CHECK("preamble_first_exchange_c", ok, "errno=%d", errno);
    ctl_send("switched", 0);
    ctl_need("go2", NULL);
    sleep_ms(DELAY_MS);
    CHECK("preamble_then_ring_send", send_pat(fd, 160, 0, 100), "errno=%d", errno);
    ctl_send("done", 0);
    close(fd);
}

/* ---- unused: the server accepts and closes at once (as a server over its connection
 * limit does); the client must see a clean EOF, as with TCP ----------------------------- */
static void unused_server(void)
{
    int fd = server_accept(ACC_PLAIN);
    if (fd < 0) return;
    CHECK("close_unused", close(fd) == 0, "errno=%d", errno);
}

static void unused_client(void)
{
    int fd = client_connect();
    if (fd < 0) return;
    char c;
    ssize_t r = read(fd, &c, 1);
    int e = errno;
    CHECK("eof_when_peer_closes_unused_conn", r == 0, "read returned %zd errno=%d (%s); the server accepted and "
          "closed without any I/O", r, e, strerror(e));
    close(fd);
}

/* ---- sigpipe: MSG_NOSIGNAL gives EPIPE without a signal; write() raises SIGPIPE -------- */
static void on_sigpipe(int s) { (void)s; g_sigpipes++; }

static void sigpipe_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    CHECK("close_peer_for_epipe", close(fd) == 0, "errno=%d", errno);
}

static void sigpipe_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    char c;
    ssize_t r = read(fd, &c, 1);
    int e = errno;
    CHECK("read_eof_after_peer_close", r == 0, "read returned %zd errno=%d (%s)", r, e, strerror(e));
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigpipe;
    sigaction(SIGPIPE, &sa, &old);
    g_sigpipes = 0;
    /* TCP: the peer's RST answers the first send, so the 2nd one fails with EPIPE. */
    int tries = 0;
    ssize_t s = 0;
    for (; tries < 50; tries++) {
        s = send(fd, "x", 1, MSG_NOSIGNAL);
        if (s < 0) break;
        sleep_ms(10);
    }
    e = errno;
    int sigs = g_sigpipes;
    CHECK("send_epipe_prompt", s < 0 && e == EPIPE && sigs == 0, "send(MSG_NOSIGNAL) to a peer that has closed (we "
          "read its EOF) still succeeds after %d 1-byte sends over %d ms (last: %zd, errno %d)", tries, tries * 10, s,
          s < 0 ? e : 0);
    /* However long the lag, it must end in EPIPE (a bounded amount: 4 MiB) */
    static uint8_t chunk[4096];
    int n4k = 0;
    for (s = 0; s >= 0 && n4k < 1024; n4k++) s = send(fd, chunk, sizeof chunk, MSG_NOSIGNAL);
    e = errno;
    sigs = g_sigpipes;
    CHECK("send_nosignal_epipe", s < 0 && e == EPIPE && sigs == 0, "send(MSG_NOSIGNAL) returned %zd errno=%d (%s) after "
          "%d 4 KiB sends, SIGPIPE count %d", s, e, strerror(e), n4k, sigs);
    r = write(fd, "y", 1);
    e = errno;
    sigs = g_sigpipes;
    CHECK("write_epipe_sigpipe", r < 0 && e == EPIPE && sigs == 1, "write returned %zd errno=%d (%s), SIGPIPE count %d "
          "(want 1)", r, e, strerror(e), sigs);
    r = send(fd, "z", 1, 0);
    e = errno;
    sigs = g_sigpipes;
    CHECK("send_epipe_sigpipe", r < 0 && e == EPIPE && sigs == 2, "send returned %zd errno=%d, SIGPIPE count %d "
          "(want 2)", r, e, sigs);
    sigaction(SIGPIPE, &old, NULL);
    close(fd);
}

/* ---- sendfile: 1 MiB regular file, with and without an offset pointer ----------------- */
#define SF_N (1u << 20)
static void sendfile_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    uint8_t *b = malloc(SF_N);
    uint64_t sums[2] = { 0, 0 };
    int ok = 1;
    char detail[256] = "";
    for (int k = 0; k < 2; k++) {
        ssize_t r = rd_full(fd, b, SF_N);
        long m = r == SF_N ? mismatch(b, SF_N, 70, 0) : -2;
        if (r != SF_N || m >= 0) {
            ok = 0;
            snprintf(detail, sizeof detail, "copy %d: got %zd bytes, mismatch at %ld", k, r, m);
        }
        sums[k] = fnv1a(0xcbf29ce484222325ull, b, r > 0 ? (size_t)r : 0);
    }
    free(b);
    unsigned long long want = 0;
    ctl_need("sum", &want);
    CHECK("sendfile_data", ok && sums[0] == want && sums[1] == want, "%s checksums %016llx %016llx want %016llx", detail,
          (unsigned long long)sums[0], (unsigned long long)sums[1], want);
    char c;
    CHECK("sendfile_eof", read(fd, &c, 1) == 0, "errno=%d", errno);
    close(fd);
}

static void sendfile_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/preload_sendfile.XXXXXX", g_tmpdir);
    int ffd = mkstemp(path);
    if (ffd < 0) die("mkstemp");
    unlink(path);
    uint8_t *b = malloc(SF_N);
    fill(b, SF_N, 70, 0);
    if (wr_all(ffd, b, SF_N) != SF_N) die("write file");
    unsigned long long sum = fnv1a(0xcbf29ce484222325ull, b, SF_N);
    free(b);
    off_t off = 0;
    int calls = 0;
    ssize_t r = 0;
    while (off < (off_t)SF_N) {
        r = sendfile(fd, ffd, &off, SF_N - (size_t)off);
        calls++;
        if (r <= 0) break;
    }
    off_t pos = lseek(ffd, 0, SEEK_CUR);
    CHECK("sendfile_offset", off == (off_t)SF_N && pos == SF_N, "offset %lld file position %lld last return %zd errno=%d "
          "(%d calls)", (long long)off, (long long)pos, r, errno, calls);
    lseek(ffd, 0, SEEK_SET);
    size_t sent = 0;
    calls = 0;
    while (sent < SF_N) {
        r = sendfile(fd, ffd, NULL, SF_N - sent);
        calls++;
        if (r <= 0) break;
        sent += (size_t)r;
    }
    pos = lseek(ffd, 0, SEEK_CUR);
    CHECK("sendfile_null_offset", sent == SF_N && pos == SF_N, "sent %zu file position %lld last return %zd errno=%d",
          sent, (long long)pos, r, errno);
    ctl_send("sum", sum);
    close(ffd);
    close(fd);
}

/* ---- dup: dup, F_DUPFD, F_DUPFD_CLOEXEC, dup2, dup3; closing the original -------------- */
static int xchg_s(int fd, unsigned in_seed, unsigned out_seed, char *why, size_t wl)
{
    if (!recv_pat(fd, in_seed, 0, 64, why, wl)) return 0;
    if (!send_pat(fd, out_seed, 0, 64)) { snprintf(why, wl, "write failed errno=%d", errno); return 0; }
    return 1;
}

static int xchg_c(int fd, unsigned out_seed, unsigned in_seed, char *why, size_t wl)
{
    if (!send_pat(fd, out_seed, 0, 64)) { snprintf(why, wl, "write failed errno=%d", errno); return 0; }
    return recv_pat(fd, in_seed, 0, 64, why, wl);
}

static void dup_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    int d[6];
    d[0] = fd;
    d[1] = dup(fd);
    d[2] = fcntl(fd, F_DUPFD, 100);
    d[3] = fcntl(fd, F_DUPFD_CLOEXEC, 200);
    d[4] = dup2(fd, 150);
    d[5] = dup3(fd, 160, O_CLOEXEC);
    static const char *names[6] = { "dup_data_original", "dup", "fcntl_dupfd", "fcntl_dupfd_cloexec", "dup2", "dup3" };
    int numok[6] = {
        1,
        d[1] >= 0 && !(fcntl(d[1], F_GETFD) & FD_CLOEXEC),
        d[2] >= 100 && !(fcntl(d[2], F_GETFD) & FD_CLOEXEC),
        d[3] >= 200 && (fcntl(d[3], F_GETFD) & FD_CLOEXEC),
        d[4] == 150 && !(fcntl(d[4], F_GETFD) & FD_CLOEXEC),
        d[5] == 160 && (fcntl(d[5], F_GETFD) & FD_CLOEXEC),
    };
    for (int j = 0; j < 6; j++) {
        char why[256] = "";
        int ok = numok[j] && d[j] >= 0 && xchg_s(d[j], 100 + (unsigned)j, 200 + (unsigned)j, why, sizeof why);
        CHECK(names[j], ok, "fd %d (flags ok %d): %s", d[j], numok[j], why);
    }
    char why[256] = "";
    int c0 = close(fd);
    ctl_send("closed", 0);               /* the client sends after a delay: our read must wait */
    CHECK("close_original_keeps_conn", c0 == 0 && xchg_s(d[1], 300, 301, why, sizeof why),
          "close=%d; then a blocking read via dup %d of data the peer sends %d ms later: %s", c0, d[1], DELAY_MS, why);
    int cr[4] = { close(d[1]), close(d[2]), close(d[3]), close(d[5]) };
    int ce = errno;
    why[0] = 0;
    CHECK("close_dups_keeps_conn", !cr[0] && !cr[1] && !cr[2] && !cr[3] && xchg_s(d[4], 302, 303, why, sizeof why),
          "close of dups %d,%d,%d,%d returned %d,%d,%d,%d (errno %d); then via dup2'd fd %d: %s", d[1], d[2], d[3], d[5],
          cr[0], cr[1], cr[2], cr[3], ce, d[4], why);
    CHECK("dup2_same_fd", dup2(d[4], d[4]) == d[4], "errno=%d", errno);
    CHECK("close_last_dup", close(d[4]) == 0, "errno=%d", errno);
}

static void dup_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    int ok = 1;
    char why[256] = "";
    for (int j = 0; j < 6 && ok; j++) ok = xchg_c(fd, 100 + (unsigned)j, 200 + (unsigned)j, why, sizeof why);
    ctl_need("closed", NULL);
    sleep_ms(DELAY_MS);
    if (ok) ok = xchg_c(fd, 300, 301, why, sizeof why);
    if (ok) ok = xchg_c(fd, 302, 303, why, sizeof why);
    CHECK("dup_data_c", ok, "%s", why);
    char c;
    ssize_t r = read(fd, &c, 1);
    CHECK("eof_after_last_dup_closed", r == 0, "read returned %zd errno=%d (%s)", r, errno, strerror(errno));
    close(fd);
}

/* ---- fdreuse: the original number, closed while a dup keeps the connection, is reused
 * by another socket; the connection must neither use nor disturb that number ----------- */
static void fdreuse_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    int d = dup(fd);
    int c0 = close(fd);
    int sv[2] = { -1, -1 };
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) die("socketpair");
    int other = sv[0] == fd ? sv[1] : sv[1] == fd ? sv[0] : -1;      /* the end not numbered fd */
    info("original fd %d closed (%d), dup %d, socketpair %d/%d", fd, c0, d, sv[0], sv[1]);
    ctl_send("go1", 0);
    char why[256] = "";
    long long t0 = now_ms();
    int ok = recv_pat(d, 170, 0, 64, why, sizeof why);
    CHECK("read_via_dup_after_fd_reuse", ok, "blocking read via dup %d (original %d closed, number reused) of 64 "
          "bytes the peer sent after %d ms: %s after %lld ms", d, fd, DELAY_MS, why, now_ms() - t0);
    ctl_send("go2", 0);
    sleep_ms(DELAY_MS);                      /* the client is asleep in read() now */
    CHECK("write_via_dup_after_fd_reuse", send_pat(d, 171, 0, 64), "errno=%d", errno);
    unsigned long long cdt = 0;
    ctl_need("got", &cdt);
    int n = -1;
    char junk[64];
    ssize_t r = other >= 0 ? recv(other, junk, sizeof junk, MSG_DONTWAIT) : -2;
    if (other >= 0) ioctl(other, FIONREAD, &n);
    CHECK("closed_fd_number_untouched", other < 0 || (r < 0 && errno == EAGAIN),
          "the socketpair that took over number %d received %zd byte(s) (first 0x%02x): the connection still "
          "writes to its closed original descriptor", fd, r, r > 0 ? (uint8_t)junk[0] : 0);
    if (other < 0) info("the socketpair did not get number %d: reuse not tested", fd);
    ctl_send("done", 0);
    close(sv[0]);
    close(sv[1]);
    close(d);
}

static void fdreuse_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    ctl_need("go1", NULL);
    sleep_ms(DELAY_MS);
    send_pat(fd, 170, 0, 64);
    ctl_need("go2", NULL);
    char why[256] = "";
    long long t0 = now_ms();
    int ok = recv_pat(fd, 171, 0, 64, why, sizeof why);
    long long dt = now_ms() - t0;
    CHECK("read_after_peer_fd_reuse", ok && dt < DELAY_MS + 300, "%s; the 64 bytes the server wrote after %d ms "
          "arrived after %lld ms (no wake-up from the server?)", why, DELAY_MS, dt);
    ctl_send("got", (unsigned long long)dt);
    ctl_need("done", NULL);
    close(fd);
}

/* ---- rawclose: an upgraded socket closed where libc's close() is not called (libuv
 * closes with syscall(SYS_close, fd); close_range), then the next accepted connection
 * takes its number: the first one's peer reads all it was sent and then EOF, and the new
 * connection (whose client writes before the server has looked at it) keeps its bytes */
#define RAWCLOSE_N 100000
static const char *rawclose_how[3] = { "syscall_close", "close_range", "syscall_close_range" };

static int raw_close(int how, int fd)
{
    if (how == 0) return (int)syscall(SYS_close, fd);
    if (how == 1) return close_range((unsigned)fd, (unsigned)fd, 0);
    return (int)syscall(SYS_close_range, fd, fd, 0);
}

static void rawclose_server(void)
{
    for (int how = 0; how < 3; how++) {
        char name[64], why[256] = "";
        int fd = server_accept_warm();
        if (fd < 0) return;
        snprintf(name, sizeof name, "rawclose_%s_write", rawclose_how[how]);
        CHECK(name, send_pat(fd, 180 + how, 0, RAWCLOSE_N), "errno=%d", errno);
        snprintf(name, sizeof name, "rawclose_%s_read", rawclose_how[how]);
        CHECK(name, recv_pat(fd, 183 + how, 0, 64, why, sizeof why), "%s", why);
        snprintf(name, sizeof name, "rawclose_%s", rawclose_how[how]);
        int r = raw_close(how, fd);
        CHECK(name, r == 0, "returned %d errno=%d (%s)", r, errno, strerror(errno));
        int fd2 = server_accept_warm();
        if (fd2 < 0) return;
        if (fd2 != fd) info("the next connection got number %d, not %d: reuse not tested", fd2, fd);
        snprintf(name, sizeof name, "rawclose_%s_next_read", rawclose_how[how]);
        CHECK(name, recv_pat(fd2, 186 + how, 0, RAWCLOSE_N, why, sizeof why), "connection at reused number %d: %s",
              fd2, why);
        snprintf(name, sizeof name, "rawclose_%s_next_write", rawclose_how[how]);
        CHECK(name, send_pat(fd2, 189 + how, 0, RAWCLOSE_N), "errno=%d", errno);
        char c;
        ssize_t e = read(fd2, &c, 1);
        snprintf(name, sizeof name, "rawclose_%s_next_eof", rawclose_how[how]);
        CHECK(name, e == 0, "read returned %zd errno=%d (%s)", e, errno, strerror(errno));
        close(fd2);
    }
}

static void rawclose_client(void)
{
    for (int how = 0; how < 3; how++) {
        char name[64], why[256] = "";
        int fd = client_connect_warm();
        if (fd < 0) return;
        snprintf(name, sizeof name, "rawclose_%s_peer_read", rawclose_how[how]);
        CHECK(name, recv_pat(fd, 180 + how, 0, RAWCLOSE_N, why, sizeof why), "%s", why);
        send_pat(fd, 183 + how, 0, 64);
        char c;
        ssize_t e = read(fd, &c, 1);
        snprintf(name, sizeof name, "rawclose_%s_peer_eof", rawclose_how[how]);
        CHECK(name, e == 0, "read returned %zd errno=%d (%s)", e, errno, strerror(errno));
        close(fd);
        int fd2 = client_connect_warm();
        if (fd2 < 0) return;
        send_pat(fd2, 186 + how, 0, RAWCLOSE_N);
        snprintf(name, sizeof name, "rawclose_%s_next_peer_read", rawclose_how[how]);
        CHECK(name, recv_pat(fd2, 189 + how, 0, RAWCLOSE_N, why, sizeof why), "%s", why);
        close(fd2);
    }
}

/* ---- shutdown(SHUT_WR), both directions ------------------------------------------- */
/* the side that half-closes */
static void half_closer(int fd, const char *sfx, unsigned out_seed, unsigned in_seed)
{
    char name[64], why[256] = "";
    int ok = send_pat(fd, out_seed, 0, 5000);
    int sr = shutdown(fd, SHUT_WR);
    snprintf(name, sizeof name, "shutdown_wr_%s", sfx);
    CHECK(name, ok && sr == 0, "send ok %d, shutdown=%d errno=%d", ok, sr, errno);
    ssize_t s = send(fd, "x", 1, MSG_NOSIGNAL);
    int e = errno;
    snprintf(name, sizeof name, "send_after_shut_wr_epipe_%s", sfx);
    CHECK(name, s < 0 && e == EPIPE, "send returned %zd errno=%d (%s)", s, e, strerror(e));
    snprintf(name, sizeof name, "half_close_other_dir_%s", sfx);
    CHECK(name, recv_pat(fd, in_seed, 0, 5000, why, sizeof why), "%s", why);
    char c;
    ssize_t r = read(fd, &c, 1);
    snprintf(name, sizeof name, "eof_after_peer_close_%s", sfx);
    CHECK(name, r == 0, "read returned %zd errno=%d (%s)", r, errno, strerror(errno));
    close(fd);
}

/* the side that sees the half-close */
static void half_closed(int fd, const char *sfx, unsigned in_seed, unsigned out_seed)
{
    char name[64], why[256] = "";
    int ok = recv_pat(fd, in_seed, 0, 5000, why, sizeof why);
    char c;
    ssize_t r = read(fd, &c, 1);
    int e = errno;
    snprintf(name, sizeof name, "half_close_eof_%s", sfx);
    CHECK(name, ok && r == 0, "%s; read after the data returned %zd errno=%d (%s)", why, r, e, strerror(e));
    struct pollfd p = { fd, POLLIN | POLLRDHUP, 0 };
    int pr = poll(&p, 1, 0);
    snprintf(name, sizeof name, "poll_rdhup_half_close_%s", sfx);
    CHECK(name, pr == 1 && (p.revents & POLLIN) && (p.revents & POLLRDHUP) && !(p.revents & (POLLERR | POLLHUP)),
          "poll=%d revents=%#x", pr, p.revents);
    r = read(fd, &c, 1);
    snprintf(name, sizeof name, "eof_sticky_%s", sfx);
    CHECK(name, r == 0, "second read returned %zd errno=%d", r, errno);
    snprintf(name, sizeof name, "write_after_peer_shut_wr_%s", sfx);
    CHECK(name, send_pat(fd, out_seed, 0, 5000), "errno=%d", errno);
    close(fd);
}

static void shut_c_server(void) { int fd = server_accept_warm(); if (fd >= 0) half_closed(fd, "s", 80, 81); }
static void shut_c_client(void) { int fd = client_connect_warm(); if (fd >= 0) half_closer(fd, "c", 80, 81); }
static void shut_s_server(void) { int fd = server_accept_warm(); if (fd >= 0) half_closer(fd, "s", 82, 83); }
static void shut_s_client(void) { int fd = client_connect_warm(); if (fd >= 0) half_closed(fd, "c", 82, 83); }

/* ---- poll / ppoll / select / pselect readiness ---------------------------------------- */
enum { W_POLL, W_PPOLL, W_SELECT, W_PSELECT };
static const char *wname[4] = { "poll", "ppoll", "select", "pselect" };

/* Waits on fd (and on `other`, a descriptor that must never be reported).  Returns a bit
 * set: 1 readable, 2 writable, 4 "other" reported; -1 error. */
static int wait_fd(int kind, int fd, int rd, int wr, int timeout_ms, int other)
{
    if (kind == W_POLL || kind == W_PPOLL) {
        struct pollfd p[2] = { { other, POLLIN, 0 }, { fd, (short)((rd ? POLLIN : 0) | (wr ? POLLOUT : 0)), 0 } };
        int r;
        if (kind == W_POLL) {
            r = poll(p, 2, timeout_ms);
        } else {
            struct timespec ts = { timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L };
            sigset_t mask;
            sigemptyset(&mask);
            r = ppoll(p, 2, &ts, &mask);
        }
        if (r < 0) return -1;
        return (p[1].revents & POLLIN ? 1 : 0) | (p[1].revents & POLLOUT ? 2 : 0) | (p[0].revents ? 4 : 0);
    }
    fd_set rs, ws;
    FD_ZERO(&rs);
    FD_ZERO(&ws);
    FD_SET(other, &rs);
    if (rd) FD_SET(fd, &rs);
    if (wr) FD_SET(fd, &ws);
    int n = (fd > other ? fd : other) + 1;
    int r;
    if (kind == W_SELECT) {
        struct timeval tv = { timeout_ms / 1000, (timeout_ms % 1000) * 1000 };
        r = select(n, &rs, &ws, NULL, &tv);
    } else {
        struct timespec ts = { timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L };
        sigset_t mask;
        sigemptyset(&mask);
        r = pselect(n, &rs, &ws, NULL, &ts, &mask);
    }
    if (r < 0) return -1;
    return (FD_ISSET(fd, &rs) ? 1 : 0) | (FD_ISSET(fd, &ws) ? 2 : 0) | (FD_ISSET(other, &rs) ? 4 : 0);
}

static void pollfam_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    int pp[2];
    if (pipe(pp) < 0) die("pipe");
    for (int k = 0; k < 4; k++) {
        char name[64], why[256] = "";
        int r = wait_fd(k, fd, 1, 0, 50, pp[0]);
        snprintf(name, sizeof name, "%s_idle", wname[k]);
        CHECK(name, r == 0, "returned %d (1 readable, 4 pipe), errno=%d", r, errno);
        ctl_send("go", (unsigned)k);
        long long t0 = now_ms();
        r = wait_fd(k, fd, 1, 0, WAIT_MS, pp[0]);
        long long dt = now_ms() - t0;
        int ok = recv_pat(fd, 90 + (unsigned)k, 0, 100, why, sizeof why);
        snprintf(name, sizeof name, "%s_readable_after_delay", wname[k]);
        CHECK(name, r == 1 && dt >= DELAY_MS / 2 && ok, "returned %d after %lld ms (peer sends after %d ms); %s", r, dt,
              DELAY_MS, why);
        r = wait_fd(k, fd, 1, 0, 0, pp[0]);
        snprintf(name, sizeof name, "%s_idle_after_read", wname[k]);
        CHECK(name, r == 0, "returned %d, errno=%d", r, errno);
        r = wait_fd(k, fd, 0, 1, 1000, pp[0]);
        snprintf(name, sizeof name, "%s_writable", wname[k]);
        CHECK(name, r == 2, "returned %d, errno=%d", r, errno);
    }
    ctl_send("done", 0);
    close(pp[0]);
    close(pp[1]);
    close(fd);
}

static void pollfam_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    for (int k = 0; k < 4; k++) {
        ctl_need("go", NULL);
        sleep_ms(DELAY_MS);
        if (!send_pat(fd, 90 + (unsigned)k, 0, 100)) report(0, "pollfam_send", "errno=%d", errno);
    }
    ctl_need("done", NULL);
    close(fd);
}

/* ---- epoll: level-triggered, epoll_pwait ------------------------------------------------ */
static int ep_wait1(int ep, int timeout_ms, struct epoll_event *out, int use_pwait)
{
    struct epoll_event ev[4];
    int n;
    if (use_pwait == 2) {
        struct timespec ts = { timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L };
        n = epoll_pwait2(ep, ev, 4, timeout_ms < 0 ? NULL : &ts, NULL);
    } else if (use_pwait) {
        sigset_t mask;
        sigemptyset(&mask);
        n = epoll_pwait(ep, ev, 4, timeout_ms, &mask);
    } else {
        n = epoll_wait(ep, ev, 4, timeout_ms);
    }
    if (n > 0 && out) *out = ev[0];
    return n;
}


static void epoll_lt_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    int ep = epoll_create1(EPOLL_CLOEXEC);
    int pp[2];
    if (ep < 0 || pipe(pp) < 0) die("epoll_create1/pipe");
    struct epoll_event ev = { .events = EPOLLIN, .data.u64 = EP_TAG };
    struct epoll_event pe = { .events = EPOLLIN, .data.u64 = 7 };
    int c1 = epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev), c2 = epoll_ctl(ep, EPOLL_CTL_ADD, pp[0], &pe);
    CHECK("epoll_ctl_add", c1 == 0 && c2 == 0, "errno=%d", errno);
    struct epoll_event got;
    int n = ep_wait1(ep, 50, &got, 0);
    CHECK("epoll_idle", n == 0, "epoll_wait returned %d (events %#x data %#llx)", n, n > 0 ? got.events : 0,
          n > 0 ? (unsigned long long)got.data.u64 : 0ull);
    ctl_send("go1", 0);
    long long t0 = now_ms();
    n = ep_wait1(ep, WAIT_MS, &got, 0);
    long long dt = now_ms() - t0;
    CHECK("epoll_readable_after_delay", n == 1 && (got.events & EPOLLIN) && got.data.u64 == EP_TAG && dt >= DELAY_MS / 2,
          "epoll_wait returned %d events %#x data %#llx after %lld ms", n, n > 0 ? got.events : 0,
          n > 0 ? (unsigned long long)got.data.u64 : 0ull, dt);
    char why[256] = "";
    int ok = recv_pat(fd, 95, 0, 40, why, sizeof why);
    n = ep_wait1(ep, 0, &got, 0);
    CHECK("epoll_lt_still_readable", ok && n == 1 && (got.events & EPOLLIN) && got.data.u64 == EP_TAG,
          "%s; after reading 40 of 100 bytes epoll_wait returned %d", why, n);
    /* Another descriptor ready beside a readable ring, one event per call: reported within
     * a few calls, as the kernel's ready descriptors take turns (the ring is not read) */
    int pipe_seen = -1;
    if (write(pp[1], "p", 1) == 1)
        for (int i = 0; i < 4 && pipe_seen < 0; i++)
            if (epoll_wait(ep, &got, 1, 0) == 1 && got.data.u64 == 7) pipe_seen = i;
    char pb;
    CHECK("epoll_other_ready_not_starved", pipe_seen >= 0 && read(pp[0], &pb, 1) == 1,
          "with the ring readable, 4 epoll_wait calls of one event never reported a readable pipe");
    ok = recv_pat(fd, 95, 40, 60, why, sizeof why);
    n = ep_wait1(ep, 50, &got, 0);
    CHECK("epoll_idle_after_read", ok && n == 0, "%s; epoll_wait returned %d events %#x", why, n, n > 0 ? got.events : 0);
    /* the ring empty, the pipe readable: every call that does not wait reports it */
    int pipe_calls = 0;
    if (write(pp[1], "q", 1) == 1)
        for (int i = 0; i < 3; i++) pipe_calls += epoll_wait(ep, &got, 1, 0) == 1 && got.data.u64 == 7;
    CHECK("epoll_zero_timeout_sees_others", pipe_calls == 3 && read(pp[0], &pb, 1) == 1,
          "a readable pipe was reported by %d of 3 epoll_wait calls with timeout 0", pipe_calls);
    ctl_send("go2", 0);
    n = ep_wait1(ep, WAIT_MS, &got, 1);
    ok = recv_pat(fd, 96, 0, 10, why, sizeof why);
    CHECK("epoll_pwait_readable", n == 1 && (got.events & EPOLLIN) && got.data.u64 == EP_TAG && ok,
          "epoll_pwait returned %d; %s", n, why);
    /* read until EAGAIN, as event loops do, then wait with epoll_pwait2 */
    uint8_t none;
    ssize_t nr = recv(fd, &none, 1, MSG_DONTWAIT);
    int ne = errno;
    ctl_send("go3", 0);
    n = ep_wait1(ep, WAIT_MS, &got, 2);
    uint8_t b10[10];                    /* readable means readable now: a non-blocking read */
    ssize_t r10 = recv(fd, b10, sizeof b10, MSG_DONTWAIT);
    CHECK("epoll_pwait2_readable", nr < 0 && ne == EAGAIN && n == 1 && (got.events & EPOLLIN) &&
          got.data.u64 == EP_TAG && r10 == 10 && mismatch(b10, 10, 97, 0) < 0,
          "recv %zd errno %d, then epoll_pwait2 returned %d, then a non-blocking recv %zd", nr, ne, n, r10);
    struct epoll_event wev = { .events = EPOLLOUT, .data.u64 = EP_TAG };
    c1 = epoll_ctl(ep, EPOLL_CTL_MOD, fd, &wev);
    n = ep_wait1(ep, 1000, &got, 0);
    CHECK("epoll_out", c1 == 0 && n == 1 && (got.events & EPOLLOUT) && !(got.events & EPOLLIN),
          "epoll_ctl MOD=%d epoll_wait returned %d events %#x", c1, n, n > 0 ? got.events : 0);
    c1 = epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
    n = ep_wait1(ep, 0, &got, 0);
    CHECK("epoll_ctl_del", c1 == 0 && n == 0, "DEL=%d epoll_wait=%d", c1, n);
    ctl_send("done", 0);
    close(ep);
    close(pp[0]);
    close(pp[1]);
    close(fd);
}

static void epoll_lt_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    ctl_need("go1", NULL);
    sleep_ms(DELAY_MS);
    send_pat(fd, 95, 0, 100);
    ctl_need("go2", NULL);
    sleep_ms(DELAY_MS / 2);
    send_pat(fd, 96, 0, 10);
    ctl_need("go3", NULL);
    sleep_ms(DELAY_MS / 2);
    send_pat(fd, 97, 0, 10);
    ctl_need("done", NULL);
    close(fd);
}

/* ---- epoll registration before connect (as some event loops do), then request/response
 * reading until EAGAIN: every reply must wake the client's epoll_wait --------------------- */
#define EARLY_ROUNDS 20
static void epoll_early_server(void)
{
    int fd = server_accept(ACC_PLAIN);
    if (fd < 0) return;
    uint8_t req[100];
    int ok = 1;
    for (int i = 0; i < EARLY_ROUNDS && ok; i++) {
        ok = rd_full(fd, req, sizeof req) == (ssize_t)sizeof req && mismatch(req, sizeof req, 150, (size_t)i * 100) < 0;
        sleep_ms(10);                        /* the client is asleep in epoll_wait by now */
        fill(req, sizeof req, 151, (size_t)i * 100);
        ok = ok && wr_all(fd, req, sizeof req) == (ssize_t)sizeof req;
    }
    ctl_need("done", NULL);
    close(fd);
}

static void epoll_early_client(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) die("socket");
    int ep = epoll_create1(EPOLL_CLOEXEC);
    /* registered while not connected; edge-triggered, so a wait that was not armed would
     * not even be woken by a stale doorbell */
    struct epoll_event ev = { .events = EPOLLIN | EPOLLET, .data.u64 = EP_TAG };
    int c1 = epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    struct sockaddr_in a = server_addr();
    int r = connect(fd, (struct sockaddr *)&a, sizeof a);
    struct pollfd p = { fd, POLLOUT, 0 };
    if (r < 0 && errno == EINPROGRESS) poll(&p, 1, WAIT_MS);
    announce(fd);
    int rounds = 0, slept = 0;
    long long worst = 0;
    char why[160] = "";
    for (int i = 0; i < EARLY_ROUNDS && !why[0]; i++) {
        uint8_t b[100];
        fill(b, sizeof b, 150, (size_t)i * 100);
        if (wr_all(fd, b, sizeof b) != (ssize_t)sizeof b) { snprintf(why, sizeof why, "round %d: write errno %d", i, errno); break; }
        size_t got = 0;
        while (got < sizeof b && !why[0]) {
            ssize_t n = recv(fd, b + got, sizeof b - got, 0);
            if (n > 0) { got += (size_t)n; continue; }
            if (n == 0 || errno != EAGAIN) { snprintf(why, sizeof why, "round %d: recv %zd errno %d", i, n, errno); break; }
            struct epoll_event out;
            long long t0 = now_ms();
            int k = ep_wait1(ep, WAIT_MS, &out, 0);
            slept++;
            if (now_ms() - t0 > worst) worst = now_ms() - t0;
            if (k != 1) snprintf(why, sizeof why, "round %d: epoll_wait returned %d after %lld ms", i, k, now_ms() - t0);
        }
        if (!why[0] && mismatch(b, sizeof b, 151, (size_t)i * 100) >= 0) snprintf(why, sizeof why, "round %d: reply differs", i);
        if (!why[0]) rounds++;
    }
    /* about one wait per round: more means a wait returned with nothing to read (spun) */
    CHECK("epoll_before_connect", c1 == 0 && rounds == EARLY_ROUNDS && slept <= 3 * EARLY_ROUNDS,
          "epoll_ctl ADD=%d; %d of %d rounds; %s (%d epoll waits, longest %lld ms)", c1, rounds, EARLY_ROUNDS, why,
          slept, worst);
    info("%d epoll waits in %d rounds, longest %lld ms", slept, rounds, worst);
    ctl_send("done", 0);
    close(ep);
    close(fd);
}

/* ---- EPOLLET ----------------------------------------------------------------------- */
static void epoll_et_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    int ep = epoll_create(4);
    if (ep < 0) die("epoll_create");
    struct epoll_event ev = { .events = EPOLLIN | EPOLLET, .data.u64 = EP_TAG };
    CHECK("epoll_create_ctl_et", epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0, "errno=%d", errno);
    struct epoll_event got;
    int n = ep_wait1(ep, 50, &got, 0);
    CHECK("epollet_idle", n == 0, "epoll_wait returned %d", n);
    ctl_send("go1", 0);
    n = ep_wait1(ep, WAIT_MS, &got, 0);
    CHECK("epollet_edge", n == 1 && (got.events & EPOLLIN) && got.data.u64 == EP_TAG, "epoll_wait returned %d events %#x",
          n, n > 0 ? got.events : 0);
    char why[256] = "";
    int ok = recv_pat(fd, 97, 0, 40, why, sizeof why);
    n = ep_wait1(ep, 100, &got, 0);
    CHECK("epollet_no_repeat", ok && n == 0,
          "%s; after reading 40 of 100 bytes (no new data) epoll_wait(EPOLLET) returned %d events %#x", why, n,
          n > 0 ? got.events : 0);
    ctl_send("go2", 0);
    n = ep_wait1(ep, WAIT_MS, &got, 0);
    CHECK("epollet_new_edge", n == 1 && (got.events & EPOLLIN), "epoll_wait returned %d", n);
    ok = recv_pat(fd, 97, 40, 70, why, sizeof why);
    CHECK("epollet_data", ok, "%s", why);
    ctl_send("done", 0);
    close(ep);
    close(fd);
}

static void epoll_et_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    ctl_need("go1", NULL);
    sleep_ms(DELAY_MS);
    send_pat(fd, 97, 0, 100);
    ctl_need("go2", NULL);
    sleep_ms(DELAY_MS / 2);
    send_pat(fd, 97, 100, 10);
    ctl_need("done", NULL);
    close(fd);
}

/* ---- EPOLLONESHOT ------------------------------------------------------------------- */
static void epoll_oneshot_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    int ep = epoll_create1(0);
    if (ep < 0) die("epoll_create1");
    struct epoll_event ev = { .events = EPOLLIN | EPOLLONESHOT, .data.u64 = EP_TAG };
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    struct epoll_event got;
    ctl_send("go1", 0);
    int n = ep_wait1(ep, WAIT_MS, &got, 0);
    CHECK("oneshot_first", n == 1 && (got.events & EPOLLIN) && got.data.u64 == EP_TAG, "epoll_wait returned %d", n);
    n = ep_wait1(ep, 100, &got, 0);
    CHECK("oneshot_disarmed", n == 0, "second epoll_wait (data unread, no EPOLL_CTL_MOD) returned %d events %#x", n,
          n > 0 ? got.events : 0);
    ctl_send("go2", 0);
    unsigned long long dummy;
    ctl_need("sent2", &dummy);
    sleep_ms(20);
    n = ep_wait1(ep, 100, &got, 0);
    CHECK("oneshot_disarmed_new_data", n == 0, "epoll_wait after more data (no EPOLL_CTL_MOD) returned %d events %#x", n,
          n > 0 ? got.events : 0);
    ev.events = EPOLLIN | EPOLLONESHOT;
    int m = epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev);
    n = ep_wait1(ep, WAIT_MS, &got, 0);
    CHECK("oneshot_rearm", m == 0 && n == 1 && (got.events & EPOLLIN), "MOD=%d epoll_wait returned %d", m, n);
    char why[256] = "";
    CHECK("oneshot_data", recv_pat(fd, 98, 0, 110, why, sizeof why), "%s", why);
    ctl_send("done", 0);
    close(ep);
    close(fd);
}

static void epoll_oneshot_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    ctl_need("go1", NULL);
    sleep_ms(DELAY_MS / 2);
    send_pat(fd, 98, 0, 100);
    ctl_need("go2", NULL);
    send_pat(fd, 98, 100, 10);
    ctl_send("sent2", 0);
    ctl_need("done", NULL);
    close(fd);
}

/* ---- EPOLLRDHUP on peer close --------------------------------------------------------- */
static void epoll_rdhup_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = { .events = EPOLLIN | EPOLLRDHUP, .data.u64 = EP_TAG };
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    struct epoll_event got;
    int n = ep_wait1(ep, 50, &got, 0);
    CHECK("rdhup_idle", n == 0, "epoll_wait returned %d events %#x", n, n > 0 ? got.events : 0);
    ctl_send("go", 0);
    unsigned seen = 0;
    long long end = now_ms() + WAIT_MS;
    while (!(seen & EPOLLRDHUP) && now_ms() < end) {
        n = ep_wait1(ep, (int)(end - now_ms()), &got, 0);
        if (n == 1) seen |= got.events;
        if (n < 0) break;
        if (n == 1 && !(got.events & EPOLLRDHUP)) sleep_ms(5);   /* LT: data without RDHUP yet */
    }
    CHECK("epoll_rdhup", (seen & EPOLLRDHUP) && (seen & EPOLLIN), "events seen %#x", seen);
    char why[256] = "";
    int ok = recv_pat(fd, 99, 0, 10, why, sizeof why);
    char c;
    ssize_t r = read(fd, &c, 1);
    CHECK("eof_after_rdhup", ok && r == 0, "%s; read returned %zd errno=%d (%s)", why, r, errno, strerror(errno));
    struct pollfd p = { fd, POLLIN | POLLRDHUP, 0 };
    int pr = poll(&p, 1, 0);
    CHECK("poll_rdhup_peer_closed", pr == 1 && (p.revents & POLLRDHUP) && (p.revents & POLLIN), "poll=%d revents=%#x", pr,
          p.revents);
    close(ep);
    close(fd);
}

static void epoll_rdhup_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    ctl_need("go", NULL);
    send_pat(fd, 99, 0, 10);
    sleep_ms(DELAY_MS);
    close(fd);
}

/* ---- ring full: nonblocking writes until EAGAIN, then EPOLLOUT / POLLOUT after drain ---- */
static uint8_t fill_chunk[4096];

/* Writes the pattern stream from *off until EAGAIN persists (TCP may still move data into
 * the peer's receive buffer right after the first EAGAIN).  Returns bytes written. */
static size_t fill_until_full(int fd, size_t *off)
{
    size_t start = *off;
    int eagain_rounds = 0;
    long long end = now_ms() + 2000;
    while (eagain_rounds < 3 && now_ms() < end) {
        fill(fill_chunk, sizeof fill_chunk, 110, *off);
        ssize_t w = write(fd, fill_chunk, sizeof fill_chunk);
        if (w > 0) { *off += (size_t)w; eagain_rounds = 0; continue; }
        if (w < 0 && errno == EAGAIN) { eagain_rounds++; sleep_ms(20); continue; }
        break;
    }
    return *off - start;
}

static void ringfull_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    set_nonblock(fd, 1);
    size_t off = 0;
    /* round 1: epoll */
    size_t t1 = fill_until_full(fd, &off);
    ssize_t w = write(fd, fill_chunk, 1);
    int e = errno;
    CHECK("ring_full_eagain", t1 > 0 && w < 0 && e == EAGAIN, "filled %zu bytes, next write %zd errno=%d", t1, w, e);
    info("round 1 filled %zu bytes", t1);
    int ep = epoll_create1(0);
    struct epoll_event ev = { .events = EPOLLOUT, .data.u64 = EP_TAG }, got;
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
    int n = ep_wait1(ep, 50, &got, 0);
    CHECK("epollout_not_when_full", n == 0, "epoll_wait(EPOLLOUT) on a full socket returned %d events %#x "
          "(a write now gives EAGAIN)", n, n > 0 ? got.events : 0);
    struct pollfd p = { fd, POLLOUT, 0 };
    int pr = poll(&p, 1, 0);
    CHECK("pollout_not_when_full", pr == 0, "poll(POLLOUT) returned %d revents %#x", pr, p.revents);
    ctl_send("drain", t1);
    long long t0 = now_ms();
    n = ep_wait1(ep, WAIT_MS, &got, 0);
    long long dt = now_ms() - t0;
    CHECK("epollout_after_drain", n == 1 && (got.events & EPOLLOUT), "epoll_wait returned %d events %#x after %lld ms", n,
          n > 0 ? got.events : 0, dt);
    unsigned long long v = 0;
    ctl_need("drained", &v);
    CHECK("ring_full_data_1", v == t1, "peer verified %llu of %zu bytes", v, t1);
    /* round 2: poll */
    size_t t2 = fill_until_full(fd, &off);
    info("round 2 filled %zu bytes", t2);
    pr = poll(&p, 1, 0);
    CHECK("pollout_not_when_full_2", t2 > 0 && pr == 0, "filled %zu; poll(POLLOUT) returned %d revents %#x", t2, pr,
          p.revents);
    ctl_send("drain", t2);
    t0 = now_ms();
    pr = poll(&p, 1, WAIT_MS);
    dt = now_ms() - t0;
    CHECK("pollout_after_drain", pr == 1 && (p.revents & POLLOUT), "poll returned %d revents %#x after %lld ms", pr,
          p.revents, dt);
    ctl_need("drained", &v);
    CHECK("ring_full_data_2", v == t2, "peer verified %llu of %zu bytes", v, t2);
    ctl_send("drain", 0);
    close(ep);
    close(fd);
}

static void ringfull_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    size_t off = 0;
    uint8_t *b = malloc(1 << 16);
    for (;;) {
        unsigned long long n;
        ctl_need("drain", &n);
        if (!n) break;
        sleep_ms(DELAY_MS);                  /* the writer is asleep in epoll_wait / poll now */
        size_t got = 0;
        long bad = -1;
        while (got < n) {
            size_t want = n - got < (1 << 16) ? n - got : (1 << 16);
            ssize_t r = read(fd, b, want);
            if (r <= 0) break;
            long m = mismatch(b, (size_t)r, 110, off);
            if (m >= 0 && bad < 0) bad = (long)got + m;
            got += (size_t)r;
            off += (size_t)r;
        }
        if (bad >= 0) report(0, "ring_full_read", "byte %ld differs", bad);
        ctl_send("drained", bad >= 0 ? 0 : got);
    }
    free(b);
    close(fd);
}

/* ---- a writer like libpq's: nonblocking writes; when one is short, a nonblocking read,
 * then poll(POLLIN|POLLOUT).  The reader frees room at its own pace, so credit often
 * comes between the writer's look at the ring and its sleep: a poll that then sleeps to
 * its timeout lost a wake-up. ------------------------------------------------------------ */
#define PW_RUN_MS   1500
#define PW_POLL_MS  2000
#define PW_PERIOD   (1 << 20)          /* the stream repeats this pattern: cheap to write and check */
static uint8_t pw_pat[PW_PERIOD + (1 << 16)];
static void pw_fill(void)
{
    fill(pw_pat, PW_PERIOD, 120, 0);
    memcpy(pw_pat + PW_PERIOD, pw_pat, 1 << 16);   /* a write may run past the period's end */
}

static void pollwriter_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    set_nonblock(fd, 1);
    pw_fill();
    size_t off = 0;
    long waits = 0, lost = 0;
    long long end = now_ms() + PW_RUN_MS, slowest = 0;
    while (now_ms() < end && !lost) {
        size_t left = 1 << 16;
        while (left && !lost) {
            ssize_t w = write(fd, pw_pat + off % PW_PERIOD, left);
            if (w > 0) { left -= (size_t)w; off += (size_t)w; }
            else if (w < 0 && errno != EAGAIN) { report(0, "pollwriter_no_lost_wakeup", "write: errno %d", errno); return; }
            if (!left) break;
            uint8_t b;
            ssize_t r = recv(fd, &b, 1, MSG_DONTWAIT);
            if (r != -1 || errno != EAGAIN) { report(0, "pollwriter_no_lost_wakeup", "recv gave %zd errno %d", r, errno); return; }
            struct pollfd p = { fd, POLLIN | POLLOUT, 0 };
            waits++;
            long long t0 = now_ms();
            int pr = poll(&p, 1, PW_POLL_MS);
            long long took = now_ms() - t0;
            /* a sleep to the timeout: the wait after it finds room it was never woken for */
            if (pr <= 0 || took >= PW_POLL_MS - 100) lost++;
            if (took > slowest) slowest = took;
        }
    }
    CHECK("pollwriter_no_lost_wakeup", !lost, "poll(POLLIN|POLLOUT) slept %d ms with room in the ring "
          "(%ld of %ld waits, %zu bytes written)", PW_POLL_MS, lost, waits, off);
    info("%zu bytes, %ld waits, slowest %lld ms", off, waits, slowest);
    shutdown(fd, SHUT_WR);
    unsigned long long v = 0;
    ctl_need("drained", &v);
    CHECK("pollwriter_data", v == off, "peer verified %llu of %zu bytes", v, off);
    close(fd);
}

static void pollwriter_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    pw_fill();
    static uint8_t b[3000];
    size_t off = 0;
    long bad = -1;
    for (;;) {
        ssize_t r = read(fd, b, sizeof b);
        if (r <= 0) break;
        if (bad < 0 && memcmp(b, pw_pat + off % PW_PERIOD, (size_t)r)) bad = (long)off;
        off += (size_t)r;
        for (volatile int i = 0; i < 300; i++) {}   /* slower than the writer: the ring stays full */
    }
    if (bad >= 0) report(0, "pollwriter_read", "bytes from %ld differ", bad);
    ctl_send("drained", bad >= 0 ? 0 : off);
    close(fd);
}

/* ---- fork: the child does the I/O, the parent closes its copy ------------------------ */
static void fork_server(void)
{
    int fd = server_accept(ACC_PLAIN);
    if (fd < 0) return;
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        signal(SIGALRM, SIG_DFL);
        alarm(WATCHDOG_S);
        char why[256] = "";
        int ok = recv_pat(fd, 120, 0, 1000, why, sizeof why) && send_pat(fd, 121, 0, 1000);
        CHECK("fork_child_io", ok, "%s errno=%d", why, errno);
        sleep_ms(3 * DELAY_MS);
        CHECK("fork_child_close", close(fd) == 0, "errno=%d", errno);
        fflush(stdout);
        _exit(ok ? 0 : 1);
    }
    CHECK("fork_parent_close", close(fd) == 0, "errno=%d", errno);
    ctl_send("pclosed", 0);
    int st = 0;
    pid_t w;
    while ((w = waitpid(pid, &st, 0)) < 0 && errno == EINTR) {}
    CHECK("fork_child_exit", w == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %#x", st);
}

static void fork_client(void)
{
    int fd = client_connect();
    if (fd < 0) return;
    ctl_need("pclosed", NULL);
    char why[256] = "";
    int ok = send_pat(fd, 120, 0, 1000) && recv_pat(fd, 121, 0, 1000, why, sizeof why);
    CHECK("fork_conn_after_parent_close", ok, "%s errno=%d", why, errno);
    struct pollfd p = { fd, POLLIN, 0 };
    int pr = poll(&p, 1, DELAY_MS);
    CHECK("fork_no_eof_while_child_open", pr == 0, "poll returned %d revents %#x", pr, p.revents);
    char c;
    ssize_t r = read(fd, &c, 1);
    int e = errno;
    CHECK("fork_eof_after_child_close", r == 0, "read returned %zd errno=%d (%s) once the child (last holder) closed", r,
          e, strerror(e));
    close(fd);
}

/* ---- exec: no internal descriptor survives exec ------------------------------------- */
static int exec_check_child(void)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        execl("/proc/self/exe", "preload_calls", "execcheck", (char *)NULL);
        _exit(127);
    }
    int st = 0;
    pid_t w;
    while ((w = waitpid(pid, &st, 0)) < 0 && errno == EINTR) {}
    return w == pid && WIFEXITED(st) ? WEXITSTATUS(st) : 200;
}

static void exec_server(void)
{
    int fd = server_accept(ACC_PLAIN);
    if (fd < 0) return;
    char why[256] = "";
    int ok = recv_pat(fd, 130, 0, 100, why, sizeof why) && send_pat(fd, 131, 0, 100);
    CHECK("exec_before", ok, "%s", why);
    int st = exec_check_child();
    CHECK("exec_no_internal_fds_s", st == 0, "execcheck exited %d (see its info lines)", st);
    ok = recv_pat(fd, 132, 0, 100, why, sizeof why) && send_pat(fd, 133, 0, 100);
    CHECK("exec_conn_still_works_s", ok, "%s", why);
    ctl_send("closing", 0);
    close(fd);
}

static void exec_client(void)
{
    int fd = client_connect();
    if (fd < 0) return;
    char why[256] = "";
    int ok = send_pat(fd, 130, 0, 100) && recv_pat(fd, 131, 0, 100, why, sizeof why);
    CHECK("exec_before_c", ok, "%s", why);
    int st = exec_check_child();
    CHECK("exec_no_internal_fds_c", st == 0, "execcheck exited %d (see its info lines)", st);
    ok = send_pat(fd, 132, 0, 100) && recv_pat(fd, 133, 0, 100, why, sizeof why);
    CHECK("exec_conn_still_works_c", ok, "%s", why);
    ctl_need("closing", NULL);
    char c;
    ssize_t r = read(fd, &c, 1);
    int e = errno;
    CHECK("exec_eof_after_peer_close", r == 0, "read returned %zd errno=%d (%s)", r, e, strerror(e));
    close(fd);
}

/* The exec'd image: every open descriptor, and whether one is a memfd or a UNIX socket
 * bound to an rdmasock name.  Exit 0 if none is. */
static int execcheck_main(void)
{
    int bad = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return 3;
    const char *pre = getenv("LD_PRELOAD");
    printf("info execcheck: pid %d LD_PRELOAD=%s\n", (int)getpid(), pre ? pre : "");
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        int fd = atoi(de->d_name);
        if (fd == dirfd(d)) continue;
        char link[256], target[512];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n < 0) continue;
        target[n] = 0;
        char unixname[512] = "";
        unsigned long ino = 0;
        if (sscanf(target, "socket:[%lu]", &ino) == 1) {
            FILE *f = fopen("/proc/net/unix", "r");
            char line[1024];
            while (f && fgets(line, sizeof line, f)) {
                unsigned long i = 0;
                char path[512] = "";
                /* Num RefCount Protocol Flags Type St Inode Path */
                if (sscanf(line, "%*s %*s %*s %*s %*s %*s %lu %511s", &i, path) >= 1 && i == ino) {
                    snprintf(unixname, sizeof unixname, "unix '%.400s'", path);
                    if (!path[0]) snprintf(unixname, sizeof unixname, "unix (unnamed)");
                }
            }
            if (f) fclose(f);
        }
        int is_bad = strstr(target, "memfd:") != NULL || strstr(unixname, "rdmasock") != NULL;
        printf("info execcheck: fd %d -> %s %s%s\n", fd, target, unixname, is_bad ? "  <-- internal, not CLOEXEC" : "");
        bad |= is_bad;
    }
    closedir(d);
    fflush(stdout);
    return bad ? 1 : 0;
}

/* ---- fortified entry points (meaningful in the -D_FORTIFY_SOURCE=2 build) ------------ */
static void chk_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    char sbuf[256];                        /* fixed size: fortified read/recv check it */
    volatile size_t vn = 100;              /* not a constant: __*_chk, not the plain call */
    volatile nfds_t vnf = 1;
    struct pollfd pfd[2] = { { fd, POLLIN, 0 }, { -1, 0, 0 } };
    volatile int vfd = fd;

    int pr = poll(pfd, vnf, 50);
    CHECK("chk_poll_idle", pr == 0, "poll returned %d revents %#x", pr, pfd[0].revents);
    ctl_send("go1", 0);
    pr = poll(pfd, vnf, WAIT_MS);
    CHECK("chk_poll", pr == 1 && (pfd[0].revents & POLLIN), "poll returned %d revents %#x", pr, pfd[0].revents);
    size_t got = 0;
    char piece[128];
    while (got < 100) {
        ssize_t r = read(fd, piece, vn - got);
        if (r <= 0) break;
        memcpy(sbuf + got, piece, (size_t)r);
        got += (size_t)r;
    }
    CHECK("chk_read", got == 100 && mismatch((uint8_t *)sbuf, 100, 140, 0) < 0, "read %zu bytes", got);
    struct timespec zero = { 0, 0 };
    pfd[0].revents = 0;
    pr = ppoll(pfd, vnf, &zero, NULL);
    CHECK("chk_ppoll_idle", pr == 0, "ppoll after reading everything returned %d revents %#x", pr, pfd[0].revents);
    fd_set rs;
    FD_ZERO(&rs);
    FD_SET(vfd, &rs);
    struct timeval tv = { 0, 50000 };
    int sr = select(fd + 1, &rs, NULL, NULL, &tv);
    CHECK("chk_select_idle", sr == 0, "select returned %d", sr);

    ctl_send("go2", 0);
    memset(sbuf, 0, sizeof sbuf);
    ssize_t r = recv(fd, sbuf, vn, MSG_WAITALL);
    CHECK("chk_recv", r == 100 && mismatch((uint8_t *)sbuf, 100, 141, 0) < 0, "recv returned %zd errno=%d", r, errno);
    ctl_send("go3", 0);
    memset(sbuf, 0, sizeof sbuf);
    r = recvfrom(fd, sbuf, vn, MSG_WAITALL, NULL, NULL);
    CHECK("chk_recvfrom", r == 100 && mismatch((uint8_t *)sbuf, 100, 142, 0) < 0, "recvfrom returned %zd errno=%d", r,
          errno);
    ctl_send("go4", 0);
    struct timespec ts = { WAIT_MS / 1000, 0 };
    pfd[0].revents = 0;
    pr = ppoll(pfd, vnf, &ts, NULL);
    int ok = recv_pat(fd, 143, 0, 100, sbuf, sizeof sbuf);
    CHECK("chk_ppoll", pr == 1 && (pfd[0].revents & POLLIN) && ok, "ppoll returned %d revents %#x", pr, pfd[0].revents);
    ctl_send("go5", 0);
    FD_ZERO(&rs);
    FD_SET(vfd, &rs);
    tv.tv_sec = WAIT_MS / 1000;
    tv.tv_usec = 0;
    sr = select(fd + 1, &rs, NULL, NULL, &tv);
    int isset = FD_ISSET(vfd, &rs);
    ok = recv_pat(fd, 144, 0, 100, sbuf, sizeof sbuf);
    CHECK("chk_select", sr == 1 && isset && ok, "select returned %d isset %d", sr, isset);
    /* POLLOUT from a full ring (the kernel's TCP socket is writable all along) */
    set_nonblock(fd, 1);
    size_t off = 0, t = fill_until_full(fd, &off);
    pfd[0].events = POLLOUT;
    pfd[0].revents = 0;
    pr = ppoll(pfd, vnf, &zero, NULL);
    CHECK("chk_ppoll_pollout_when_full", t > 0 && pr == 0, "after %zu bytes up to EAGAIN, ppoll(POLLOUT) returned %d "
          "revents %#x", t, pr, pfd[0].revents);
    pfd[0].revents = 0;
    pr = poll(pfd, vnf, 0);
    CHECK("chk_poll_pollout_when_full", pr == 0, "poll(POLLOUT) returned %d revents %#x", pr, pfd[0].revents);
    ctl_send("drain", t);
    pfd[0].revents = 0;
    pr = ppoll(pfd, vnf, &ts, NULL);
    CHECK("chk_ppoll_pollout_after_drain", pr == 1 && (pfd[0].revents & POLLOUT), "ppoll returned %d revents %#x", pr,
          pfd[0].revents);
    unsigned long long v = 0;
    ctl_need("drained", &v);
    CHECK("chk_full_data", v == t, "peer verified %llu of %zu bytes", v, t);
    close(fd);
}

static void chk_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    static const char *go[5] = { "go1", "go2", "go3", "go4", "go5" };
    for (int k = 0; k < 5; k++) {
        ctl_need(go[k], NULL);
        sleep_ms(DELAY_MS / 2);
        send_pat(fd, 140 + (unsigned)k, 0, 100);
    }
    unsigned long long n = 0;
    ctl_need("drain", &n);
    sleep_ms(DELAY_MS);
    uint8_t *b = malloc(n ? n : 1);
    ssize_t r = rd_full(fd, b, n);
    long m = r == (ssize_t)n ? mismatch(b, n, 110, 0) : -2;
    free(b);
    ctl_send("drained", m < 0 && r == (ssize_t)n ? n : 0);
    close(fd);
}


/* ---- signals, timeouts and resets: what the kernel does ---------------------------------- */
static volatile sig_atomic_t g_usr1;
static void on_usr1(int sig) { (void)sig; g_usr1++; }

/* Client and server of the signal tests run on different CPUs where there are two, so
 * their waits spin first (a peer on the same CPU is never spun for): with a long busy-poll
 * budget (tests/test_preload_calls.py sets one) the signal arrives inside the spin. */
static void pin_to_cpu(int cpu)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0 || CPU_COUNT(&set) < 2) return;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

struct kicker { pthread_t target; int after_ms; };
static void *kick(void *arg)
{
    struct kicker *k = arg;
    sleep_ms(k->after_ms);
    pthread_kill(k->target, SIGUSR1);
    return NULL;
}

/* One-byte recv on fd while SIGUSR1 (handler flags sa_flags) arrives after DELAY_MS. */
static ssize_t recv_signalled(int fd, int sa_flags, char *c, int *e, long long *dt)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sa.sa_flags = sa_flags;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
    g_usr1 = 0;
    struct kicker k = { pthread_self(), DELAY_MS };
    pthread_t t;
    if (pthread_create(&t, NULL, kick, &k)) die("pthread_create");
    long long t0 = now_ms();
    ssize_t r = recv(fd, c, 1, 0);
    *e = errno;
    *dt = now_ms() - t0;
    pthread_join(t, NULL);
    return r;
}

static void set_timeo(int fd, int opt, int ms)
{
    struct timeval tv = { ms / 1000, (ms % 1000) * 1000 };
    if (setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv) < 0) die("setsockopt timeo");
}

/* The server sends one byte ('a' + i) 4 * DELAY_MS after each "go<i>". */
static void signals_server(void)
{
    pin_to_cpu(0);
    int fd = server_accept_warm();
    if (fd < 0) return;
    static const char *go[3] = { "go1", "go2", "go3" };
    for (int i = 0; i < 3; i++) {
        ctl_need(go[i], NULL);
        sleep_ms(4 * DELAY_MS);
        char c = (char)('a' + i);
        if (wr_all(fd, &c, 1) != 1) report(0, "signals_send", "errno=%d", errno);
    }
    ctl_need("done", NULL);
    close(fd);
}

static void signals_client(void)
{
    pin_to_cpu(1);
    int fd = client_connect_warm();
    if (fd < 0) return;
    char c = 0;
    int e;
    long long dt;
    /* SA_RESTART and no timeout: the kernel restarts the recv, which gets the byte */
    ctl_send("go1", 0);
    ssize_t r = recv_signalled(fd, SA_RESTART, &c, &e, &dt);
    CHECK("sa_restart_recv_restarted", r == 1 && c == 'a' && g_usr1 == 1,
          "recv returned %zd errno=%d (%s) byte %#x, handler ran %d time(s)", r, e, strerror(e), c, (int)g_usr1);
    /* no SA_RESTART: EINTR at the signal, and the byte is still there afterwards */
    ctl_send("go2", 0);
    r = recv_signalled(fd, 0, &c, &e, &dt);
    CHECK("no_restart_recv_eintr", r < 0 && e == EINTR && dt < 4 * DELAY_MS,
          "recv returned %zd errno=%d (%s) after %lld ms", r, e, strerror(e), dt);
    r = recv(fd, &c, 1, 0);
    CHECK("recv_after_eintr", r == 1 && c == 'b', "recv returned %zd errno=%d byte %#x", r, errno, c);
    /* SA_RESTART but SO_RCVTIMEO set: never restarted (signal(7)) */
    set_timeo(fd, SO_RCVTIMEO, 3000);
    ctl_send("go3", 0);
    r = recv_signalled(fd, SA_RESTART, &c, &e, &dt);
    CHECK("sa_restart_rcvtimeo_eintr", r < 0 && e == EINTR && dt < 4 * DELAY_MS,
          "recv returned %zd errno=%d (%s) after %lld ms", r, e, strerror(e), dt);
    r = recv(fd, &c, 1, 0);
    CHECK("recv_after_timeo_eintr", r == 1 && c == 'c', "recv returned %zd errno=%d byte %#x", r, errno, c);
    /* SO_RCVTIMEO with nothing coming: EAGAIN after the timeout */
    set_timeo(fd, SO_RCVTIMEO, 3 * DELAY_MS);
    long long t0 = now_ms();
    r = recv(fd, &c, 1, 0);
    e = errno;
    dt = now_ms() - t0;
    CHECK("rcvtimeo_eagain", r < 0 && e == EAGAIN && dt >= 3 * DELAY_MS - 20 && dt < 3 * DELAY_MS + 1500,
          "recv returned %zd errno=%d (%s) after %lld ms (timeout %d ms)", r, e, strerror(e), dt, 3 * DELAY_MS);
    signal(SIGUSR1, SIG_DFL);
    ctl_send("done", 0);
    close(fd);
}

/* poll, select and epoll_wait are never restarted after a handler, SA_RESTART or not
 * (signal(7)).  Nothing comes while they wait; SIGUSR1 (SA_RESTART) arrives after
 * DELAY_MS. */
static void pollsig_server(void)
{
    pin_to_cpu(0);
    int fd = server_accept_warm();
    if (fd < 0) return;
    ctl_need("done", NULL);
    close(fd);
}

static int wait_signalled(int fd, int how, int *e, long long *dt)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);
    g_usr1 = 0;
    struct kicker k = { pthread_self(), DELAY_MS };
    pthread_t t;
    if (pthread_create(&t, NULL, kick, &k)) die("pthread_create");
    long long t0 = now_ms();
    int r;
    if (how == 0) {
        struct pollfd p = { fd, POLLIN, 0 };
        r = poll(&p, 1, 5000);
    } else if (how == 1) {
        fd_set rd;
        FD_ZERO(&rd);
        FD_SET(fd, &rd);
        struct timeval tv = { 5, 0 };
        r = select(fd + 1, &rd, NULL, NULL, &tv);
    } else {
        int ep = epoll_create1(EPOLL_CLOEXEC);
        struct epoll_event ev = { .events = EPOLLIN, .data.fd = fd };
        epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
        r = epoll_wait(ep, &ev, 1, 5000);
        *e = errno;
        close(ep);
        errno = *e;
    }
    *e = errno;
    *dt = now_ms() - t0;
    pthread_join(t, NULL);
    return r;
}

static void pollsig_client(void)
{
    pin_to_cpu(1);
    int fd = client_connect_warm();
    if (fd < 0) return;
    static const char *names[3] = { "poll_signal_eintr", "select_signal_eintr", "epoll_signal_eintr" };
    for (int how = 0; how < 3; how++) {
        int e;
        long long dt;
        int r = wait_signalled(fd, how, &e, &dt);
        CHECK(names[how], r < 0 && e == EINTR && g_usr1 == 1 && dt < 4 * DELAY_MS,
              "returned %d errno=%d (%s) after %lld ms, handler ran %d time(s)", r, e, strerror(e), dt, (int)g_usr1);
    }
    signal(SIGUSR1, SIG_DFL);
    ctl_send("done", 0);
    close(fd);
}

/* A blocking send that finds the connection already full and sends nothing before a
 * signal: restarted if the handler that ran has SA_RESTART (even while another caught
 * signal's handler lacks it), EINTR if it does not.  The server drains each round
 * 4 * DELAY_MS after "full<i>". */
static void sendsig_server(void)
{
    pin_to_cpu(0);
    int fd = server_accept_warm();
    if (fd < 0) return;
    static const char *full[2] = { "full1", "full2" };
    uint8_t *b = malloc(1 << 16);
    if (!b) die("malloc");
    size_t off = 0;
    for (int i = 0; i < 2; i++) {
        unsigned long long n;
        ctl_need(full[i], &n);
        sleep_ms(4 * DELAY_MS);
        size_t got = 0;
        long bad = -1;
        while (got < n) {
            ssize_t r = read(fd, b, n - got < (1 << 16) ? n - got : (1 << 16));
            if (r <= 0) break;
            long m = mismatch(b, (size_t)r, 110, off);
            if (m >= 0 && bad < 0) bad = (long)got + m;
            got += (size_t)r;
            off += (size_t)r;
        }
        CHECK(i ? "sendsig_stream_intact_2" : "sendsig_stream_intact_1", got == n && bad < 0,
              "read %zu of %llu bytes, first difference at %ld", got, n, bad);
    }
    free(b);
    ctl_need("done", NULL);
    close(fd);
}

static void on_usr2(int sig) { (void)sig; }

static void sendsig_client(void)
{
    pin_to_cpu(1);
    int fd = client_connect_warm();
    if (fd < 0) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    for (int round = 0; round < 2; round++) {
        size_t off0 = 0, off;
        set_nonblock(fd, 1);
        static size_t stream_off;
        off = stream_off;
        off0 = off;
        size_t filled = fill_until_full(fd, &off);
        set_nonblock(fd, 0);
        /* the next byte of the pattern stream, sent blocking into the full connection */
        uint8_t next;
        fill(&next, 1, 110, off);
        sa.sa_handler = on_usr1;
        sa.sa_flags = round == 0 ? SA_RESTART : 0;
        sigaction(SIGUSR1, &sa, NULL);
        sa.sa_handler = on_usr2;
        sa.sa_flags = 0;                           /* caught, never sent: must not matter */
        sigaction(SIGUSR2, &sa, NULL);
        g_usr1 = 0;
        ctl_send(round == 0 ? "full1" : "full2", (unsigned long long)(off - off0 + 1));
        struct kicker k = { pthread_self(), DELAY_MS };
        pthread_t t;
        if (pthread_create(&t, NULL, kick, &k)) die("pthread_create");
        long long t0 = now_ms();
        ssize_t r = send(fd, &next, 1, MSG_NOSIGNAL);
        int e = errno;
        long long dt = now_ms() - t0;
        pthread_join(t, NULL);
        if (round == 0) {
            CHECK("sa_restart_send_restarted", filled > 0 && r == 1 && g_usr1 == 1 && dt >= 3 * DELAY_MS,
                  "filled %zu, send returned %zd errno=%d (%s) after %lld ms, handler ran %d time(s)",
                  filled, r, e, strerror(e), dt, (int)g_usr1);
        } else {
            CHECK("no_restart_send_eintr", filled > 0 && r < 0 && e == EINTR && dt < 4 * DELAY_MS,
                  "filled %zu, send returned %zd errno=%d (%s) after %lld ms", filled, r, e, strerror(e), dt);
            if (r < 0) r = send(fd, &next, 1, MSG_NOSIGNAL);     /* the byte the server counts on */
        }
        stream_off = off + (r == 1 ? 1 : 0);
    }
    signal(SIGUSR1, SIG_DFL);
    signal(SIGUSR2, SIG_DFL);
    ctl_send("done", 0);
    close(fd);
}

/* SO_RCVTIMEO on a connection whose handshake the server never finishes (it accepts and
 * does nothing): the client's first recv ends with EAGAIN at its timeout. */
static void timeo_fresh_server(void)
{
    int fd = server_accept(ACC_PLAIN);
    if (fd < 0) return;
    ctl_need("done", NULL);
    close(fd);
}

static void timeo_fresh_client(void)
{
    int fd = client_connect();
    if (fd < 0) return;
    set_timeo(fd, SO_RCVTIMEO, 3 * DELAY_MS);
    char c;
    long long t0 = now_ms();
    ssize_t r = recv(fd, &c, 1, 0);
    int e = errno;
    long long dt = now_ms() - t0;
    CHECK("rcvtimeo_fresh_eagain", r < 0 && e == EAGAIN && dt >= 3 * DELAY_MS - 20 && dt < 3 * DELAY_MS + 1500,
          "recv returned %zd errno=%d (%s) after %lld ms (timeout %d ms)", r, e, strerror(e), dt, 3 * DELAY_MS);
    /* SO_SNDTIMEO with the server reading nothing: a blocking send of more than the
     * connection holds returns what went out at its timeout */
    set_timeo(fd, SO_SNDTIMEO, 3 * DELAY_MS);
    size_t big = 32u << 20;
    char *b = calloc(1, big);
    if (!b) die("calloc");
    t0 = now_ms();
    r = send(fd, b, big, MSG_NOSIGNAL);
    e = errno;
    dt = now_ms() - t0;
    CHECK("sndtimeo_partial", r > 0 && (size_t)r < big && dt >= 3 * DELAY_MS - 20 && dt < 3 * DELAY_MS + 1500,
          "send returned %zd errno=%d (%s) after %lld ms", r, e, strerror(e), dt);
    t0 = now_ms();
    r = send(fd, b, big, MSG_NOSIGNAL);
    e = errno;
    dt = now_ms() - t0;
    /* the kernel may have grown its buffers meanwhile: a short count or EAGAIN, at the timeout */
    CHECK("sndtimeo_again", ((r < 0 && e == EAGAIN) || (r > 0 && (size_t)r < big)) &&
          dt >= 3 * DELAY_MS - 20 && dt < 3 * DELAY_MS + 1500,
          "send returned %zd errno=%d (%s) after %lld ms", r, e, strerror(e), dt);
    free(b);
    ctl_send("done", 0);
    close(fd);
}

/* A peer that closes abortively: SO_LINGER {1, 0}, or close() with data it has not read.
 * Either way TCP resets the connection: recv gives ECONNRESET once, then 0. */
static void reset_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    struct linger lg = { 1, 0 };
    if (setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg) < 0) die("SO_LINGER");
    ctl_need("ready", NULL);
    close(fd);
    ctl_send("closed", 0);
    fd = server_accept_warm();
    if (fd < 0) return;
    ctl_need("sent", NULL);
    sleep_ms(DELAY_MS);                        /* the client's bytes are here, unread */
    close(fd);
    ctl_send("closed2", 0);
    ctl_need("done", NULL);
}

static void reset_after(int fd, const char *name, const char *name_after)
{
    char c;
    sleep_ms(DELAY_MS);                        /* the reset travels */
    ssize_t r = recv(fd, &c, 1, 0);
    int e = errno;
    CHECK(name, r < 0 && e == ECONNRESET, "recv returned %zd errno=%d (%s)", r, e, strerror(e));
    r = recv(fd, &c, 1, 0);
    e = errno;
    CHECK(name_after, r == 0, "second recv returned %zd errno=%d (%s)", r, e, strerror(e));
    close(fd);
}

static void reset_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    ctl_send("ready", 0);
    ctl_need("closed", NULL);
    reset_after(fd, "linger0_econnreset", "linger0_then_eof");
    fd = client_connect_warm();
    if (fd < 0) return;
    if (wr_all(fd, "unread", 6) != 6) report(0, "reset_send", "errno=%d", errno);
    ctl_send("sent", 0);
    ctl_need("closed2", NULL);
    reset_after(fd, "unread_close_econnreset", "unread_close_then_eof");
    ctl_send("done", 0);
}

/* ---- urgent: MSG_OOB both ways, SIOCATMARK, POLLPRI (over rdmasock the connection
 * moves to TCP, reason urgent_data, behind the bytes before) ------------------------- */
static void urgent_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    char c;
    errno = 0;
    ssize_t r = recv(fd, &c, 1, MSG_OOB | MSG_DONTWAIT);
    CHECK("oob_none_pending", r < 0 && errno == EINVAL, "recv(MSG_OOB) returned %zd errno=%d", r, errno);
    ctl_send("go", 0);
    struct pollfd p = { fd, POLLPRI, 0 };
    r = poll(&p, 1, WAIT_MS);
    CHECK("poll_pri_urgent", r == 1 && (p.revents & POLLPRI), "poll returned %zd revents=0x%x", r, p.revents);
    ctl_need("sent", NULL);
    sleep_ms(50);                                   /* "de" is here too */
    char in[64];
    size_t got = 0;
    int mark = 0;
    for (int i = 0; i < 20 && got < sizeof in; i++) {
        if (ioctl(fd, SIOCATMARK, &mark) < 0) { mark = -errno; break; }
        if (mark) break;
        r = recv(fd, in + got, sizeof in - got, 0);
        if (r <= 0) break;
        got += (size_t)r;
    }
    CHECK("inband_before_mark", mark == 1 && got == 2 && !memcmp(in, "ab", 2),
          "mark=%d after %zu in-band bytes '%.*s'", mark, got, (int)got, in);
    r = recv(fd, &c, 1, MSG_OOB);
    CHECK("oob_byte", r == 1 && c == 'c', "recv(MSG_OOB) returned %zd errno=%d byte 0x%02x", r, errno, (uint8_t)c);
    r = rd_full(fd, in, 2);
    CHECK("inband_after_mark", r == 2 && !memcmp(in, "de", 2), "read %zd errno=%d", r, errno);
    CHECK("reply_after_oob", wr_all(fd, "ok", 2) == 2, "errno=%d", errno);
    r = rd_full(fd, in, 1);
    CHECK("eof_after_oob", r == 0, "read returned %zd errno=%d", r, errno);
    close(fd);
}

static void urgent_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    ctl_need("go", NULL);
    char in[2];
    ssize_t r1 = send(fd, "ab", 2, 0), r2 = send(fd, "c", 1, MSG_OOB), r3 = send(fd, "de", 2, 0);
    CHECK("send_oob", r1 == 2 && r2 == 1 && r3 == 2, "sends returned %zd %zd %zd errno=%d", r1, r2, r3, errno);
    ctl_send("sent", 0);
    ssize_t r = rd_full(fd, in, 2);
    CHECK("read_after_oob", r == 2 && !memcmp(in, "ok", 2), "read %zd errno=%d", r, errno);
    close(fd);
}

/* ---- tcpstate: TCP_INFO, SIOCOUTQ, TCP_CORK, MSG_TRUNC, getpeername ------------------ */
#define TS_N 10000

static int tcp_info_of(int fd, struct tcp_info *ti, uint64_t *acked, uint64_t *received)
{
    uint8_t raw[256];                              /* the kernel's struct, longer than glibc's */
    socklen_t l = sizeof raw;
    memset(raw, 0, sizeof raw);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, raw, &l) < 0 || l < 136) return -1;
    memcpy(ti, raw, sizeof *ti);
    memcpy(acked, raw + 120, 8);                   /* tcpi_bytes_acked (linux/tcp.h) */
    memcpy(received, raw + 128, 8);                /* tcpi_bytes_received */
    return 0;
}

/* tcpi_segs_out/in and tcpi_data_segs_in/out (linux/tcp.h offsets 136, 140, 152, 156) */
static int tcp_segs_of(int fd, uint32_t segs[4])
{
    uint8_t raw[256];
    socklen_t l = sizeof raw;
    memset(raw, 0, sizeof raw);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, raw, &l) < 0 || l < 160) return -1;
    memcpy(&segs[0], raw + 136, 4);
    memcpy(&segs[1], raw + 140, 4);
    memcpy(&segs[2], raw + 152, 4);
    memcpy(&segs[3], raw + 156, 4);
    return 0;
}
#define TS_SEGS 20

static void tcpstate_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    unsigned long long cport = 0;
    ctl_need("port", &cport);
    struct sockaddr_in a;
    socklen_t al = sizeof a;
    CHECK("getpeername", getpeername(fd, (struct sockaddr *)&a, &al) == 0 && ntohs(a.sin_port) == cport &&
          a.sin_addr.s_addr == htonl(INADDR_LOOPBACK), "errno=%d port %d want %llu", errno, ntohs(a.sin_port), cport);
    al = sizeof a;
    CHECK("getsockname", getsockname(fd, (struct sockaddr *)&a, &al) == 0 && ntohs(a.sin_port) == g_port,
          "errno=%d port %d", errno, ntohs(a.sin_port));
    int last = 0;
    CHECK("fionread_all_arrived", wait_fionread(fd, TS_N, &last), "FIONREAD %d", last);
    struct tcp_info ti;
    uint64_t acked = 0, received = 0;
    int r = tcp_info_of(fd, &ti, &acked, &received);
    CHECK("tcp_info_state", r == 0 && ti.tcpi_state == TCP_ESTABLISHED, "r=%d state=%d", r, ti.tcpi_state);
    CHECK("tcp_info_bytes_received", r == 0 && received == TS_N + 2, "bytes_received %llu want %d",
          (unsigned long long)received, TS_N + 2);     /* + the two warm-up bytes */
    ssize_t n = recv(fd, NULL, 100, MSG_PEEK | MSG_TRUNC);
    CHECK("recv_peek_trunc", n == 100, "returned %zd errno=%d", n, errno);
    n = recv(fd, NULL, 4000, MSG_TRUNC | MSG_WAITALL);
    CHECK("recv_trunc_discards", n == 4000, "returned %zd errno=%d", n, errno);
    char why[200];
    CHECK("data_after_trunc", recv_pat(fd, 91, 4000, TS_N - 4000, why, sizeof why), "%s", why);
    ctl_send("read", 0);
    char c[3];
    n = rd_full(fd, c, 3);
    CHECK("cork_data", n == 3 && !memcmp(c, "xyz", 3), "read %zd errno=%d", n, errno);
    /* TS_SEGS messages sent apart, each at least one segment: the counters say so */
    uint32_t s0[4], s1[4];
    int sr = tcp_segs_of(fd, s0);
    ctl_send("segs", 0);
    CHECK("segs_data", recv_pat(fd, 92, 0, TS_SEGS * 10, why, sizeof why), "%s", why);
    sr |= tcp_segs_of(fd, s1);
    CHECK("tcp_info_segs_in", sr == 0 && s1[1] - s0[1] >= TS_SEGS && s1[2] - s0[2] >= TS_SEGS,
          "segs_in +%u, data_segs_in +%u for %d messages", s1[1] - s0[1], s1[2] - s0[2], TS_SEGS);
    ctl_need("done", NULL);
    close(fd);
}

static void tcpstate_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    struct sockaddr_in a;
    socklen_t al = sizeof a;
    if (getsockname(fd, (struct sockaddr *)&a, &al) < 0) die("getsockname");
    ctl_send("port", ntohs(a.sin_port));
    CHECK("tcpstate_send", send_pat(fd, 91, 0, TS_N), "errno=%d", errno);
    ctl_need("read", NULL);
    /* everything was read: nothing waits for an acknowledgement any more */
    long long end = now_ms() + WAIT_MS;
    int q = -1;
    while (now_ms() < end && (ioctl(fd, SIOCOUTQ, &q) < 0 || q != 0)) sleep_ms(2);
    CHECK("siocoutq_drained", q == 0, "SIOCOUTQ %d", q);
    struct tcp_info ti;
    uint64_t acked = 0, received = 0;
    int r = tcp_info_of(fd, &ti, &acked, &received);
    CHECK("tcp_info_bytes_acked", r == 0 && acked == TS_N + 3, "bytes_acked %llu want %d",
          (unsigned long long)acked, TS_N + 3);        /* Linux counts the SYN as an acknowledged byte */
    int one = 1, v = 0;
    socklen_t vl = sizeof v;
    CHECK("tcp_cork_set", setsockopt(fd, IPPROTO_TCP, TCP_CORK, &one, sizeof one) == 0 &&
          getsockopt(fd, IPPROTO_TCP, TCP_CORK, &v, &vl) == 0 && v == 1, "v=%d errno=%d", v, errno);
    ssize_t n = send(fd, "xy", 2, MSG_MORE);
    n += send(fd, "z", 1, 0);
    int zero = 0;
    CHECK("tcp_cork_clear", n == 3 && setsockopt(fd, IPPROTO_TCP, TCP_CORK, &zero, sizeof zero) == 0 &&
          getsockopt(fd, IPPROTO_TCP, TCP_CORK, &v, &vl) == 0 && v == 0, "sent %zd v=%d errno=%d", n, v, errno);
    ctl_need("segs", NULL);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    uint32_t s0[4], s1[4];
    int sr = tcp_segs_of(fd, s0);
    for (int i = 0; i < TS_SEGS; i++) {
        if (!send_pat(fd, 92, (size_t)i * 10, 10)) break;
        sleep_ms(2);
    }
    sr |= tcp_segs_of(fd, s1);
    CHECK("tcp_info_segs_out", sr == 0 && s1[0] - s0[0] >= TS_SEGS && s1[3] - s0[3] >= TS_SEGS,
          "segs_out +%u, data_segs_out +%u for %d messages", s1[0] - s0[0], s1[3] - s0[3], TS_SEGS);
    ctl_send("done", 0);
    close(fd);
}

/* ---- tstamp: SO_TIMESTAMPING, receive (software) and transmit (on the error queue) -- */
static int stamps_in(struct msghdr *m, struct timespec ts[3])
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPING) {
            memcpy(ts, CMSG_DATA(c), 3 * sizeof ts[0]);
            return 1;
        }
    return 0;
}

static int near_now(const struct timespec *t)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    long long d = (long long)now.tv_sec - (long long)t->tv_sec;
    return t->tv_sec && d >= 0 && d < 10;
}

static void tstamp_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    int v = SOF_TIMESTAMPING_RX_SOFTWARE | SOF_TIMESTAMPING_SOFTWARE;
    CHECK("rx_timestamping_set", setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPING, &v, sizeof v) == 0, "errno=%d", errno);
    sleep_ms(50);                  /* the kernel turns receive stamps on asynchronously */
    ctl_send("armed", 0);
    char buf[8] = { 0 };
    union { char b[256]; struct cmsghdr align; } ctl;
    struct iovec iov = { buf, 3 };
    struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b };
    ssize_t r = recvmsg(fd, &m, MSG_WAITALL);
    struct timespec ts[3] = { { 0, 0 } };
    int got = r == 3 && stamps_in(&m, ts);
    CHECK("rx_timestamping", got && !memcmp(buf, "abc", 3) && near_now(&ts[0]) && !ts[2].tv_sec && !ts[2].tv_nsec,
          "recvmsg %zd, stamp %d: software %lld.%09ld hardware %lld.%09ld", r, got, (long long)ts[0].tv_sec,
          ts[0].tv_nsec, (long long)ts[2].tv_sec, ts[2].tv_nsec);
    char why[200];
    CHECK("data_after_tx_timestamps", recv_pat(fd, 93, 0, 100000, why, sizeof why), "%s", why);
    ctl_need("done", NULL);
    close(fd);
}

static void tstamp_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    int v = SOF_TIMESTAMPING_TX_SOFTWARE | SOF_TIMESTAMPING_SOFTWARE | SOF_TIMESTAMPING_OPT_ID;
    CHECK("tx_timestamping_set", setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPING, &v, sizeof v) == 0, "errno=%d", errno);
    ctl_need("armed", NULL);
    ssize_t n = send(fd, "abc", 3, 0);
    /* the stamp of those bytes comes on the error queue */
    struct timespec ts[3] = { { 0, 0 } };
    int got = 0;
    long long end = now_ms() + WAIT_MS;
    while (!got && now_ms() < end) {
        char data[256];
        union { char b[512]; struct cmsghdr align; } ctl;
        struct iovec iov = { data, sizeof data };
        struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b };
        if (recvmsg(fd, &m, MSG_ERRQUEUE | MSG_DONTWAIT) >= 0) got = stamps_in(&m, ts);
        else sleep_ms(5);
    }
    CHECK("tx_timestamp_on_error_queue", n == 3 && got && near_now(&ts[0]), "send %zd, stamp %d at %lld.%09ld",
          n, got, (long long)ts[0].tv_sec, ts[0].tv_nsec);
    CHECK("tx_timestamps_send", send_pat(fd, 93, 0, 100000), "errno=%d", errno);
    ctl_send("done", 0);
    close(fd);
}

/* ---- sigio: O_ASYNC + F_SETOWN; a program that reads until EAGAIN on each SIGIO sees
 * every message (it waits for nothing but the signal) --------------------------------- */
#define SIGIO_ROUNDS 3
static void sigio_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    sigset_t io, old;
    sigemptyset(&io);
    sigaddset(&io, SIGIO);
    sigprocmask(SIG_BLOCK, &io, &old);             /* taken with sigtimedwait */
    int fl = fcntl(fd, F_GETFL);
    CHECK("o_async_set", fcntl(fd, F_SETOWN, getpid()) == 0 && fcntl(fd, F_SETFL, fl | O_ASYNC | O_NONBLOCK) == 0 &&
          (fcntl(fd, F_GETFL) & O_ASYNC) && fcntl(fd, F_GETOWN) == getpid(), "errno=%d", errno);
    char buf[64];
    while (read(fd, buf, sizeof buf) > 0) { }
    struct timespec zero = { 0, 0 };
    while (sigtimedwait(&io, NULL, &zero) > 0) { }
    int ok = 1;
    for (int i = 0; i < SIGIO_ROUNDS && ok; i++) {
        char want[8];
        snprintf(want, sizeof want, "m%d", i);
        ctl_send("ready", (unsigned long long)i);
        size_t got = 0;
        long long end = now_ms() + WAIT_MS;
        while (got < 2 && now_ms() < end) {
            long long left = end - now_ms();
            struct timespec ts = { left / 1000, (left % 1000) * 1000000L };
            if (sigtimedwait(&io, NULL, &ts) != SIGIO) continue;
            ssize_t r;
            while ((r = read(fd, buf + got, sizeof buf - got)) > 0) got += (size_t)r;
        }
        ok = got == 2 && !memcmp(buf, want, 2);
        if (!ok) report(0, "sigio_each_message", "round %d: %zu bytes after waiting for SIGIO", i, got);
    }
    if (ok) report(1, "sigio_each_message", NULL);
    /* The kernel raises SIGIO for each arrival, read or not: three messages 30 ms apart,
     * none read until all three signals came. */
    ctl_send("burst", 0);
    int sigs = 0;
    long long end = now_ms() + WAIT_MS;
    while (sigs < SIGIO_ROUNDS && now_ms() < end) {
        long long left = end - now_ms();
        struct timespec ts = { left / 1000, (left % 1000) * 1000000L };
        if (sigtimedwait(&io, NULL, &ts) == SIGIO) sigs++;
    }
    size_t got = 0;
    ssize_t r;
    end = now_ms() + WAIT_MS;
    while (got < 2 * SIGIO_ROUNDS && now_ms() < end)
        if ((r = read(fd, buf + got, sizeof buf - got)) > 0) got += (size_t)r; else sleep_ms(5);
    CHECK("sigio_each_arrival_unread", sigs == SIGIO_ROUNDS && got == 2 * SIGIO_ROUNDS && !memcmp(buf, "b0b1b2", 6),
          "%d SIGIO for %d messages left unread, then %zu bytes", sigs, SIGIO_ROUNDS, got);
    fcntl(fd, F_SETFL, fl);
    sigprocmask(SIG_SETMASK, &old, NULL);
    ctl_send("done", 0);
    close(fd);
}

static void sigio_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    for (int i = 0; i < SIGIO_ROUNDS; i++) {
        unsigned long long v;
        if (ctl_wait("ready", &v, WAIT_MS + 1000) < 0) break;
        char m[8];
        snprintf(m, sizeof m, "m%d", (int)v);
        sleep_ms(20);
        if (wr_all(fd, m, 2) != 2) break;
    }
    if (ctl_wait("burst", NULL, WAIT_MS + 1000) == 0)
        for (int i = 0; i < SIGIO_ROUNDS; i++) {
            char m[3] = { 'b', (char)('0' + i), 0 };
            sleep_ms(30);
            if (wr_all(fd, m, 2) != 2) break;
        }
    ctl_need("done", NULL);
    close(fd);
}

/* ---- vecio: recvmmsg/sendmmsg, preadv2/pwritev2 at offset -1, splice both ways ------- */
#define SPL_IN 20000
#define SPL_OUT 30000
static void vecio_server(void)
{
    int fd = server_accept_warm();
    if (fd < 0) return;
    ctl_need("mmsg", NULL);
    int last = 0;
    wait_fionread(fd, 10, &last);
    char a[5], b[5];
    struct iovec iv[2] = { { a, 5 }, { b, 5 } };
    struct mmsghdr v[2];
    memset(v, 0, sizeof v);
    v[0].msg_hdr.msg_iov = &iv[0]; v[0].msg_hdr.msg_iovlen = 1;
    v[1].msg_hdr.msg_iov = &iv[1]; v[1].msg_hdr.msg_iovlen = 1;
    int n = recvmmsg(fd, v, 2, MSG_WAITFORONE, NULL);
    CHECK("recvmmsg", n == 2 && v[0].msg_len == 5 && v[1].msg_len == 5 && !memcmp(a, "hello", 5) && !memcmp(b, "world", 5),
          "returned %d errno=%d lens %u %u", n, errno, v[0].msg_len, v[1].msg_len);
    ctl_send("pwv", 0);
    ctl_need("pwv_sent", NULL);
    char x[3], y[3];
    struct iovec rv[2] = { { x, 3 }, { y, 3 } };
    errno = 0;
    ssize_t r = preadv2(fd, rv, 2, 0, 0);
    CHECK("preadv2_offset_espipe", r < 0 && errno == ESPIPE, "returned %zd errno=%d", r, errno);
    wait_fionread(fd, 6, &last);
    r = preadv2(fd, rv, 2, -1, 0);
    CHECK("preadv2_socket", r == 6 && !memcmp(x, "abc", 3) && !memcmp(y, "def", 3), "returned %zd errno=%d", r, errno);
    char anc[4];
    CHECK("sendmsg_ancillary_data", rd_full(fd, anc, 4) == 4 && !memcmp(anc, "anc!", 4), "errno=%d", errno);
    /* receive-side ancillary data: SO_TIMESTAMPNS and TCP_INQ.  The kernel switches
     * receive timestamps on asynchronously (a deferred static key): give it a moment
     * before the bytes come, or a plain socket's first packets may carry none. */
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_INQ, &one, sizeof one);
    sleep_ms(50);
    ctl_send("ts", 0);
    wait_fionread(fd, 10, &last);
    char tsd[10];
    union { struct cmsghdr h; char buf[256]; } rc;
    struct iovec tv4 = { tsd, 4 };
    struct msghdr rm = { .msg_iov = &tv4, .msg_iovlen = 1, .msg_control = rc.buf, .msg_controllen = sizeof rc.buf };
    r = recvmsg(fd, &rm, 0);
    struct timespec now, *got_ts = NULL;
    int inq = -1;
    clock_gettime(CLOCK_REALTIME, &now);
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&rm); c; c = CMSG_NXTHDR(&rm, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) got_ts = (struct timespec *)CMSG_DATA(c);
        if (c->cmsg_level == IPPROTO_TCP && c->cmsg_type == TCP_CM_INQ) memcpy(&inq, CMSG_DATA(c), sizeof inq);
    }
    long long age = got_ts ? (long long)(now.tv_sec - got_ts->tv_sec) : -1;
    CHECK("recvmsg_timestamp_inq", r == 4 && !memcmp(tsd, "0123", 4) && got_ts && age >= 0 && age < 5 && inq == 6 &&
          !(rm.msg_flags & MSG_CTRUNC), "r=%zd timestamp %s (age %lld s) inq %d flags 0x%x", r, got_ts ? "yes" : "no", age,
          inq, rm.msg_flags);
    CHECK("recvmsg_after_ancillary", rd_full(fd, tsd, 6) == 6 && !memcmp(tsd, "456789", 6), "errno=%d", errno);
    int zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &zero, sizeof zero);
    setsockopt(fd, IPPROTO_TCP, TCP_INQ, &zero, sizeof zero);
    ctl_send("spl", 0);
    /* splice socket -> pipe, then read the pipe */
    int pp[2];
    if (pipe(pp) < 0) die("pipe");
    uint8_t *got = malloc(SPL_IN);
    size_t have = 0;
    long long end = now_ms() + WAIT_MS;
    while (have < SPL_IN && now_ms() < end) {
        r = splice(fd, NULL, pp[1], NULL, SPL_IN - have, have & 1 ? SPLICE_F_NONBLOCK : 0);
        if (r < 0 && errno == EAGAIN) { sleep_ms(1); continue; }
        if (r <= 0) break;
        ssize_t k = rd_full(pp[0], got + have, (size_t)r);
        if (k != r) break;
        have += (size_t)r;
    }
    CHECK("splice_from_socket", have == SPL_IN && mismatch(got, SPL_IN, 71, 0) < 0, "spliced %zu of %d, errno=%d",
          have, SPL_IN, errno);
    free(got);
    close(pp[0]);
    close(pp[1]);
    char why[200];
    CHECK("splice_into_socket_data", recv_pat(fd, 72, 0, SPL_OUT, why, sizeof why), "%s", why);
    CHECK("write_after_splice", wr_all(fd, "ok", 2) == 2, "errno=%d", errno);
    char c;
    CHECK("eof_after_splice", rd_full(fd, &c, 1) == 0, "errno=%d", errno);
    close(fd);
}

static void vecio_client(void)
{
    int fd = client_connect_warm();
    if (fd < 0) return;
    struct iovec iv[2] = { { "hello", 5 }, { "world", 5 } };
    struct mmsghdr v[2];
    memset(v, 0, sizeof v);
    v[0].msg_hdr.msg_iov = &iv[0]; v[0].msg_hdr.msg_iovlen = 1;
    v[1].msg_hdr.msg_iov = &iv[1]; v[1].msg_hdr.msg_iovlen = 1;
    int n = sendmmsg(fd, v, 2, 0);
    CHECK("sendmmsg", n == 2 && v[0].msg_len == 5 && v[1].msg_len == 5, "returned %d errno=%d", n, errno);
    ctl_send("mmsg", 0);
    ctl_need("pwv", NULL);
    struct iovec wv[2] = { { "abc", 3 }, { "def", 3 } };
    ssize_t r = pwritev2(fd, wv, 2, -1, 0);
    CHECK("pwritev2_socket", r == 6, "returned %zd errno=%d", r, errno);
    ctl_send("pwv_sent", 0);
    /* ancillary data on a TCP socket: the kernel takes it and has no use for it */
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } cm;
    memset(&cm, 0, sizeof cm);
    cm.h.cmsg_level = SOL_SOCKET;
    cm.h.cmsg_type = SCM_RIGHTS;
    cm.h.cmsg_len = CMSG_LEN(sizeof(int));
    int zero_fd = 0;
    memcpy(CMSG_DATA(&cm.h), &zero_fd, sizeof zero_fd);
    struct iovec av = { "anc!", 4 };
    struct msghdr am = { .msg_iov = &av, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof cm.buf };
    r = sendmsg(fd, &am, 0);
    CHECK("sendmsg_ancillary", r == 4, "returned %zd errno=%d", r, errno);
    ctl_need("ts", NULL);
    CHECK("send_for_timestamp", wr_all(fd, "0123456789", 10) == 10, "errno=%d", errno);
    ctl_need("spl", NULL);
    CHECK("send_for_splice", send_pat(fd, 71, 0, SPL_IN), "errno=%d", errno);
    /* pipe -> splice -> socket */
    int pp[2];
    if (pipe(pp) < 0) die("pipe");
    uint8_t *b = malloc(SPL_OUT);
    fill(b, SPL_OUT, 72, 0);
    size_t done = 0;
    int ok = 1;
    while (done < SPL_OUT && ok) {
        size_t chunk = SPL_OUT - done < 8192 ? SPL_OUT - done : 8192;
        ok = wr_all(pp[1], b + done, chunk) == (ssize_t)chunk;
        size_t moved = 0;
        while (ok && moved < chunk) {
            r = splice(pp[0], NULL, fd, NULL, chunk - moved, 0);
            if (r <= 0) ok = 0;
            else moved += (size_t)r;
        }
        done += moved;
    }
    CHECK("splice_into_socket", ok && done == SPL_OUT, "spliced %zu errno=%d", done, errno);
    free(b);
    close(pp[0]);
    close(pp[1]);
    char in[2];
    r = rd_full(fd, in, 2);
    CHECK("read_after_splice", r == 2 && !memcmp(in, "ok", 2), "read %zd errno=%d", r, errno);
    close(fd);
}

/* ---- banner: a server that speaks first and closes without reading (an FTP or SMTP
 * server refusing a client); the client connected non-blocking and reads the banner and
 * EOF: nothing it did not write can earn it a reset -------------------------------- */
#define BANNER_ROUNDS 5
static void banner_server(void)
{
    int ok = 1;
    for (int i = 0; i < BANNER_ROUNDS && ok; i++) {
        int fd = server_accept(ACC_PLAIN);
        if (fd < 0) return;
        ok = wr_all(fd, "421 busy\r\n", 10) == 10 && shutdown(fd, SHUT_WR) == 0;
        close(fd);
        ctl_send("closed", (unsigned long long)i);
    }
    CHECK("banner_written_closed", ok, "errno=%d", errno);
}

static void banner_client(void)
{
    int ok = 1;
    char why[160] = "";
    for (int i = 0; i < BANNER_ROUNDS && ok; i++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        struct sockaddr_in a = server_addr();
        int r = connect(fd, (struct sockaddr *)&a, sizeof a);
        if (r < 0 && errno != EINPROGRESS) die("banner connect");
        struct pollfd p = { fd, POLLOUT, 0 };
        poll(&p, 1, WAIT_MS);
        announce(fd);
        ctl_need("closed", NULL);                 /* the server closed before we took its answer */
        p.events = POLLIN;
        poll(&p, 1, WAIT_MS);
        sleep_ms(20);                             /* whatever that provoked has come back */
        int err = -1;
        socklen_t el = sizeof err;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        set_nonblock(fd, 0);
        char buf[32];
        ssize_t n = rd_full(fd, buf, 10);
        int e = errno;
        ssize_t end = n == 10 ? read(fd, buf, sizeof buf) : -2;
        if (err != 0 || n != 10 || memcmp(buf, "421 busy\r\n", 10) || end != 0) {
            snprintf(why, sizeof why, "round %d: SO_ERROR %d, banner read %zd errno=%d, then %zd errno=%d", i, err, n, e,
                     end, errno);
            ok = 0;
        }
        close(fd);
    }
    CHECK("banner_then_eof", ok, "%s", why);
}

/* ---- refused: SO_ERROR after a non-blocking connect to a port nobody listens on ------ */
static void refused_server(void) { }

static void refused_client(void)
{
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = server_addr();
    a.sin_port = 0;
    socklen_t al = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) < 0 || getsockname(l, (struct sockaddr *)&a, &al) < 0)
        die("refused bind");
    close(l);                                      /* a port known to have no listener */
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int r = connect(fd, (struct sockaddr *)&a, sizeof a);
    int e = errno;
    if (r < 0 && e == EINPROGRESS) {
        struct pollfd p = { fd, POLLOUT, 0 };
        poll(&p, 1, WAIT_MS);
        int err = 0;
        socklen_t el = sizeof err;
        r = getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        CHECK("so_error_refused", r == 0 && err == ECONNREFUSED, "getsockopt %d SO_ERROR %d", r, err);
        el = sizeof err;
        r = getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
        CHECK("so_error_cleared", r == 0 && err == 0, "second SO_ERROR %d", err);
    } else {
        CHECK("so_error_refused", r < 0 && e == ECONNREFUSED, "connect returned %d errno=%d", r, e);
        CHECK("so_error_cleared", 1, NULL);
    }
    close(fd);
}

/* ======================================================================================== */

struct test {
    const char *name;
    void (*server)(void);
    void (*client)(void);
};

static const struct test tests[] = {
    { "basic", basic_server, basic_client },
    { "nonblock", nonblock_server, nonblock_client },
    { "iov", iov_server, iov_client },
    { "flags", flags_server, flags_client },
    { "fresh", fresh_server, fresh_client },
    { "preamble", preamble_server, preamble_client },
    { "unused", unused_server, unused_client },
    { "sigpipe", sigpipe_server, sigpipe_client },
    { "sendfile", sendfile_server, sendfile_client },
    { "dup", dup_server, dup_client },
    { "fdreuse", fdreuse_server, fdreuse_client },
    { "rawclose", rawclose_server, rawclose_client },
    { "shut_c", shut_c_server, shut_c_client },
    { "shut_s", shut_s_server, shut_s_client },
    { "pollfam", pollfam_server, pollfam_client },
    { "epoll_lt", epoll_lt_server, epoll_lt_client },
    { "epoll_et", epoll_et_server, epoll_et_client },
    { "epoll_oneshot", epoll_oneshot_server, epoll_oneshot_client },
    { "epoll_early", epoll_early_server, epoll_early_client },
    { "epoll_rdhup", epoll_rdhup_server, epoll_rdhup_client },
    { "ringfull", ringfull_server, ringfull_client },
    { "pollwriter", pollwriter_server, pollwriter_client },
    { "chk", chk_server, chk_client },
    { "fork", fork_server, fork_client },
    { "exec", exec_server, exec_client },
    { "signals", signals_server, signals_client },
    { "sendsig", sendsig_server, sendsig_client },
    { "pollsig", pollsig_server, pollsig_client },
    { "tstamp", tstamp_server, tstamp_client },
    { "timeo_fresh", timeo_fresh_server, timeo_fresh_client },
    { "reset", reset_server, reset_client },
    { "urgent", urgent_server, urgent_client },
    { "tcpstate", tcpstate_server, tcpstate_client },
    { "refused", refused_server, refused_client },
    { "sigio", sigio_server, sigio_client },
    { "vecio", vecio_server, vecio_client },
    { "banner", banner_server, banner_client },
};
#define NTESTS ((int)(sizeof tests / sizeof tests[0]))

static void on_alarm(int s)
{
    (void)s;
    if (g_in_test) siglongjmp(g_jmp, 1);
    _exit(3);
}

static int selected(const char *name, int argc, char **argv, int first)
{
    if (first >= argc) return 1;
    for (int i = first; i < argc; i++)
        if (!strcmp(argv[i], name)) return 1;
    return 0;
}

static void run_tests(int argc, char **argv, int first)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;              /* no SA_RESTART: a hung call returns EINTR or jumps */
    sigaction(SIGALRM, &sa, NULL);
    for (volatile int i = 0; i < NTESTS; i++) {
        if (!selected(tests[i].name, argc, argv, first)) continue;
        g_idx = i;
        g_test = tests[i].name;
        ctl_send("begin", 0);
        ctl_need("begin", NULL);
        printf("begin %s\n", g_test);
        fflush(stdout);
        long long t0 = now_ms();
        int j = sigsetjmp(g_jmp, 1);
        if (j == 0) {
            g_in_test = 1;
            alarm(WATCHDOG_S);
            (is_server ? tests[i].server : tests[i].client)();
            alarm(0);
            g_in_test = 0;
        } else {
            alarm(0);
            g_in_test = 0;
            char name[80];
            snprintf(name, sizeof name, "test_%s_%s", g_test, j == 1 ? "timeout" : "desync");
            report(0, name, "%s side gave up after %lld ms", is_server ? "server" : "client", now_ms() - t0);
        }
        printf("end %s %lld ms\n", g_test, now_ms() - t0);
        fflush(stdout);
        ctl_send("end", 0);
        if (ctl_wait("end", NULL, (WATCHDOG_S + 3) * 1000) < 0) {
            report(0, "ctl_sync", "no 'end' of test %s from the peer", g_test);
            break;
        }
    }
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "execcheck")) return execcheck_main();
    if (argc >= 3 && !strcmp(argv[1], "server")) {
        is_server = 1;
        int u = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un ua;
        memset(&ua, 0, sizeof ua);
        ua.sun_family = AF_UNIX;
        snprintf(ua.sun_path, sizeof ua.sun_path, "%s", argv[2]);
        unlink(argv[2]);
        if (u < 0 || bind(u, (struct sockaddr *)&ua, sizeof ua) < 0 || listen(u, 1) < 0) die("ctl listen");
        lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        int one = 1;
        setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        struct sockaddr_in a = server_addr();
        a.sin_port = 0;
        socklen_t al = sizeof a;
        if (bind(lfd, (struct sockaddr *)&a, sizeof a) < 0 || listen(lfd, 64) < 0 ||
            getsockname(lfd, (struct sockaddr *)&a, &al) < 0)
            die("listen");
        g_port = ntohs(a.sin_port);
        printf("port %d\n", g_port);
        fflush(stdout);
        alarm(20);                              /* the client must come */
        ctl = accept4(u, NULL, NULL, SOCK_CLOEXEC);
        alarm(0);
        if (ctl < 0) die("ctl accept");
        close(u);
        run_tests(argc, argv, 3);
    } else if (argc >= 5 && !strcmp(argv[1], "client")) {
        g_port = atoi(argv[2]);
        g_tmpdir = argv[4];
        ctl = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un ua;
        memset(&ua, 0, sizeof ua);
        ua.sun_family = AF_UNIX;
        snprintf(ua.sun_path, sizeof ua.sun_path, "%s", argv[3]);
        if (ctl < 0 || connect(ctl, (struct sockaddr *)&ua, sizeof ua) < 0) die("ctl connect");
        run_tests(argc, argv, 5);
    } else {
        fprintf(stderr, "usage: %s server CTLPATH [TEST...] | client PORT CTLPATH TMPDIR [TEST...] | execcheck\n",
                argv[0]);
        return 2;
    }
    printf("summary %s failures=%d\n", is_server ? "server" : "client", g_failures);
    fflush(stdout);
    return g_failures ? 1 : 0;
}
