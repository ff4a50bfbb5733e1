/* threads.c - racing threads on upgraded sockets (issue 15, point 2), run under the preload
 * library (plain, ASan and TSan builds; tests/test_threads.py).
 *
 *   threads SCENARIO
 *
 * Each scenario makes its own connected pairs inside this one process (both ends under
 * the library, so they upgrade to shm), races calls in threads, and checks that the
 * outcome is what the kernel gives for TCP.  Prints "ok SCENARIO [detail]" or "FAIL
 * SCENARIO detail"; a watchdog ends a stuck run with "FAIL SCENARIO hung".
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef RS_DIRECT
/* ThreadSanitizer build: the program's socket calls go straight to the preload library's
 * hooks, past TSan's interceptors.  TSan would otherwise report the races this program
 * makes on purpose (a close racing a recv on one descriptor), which the kernel permits;
 * what is checked is the library's own memory, which TSan instruments. */
#include <dlfcn.h>
#include <link.h>
static struct {
    int (*socket)(int, int, int); int (*connect)(int, const struct sockaddr *, socklen_t);
    int (*accept)(int, struct sockaddr *, socklen_t *); int (*listen)(int, int);
    ssize_t (*read)(int, void *, size_t); ssize_t (*write)(int, const void *, size_t);
    ssize_t (*send)(int, const void *, size_t, int); ssize_t (*recv)(int, void *, size_t, int);
    int (*close)(int); int (*shutdown)(int, int); int (*dup)(int); int (*dup2)(int, int);
    int (*dup3)(int, int, int); int (*poll)(struct pollfd *, nfds_t, int);
    int (*epoll_ctl)(int, int, int, struct epoll_event *); int (*epoll_wait)(int, struct epoll_event *, int, int);
} h;
static char libpath[4096];
static int find_lib(struct dl_phdr_info *i, size_t n, void *a)
{
    (void)n; (void)a;
    if (i->dlpi_name && strstr(i->dlpi_name, "librdmasock.so")) { snprintf(libpath, sizeof libpath, "%s", i->dlpi_name); return 1; }
    return 0;
}
static void direct_init(void)
{
    dl_iterate_phdr(find_lib, NULL);
    void *lib = libpath[0] ? dlopen(libpath, RTLD_NOW | RTLD_NOLOAD) : NULL;
    if (!lib) { printf("FAIL setup librdmasock.so is not loaded\n"); exit(1); }
#define H(n) *(void **)&h.n = dlsym(lib, #n)
    H(socket); H(connect); H(accept); H(listen); H(read); H(write); H(send); H(recv); H(close); H(shutdown);
    H(dup); H(dup2); H(dup3); H(poll); H(epoll_ctl); H(epoll_wait);
#undef H
    if (!h.socket) h.socket = socket;                    /* not interposed: libc's */
}
#define socket(...) h.socket(__VA_ARGS__)
#define connect(...) h.connect(__VA_ARGS__)
#define accept(...) h.accept(__VA_ARGS__)
#define listen(...) h.listen(__VA_ARGS__)
#define read(...) h.read(__VA_ARGS__)
#define write(...) h.write(__VA_ARGS__)
#define send(...) h.send(__VA_ARGS__)
#define recv(...) h.recv(__VA_ARGS__)
#define close(...) h.close(__VA_ARGS__)
#define shutdown(...) h.shutdown(__VA_ARGS__)
#define dup(...) h.dup(__VA_ARGS__)
#define dup2(...) h.dup2(__VA_ARGS__)
#define dup3(...) h.dup3(__VA_ARGS__)
#define poll(...) h.poll(__VA_ARGS__)
#define epoll_ctl(...) h.epoll_ctl(__VA_ARGS__)
#define epoll_wait(...) h.epoll_wait(__VA_ARGS__)
#else
static void direct_init(void) {}
#endif

static const char *scenario = "?";
static int lfd = -1;

static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL %s ", scenario);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    _exit(1);
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) && errno == EINTR) {}
}

static void on_alarm(int sig) { (void)sig; printf("FAIL %s hung\n", scenario); fflush(stdout); _exit(3); }

static void listen_once(void)
{
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    lfd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 64)) fail("listen: %s", strerror(errno));
}

/* A connected pair: *c (client end) and *s (server end). */
static void pair(int *c, int *s)
{
    struct sockaddr_in a;
    socklen_t l = sizeof a;
    getsockname(lfd, (struct sockaddr *)&a, &l);
    *c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(*c, (struct sockaddr *)&a, sizeof a)) fail("connect: %s", strerror(errno));
    *s = accept(lfd, NULL, NULL);
    if (*s < 0) fail("accept: %s", strerror(errno));
    /* one exchange each way settles the handshake on both ends */
    char b;
    if (write(*c, "x", 1) != 1 || read(*s, &b, 1) != 1 || write(*s, "y", 1) != 1 || read(*c, &b, 1) != 1)
        fail("first exchange: %s", strerror(errno));
}

static ssize_t read_full(int fd, void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)buf + got, n - got);
        if (r <= 0) return r < 0 ? r : (ssize_t)got;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* ---- close / shutdown racing a blocked call ------------------------------------------- */

struct blocked { int fd; ssize_t r; int err; long long t_end; char buf[64]; };

static void *do_recv(void *p)
{
    struct blocked *b = p;
    b->r = recv(b->fd, b->buf, sizeof b->buf, 0);
    b->err = errno;
    b->t_end = now_ms();
    return NULL;
}

/* close() while another thread is blocked in recv(): as with TCP, the recv goes on with
 * the socket and returns the data that comes later. */
static void close_vs_recv(void)
{
    int c, s;
    pair(&c, &s);
    struct blocked b = { .fd = s };
    pthread_t t;
    pthread_create(&t, NULL, do_recv, &b);
    sleep_ms(100);
    close(s);
    int reuse = socket(AF_INET, SOCK_STREAM, 0);       /* very likely the number just freed */
    sleep_ms(50);
    if (write(c, "hello", 5) != 5) fail("write: %s", strerror(errno));
    pthread_join(t, NULL);
    if (b.r != 5 || memcmp(b.buf, "hello", 5)) fail("recv after close returned %zd (%s)", b.r, strerror(b.err));
    char x;
    ssize_t r = read(c, &x, 1);                          /* the socket ended with that call */
    if (r != 0) fail("peer read %zd (%s) after the last user of the socket finished", r, strerror(errno));
    close(reuse);
    close(c);
    printf("ok %s\n", scenario);
}

/* shutdown(SHUT_RDWR) wakes a recv() blocked in another thread at once, with 0. */
static void shutdown_wakes_recv(void)
{
    int c, s;
    pair(&c, &s);
    struct blocked b = { .fd = s };
    pthread_t t;
    pthread_create(&t, NULL, do_recv, &b);
    sleep_ms(100);
    long long t0 = now_ms();
    shutdown(s, SHUT_RDWR);
    pthread_join(t, NULL);
    if (b.r != 0) fail("recv returned %zd (%s)", b.r, strerror(b.err));
    if (b.t_end - t0 > 100) fail("recv woke %lld ms after shutdown", b.t_end - t0);
    char x;
    if (read(c, &x, 1) != 0) fail("peer did not see the end of stream");
    close(s);
    close(c);
    printf("ok %s %lld ms\n", scenario, b.t_end - t0);
}

struct sender { int fd; size_t total; int err; ssize_t last; };

static void *do_send_lots(void *p)
{
    struct sender *sd = p;
    static char chunk[65536];
    memset(chunk, 'z', sizeof chunk);
    for (int i = 0; i < 64; i++) {
        ssize_t r = send(sd->fd, chunk, sizeof chunk, MSG_NOSIGNAL);
        sd->last = r;
        if (r < 0) { sd->err = errno; break; }
        sd->total += (size_t)r;
    }
    return NULL;
}

/* close() while another thread is blocked in send() on a full ring: that send goes on,
 * the next one on the closed number fails with EBADF (as with TCP), and the peer reads
 * every byte the sender counted as sent, then the end of the stream. */
static void close_vs_send(void)
{
    int c, s;
    pair(&c, &s);
    struct sender sd = { .fd = c };
    pthread_t t;
    pthread_create(&t, NULL, do_send_lots, &sd);
    sleep_ms(150);                                       /* the ring fills, send blocks */
    close(c);
    static char buf[1 << 16];
    size_t got = 0;
    for (;;) {
        ssize_t r = read(s, buf, sizeof buf);
        if (r < 0) fail("read: %s", strerror(errno));
        if (r == 0) break;
        for (ssize_t i = 0; i < r; i++) if (buf[i] != 'z') fail("byte %zu is %02x", got + (size_t)i, buf[i]);
        got += (size_t)r;
    }
    pthread_join(t, NULL);
    if (sd.err != EBADF || got != sd.total)
        fail("sent %zu (then %s), received %zu", sd.total, strerror(sd.err), got);
    close(s);
    printf("ok %s\n", scenario);
}

struct waiter { int fd, ep; int r; int err; };

static void *do_poll(void *p)
{
    struct waiter *w = p;
    struct pollfd pf = { .fd = w->fd, .events = POLLIN };
    w->r = poll(&pf, 1, 1500);
    w->err = errno;
    return NULL;
}

static void *do_epoll_wait(void *p)
{
    struct waiter *w = p;
    struct epoll_event ev[4];
    w->r = epoll_wait(w->ep, ev, 4, 1500);
    w->err = errno;
    return NULL;
}

/* close() while another thread waits in poll() / epoll_wait() on the socket. */
static void close_vs_wait(void)
{
    for (int kind = 0; kind < 2; kind++) {
        int c, s;
        pair(&c, &s);
        struct waiter w = { .fd = s, .ep = epoll_create1(0) };
        struct epoll_event ev = { .events = EPOLLIN, .data.fd = s };
        epoll_ctl(w.ep, EPOLL_CTL_ADD, s, &ev);
        pthread_t t;
        pthread_create(&t, NULL, kind ? do_epoll_wait : do_poll, &w);
        sleep_ms(100);
        close(s);
        pthread_join(t, NULL);
        if (w.r < 0 && w.err != EINTR) fail("%s returned %d (%s)", kind ? "epoll_wait" : "poll", w.r, strerror(w.err));
        close(w.ep);
        close(c);
    }
    printf("ok %s\n", scenario);
}

/* ---- epoll_ctl racing epoll_wait ------------------------------------------------------ */

#define NPAIRS 8
static int ep_c[NPAIRS], ep_s[NPAIRS], ep_fd;   /* ep_fd: atomic (replaced while in use) */
static int ep_stop;

static void *ep_waiter(void *p)
{
    (void)p;
    struct epoll_event ev[16];
    char buf[256];
    while (!__atomic_load_n(&ep_stop, __ATOMIC_ACQUIRE)) {
        int n = epoll_wait(__atomic_load_n(&ep_fd, __ATOMIC_ACQUIRE), ev, 16, 5);
        for (int i = 0; i < n; i++) {
            ssize_t r = recv(ev[i].data.fd, buf, sizeof buf, MSG_DONTWAIT);
            (void)r;
        }
    }
    return NULL;
}

static void *ep_writer(void *p)
{
    (void)p;
    for (int i = 0; !__atomic_load_n(&ep_stop, __ATOMIC_ACQUIRE); i++) {
        ssize_t r = send(ep_c[i % NPAIRS], "ping", 4, MSG_DONTWAIT | MSG_NOSIGNAL);
        (void)r;
        if (i % 64 == 0) sleep_ms(1);
    }
    return NULL;
}

static void epoll_ctl_vs_wait(void)
{
    for (int i = 0; i < NPAIRS; i++) pair(&ep_c[i], &ep_s[i]);
    ep_fd = epoll_create1(0);
    pthread_t w[2], wr;
    for (int i = 0; i < 2; i++) pthread_create(&w[i], NULL, ep_waiter, NULL);
    pthread_create(&wr, NULL, ep_writer, NULL);
    long long end = now_ms() + 2000;
    unsigned long ops = 0;
    while (now_ms() < end) {
        for (int i = 0; i < NPAIRS; i++) {
            struct epoll_event ev = { .events = EPOLLIN | ((ops & 1) ? EPOLLET : 0), .data.fd = ep_s[i] };
            int ep = __atomic_load_n(&ep_fd, __ATOMIC_ACQUIRE);
            epoll_ctl(ep, EPOLL_CTL_ADD, ep_s[i], &ev);
            epoll_ctl(ep, EPOLL_CTL_MOD, ep_s[i], &ev);
            if (ops % 3) epoll_ctl(ep, EPOLL_CTL_DEL, ep_s[i], NULL);
            ops++;
        }
        if (ops % 97 == 0) {                             /* and the epoll set itself goes away */
            int old = __atomic_exchange_n(&ep_fd, epoll_create1(0), __ATOMIC_ACQ_REL);
            close(old);
        }
    }
    __atomic_store_n(&ep_stop, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < 2; i++) pthread_join(w[i], NULL);
    pthread_join(wr, NULL);
    for (int i = 0; i < NPAIRS; i++) { close(ep_c[i]); close(ep_s[i]); }
    close(ep_fd);
    printf("ok %s %lu epoll_ctl calls\n", scenario, ops);
}

/* ---- dup2 onto a socket another thread uses ------------------------------------------- */

static int dup_stop;
static void *dup_sender(void *p)
{
    int fd = *(int *)p;                                  /* the number: what it refers to changes */
    while (!__atomic_load_n(&dup_stop, __ATOMIC_ACQUIRE)) {
        ssize_t r = send(fd, "data", 4, MSG_DONTWAIT | MSG_NOSIGNAL);
        (void)r;
    }
    return NULL;
}

static void *drain_until_eof(void *p)
{
    int fd = *(int *)p;
    char buf[4096];
    while (read(fd, buf, sizeof buf) > 0) {}
    return NULL;
}

static void dup_onto_busy(void)
{
    int c1, s1, c2, s2;
    pair(&c1, &s1);
    pair(&c2, &s2);
    pthread_t snd, d1, d2;
    pthread_create(&d1, NULL, drain_until_eof, &s1);
    pthread_create(&d2, NULL, drain_until_eof, &s2);
    int target = c1;
    pthread_create(&snd, NULL, dup_sender, &target);
    for (int i = 0; i < 200; i++) {
        int spare = dup(c2);
        if (i % 2) dup2(spare, target);
        else dup3(spare, target, O_CLOEXEC);
        close(spare);
        sleep_ms(1);
    }
    __atomic_store_n(&dup_stop, 1, __ATOMIC_RELEASE);
    pthread_join(snd, NULL);
    close(target);                                       /* now c2's socket */
    close(c2);
    shutdown(s1, SHUT_RDWR);                             /* c1's socket went away with the first dup2 */
    pthread_join(d1, NULL);
    pthread_join(d2, NULL);
    close(s1);
    close(s2);
    printf("ok %s\n", scenario);
}

/* ---- fork while other threads are inside calls ---------------------------------------- */

static void fork_in_calls(void)
{
    int c1, s1, c2, s2;
    pair(&c1, &s1);
    pair(&c2, &s2);
    struct blocked b1 = { .fd = s1 }, b2 = { .fd = s2 };
    pthread_t t1, t2;
    pthread_create(&t1, NULL, do_recv, &b1);
    pthread_create(&t2, NULL, do_recv, &b2);
    sleep_ms(100);
    pid_t pid = fork();
    if (pid == 0) {
        /* The child has only this thread: the blocked calls do not exist here.  It can make
         * and use a connection of its own (locks held by the vanished threads are not). */
        alarm(20);
        close(lfd);
        listen_once();
        int c, s;
        pair(&c, &s);
        char buf[8];
        if (write(c, "child", 5) != 5 || read_full(s, buf, 5) != 5 || memcmp(buf, "child", 5)) _exit(7);
        close(c);
        close(s);
        _exit(0);
    }
    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st))
        fail("child: status %d", st);
    if (write(c1, "one", 3) != 3 || write(c2, "two", 3) != 3) fail("write: %s", strerror(errno));
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    if (b1.r != 3 || b2.r != 3 || memcmp(b1.buf, "one", 3) || memcmp(b2.buf, "two", 3))
        fail("blocked reads returned %zd, %zd", b1.r, b2.r);
    close(c1); close(s1); close(c2); close(s2);
    printf("ok %s\n", scenario);
}

/* ---- fork racing a connect ----------------------------------------------------------- */

/* A forking server in the same process as its client (Python's ForkingTCPServer under
 * test, a test harness): a server thread accepts and forks; the child echoes one line
 * and exits, the parent closes its copy.  Each fork settles the client handshakes under
 * way, so it races the client thread's connect for the same socket: both once sent a
 * HELLO, and the child read the second as a garbage preamble frame (EPROTO). */
#define FORK_ROUNDS 40

static void *forking_server(void *arg)
{
    (void)arg;
    for (int i = 0; i < FORK_ROUNDS; i++) {
        int s = accept(lfd, NULL, NULL);
        if (s < 0) fail("accept: %s", strerror(errno));
        pid_t pid = fork();
        if (pid < 0) fail("fork: %s", strerror(errno));
        if (pid == 0) {
            alarm(20);
            char line[64];
            size_t n = 0;
            while (n < sizeof line && (n == 0 || line[n - 1] != '\n')) {
                ssize_t r = read(s, line + n, sizeof line - n);
                if (r <= 0) _exit(r < 0 ? 10 + (errno & 0x7f) : 9);
                n += (size_t)r;
            }
            if (write(s, line, n) != (ssize_t)n) _exit(8);
            shutdown(s, SHUT_WR);
            close(s);
            _exit(0);
        }
        close(s);
    }
    return NULL;
}

static void fork_vs_connect(void)
{
    pthread_t t;
    pthread_create(&t, NULL, forking_server, NULL);
    struct sockaddr_in a;
    socklen_t l = sizeof a;
    getsockname(lfd, (struct sockaddr *)&a, &l);
    static const char msg[] = "hello world\n";
    int bad = 0;
    for (int i = 0; i < FORK_ROUNDS; i++) {
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(c, (struct sockaddr *)&a, sizeof a)) fail("connect: %s", strerror(errno));
        char buf[64];
        if (write(c, msg, sizeof msg - 1) != (ssize_t)sizeof msg - 1) fail("write: %s", strerror(errno));
        ssize_t n = read_full(c, buf, sizeof msg - 1);
        if (n != (ssize_t)sizeof msg - 1 || memcmp(buf, msg, sizeof msg - 1)) {
            printf("connection %d: %zd bytes back\n", i, n);
            bad++;
        }
        close(c);
    }
    pthread_join(t, NULL);
    for (int i = 0; i < FORK_ROUNDS; i++) {
        int st = 0;
        pid_t p = waitpid(-1, &st, 0);
        if (p < 0) fail("waitpid: %s", strerror(errno));
        if (!WIFEXITED(st) || WEXITSTATUS(st)) { printf("child %d: status 0x%x\n", (int)p, st); bad++; }
    }
    if (bad) fail("%d of %d echoes or children failed", bad, FORK_ROUNDS);
    printf("ok %s\n", scenario);
}

int main(int argc, char **argv)
{
    if (argc < 2) { fprintf(stderr, "usage: threads SCENARIO\n"); return 2; }
    scenario = argv[1];
    signal(SIGALRM, on_alarm);
    alarm(30);
    setvbuf(stdout, NULL, _IOLBF, 0);
    direct_init();
    listen_once();
    if (!strcmp(scenario, "close_vs_recv")) close_vs_recv();
    else if (!strcmp(scenario, "shutdown_wakes_recv")) shutdown_wakes_recv();
    else if (!strcmp(scenario, "close_vs_send")) close_vs_send();
    else if (!strcmp(scenario, "close_vs_wait")) close_vs_wait();
    else if (!strcmp(scenario, "epoll_ctl_vs_wait")) epoll_ctl_vs_wait();
    else if (!strcmp(scenario, "dup_onto_busy")) dup_onto_busy();
    else if (!strcmp(scenario, "fork_in_calls")) fork_in_calls();
    else if (!strcmp(scenario, "fork_vs_connect")) fork_vs_connect();
    else { fprintf(stderr, "unknown scenario %s\n", scenario); return 2; }
    return 0;
}
