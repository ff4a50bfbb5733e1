/* fork_children.c - forked children of a preloaded process (tests/test_resources.py).
 *
 * The parent listens on loopback (so the engine is started) and forks:
 *   idle      a child that never touches a socket: the parent reports its private
 *             dirty memory (a fork must not copy the interpreter's pages into it);
 *   threaded  a child whose first socket is made by a thread it started;
 *   nested    a child that forks again first; the grandchild connects;
 *   direct    a child that connects from the thread that forked;
 *   backend   the parent accepts, and a child it forks then serves the connection (a
 *             PostgreSQL postmaster and its backend): it reports its private dirty memory
 *             after the exchange (the HELLO is answered without Python, shim/rs_answer.c).
 * Each connecting child sends "ping" and expects "pong" from its server.  Output lines:
 * "idle_private_dirty_kib N", "child NAME ok" for the first three, "backend_private_dirty_kib
 * N", "child backend ok", then "done".  Exit 0 if all went well.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static struct sockaddr_in addr;

static int exchange(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    char buf[4];
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) return -1;
    if (write(fd, "ping", 4) != 4) return -1;
    size_t got = 0;
    while (got < 4) {
        ssize_t r = read(fd, buf + got, 4 - got);
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    close(fd);
    return memcmp(buf, "pong", 4) ? -1 : 0;
}

static void *exchange_thread(void *arg) { *(int *)arg = exchange(); return NULL; }

static int run_child(const char *kind)
{
    if (!strcmp(kind, "direct")) return exchange();
    if (!strcmp(kind, "threaded")) {
        pthread_t t;
        int r = -1;
        if (pthread_create(&t, NULL, exchange_thread, &r)) return -1;
        pthread_join(t, NULL);
        return r;
    }
    /* nested */
    pid_t g = fork();
    if (g < 0) return -1;
    if (g == 0) _exit(exchange() ? 1 : 0);
    int st;
    return waitpid(g, &st, 0) == g && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

static long private_dirty_kib(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/smaps_rollup", (int)pid);
    FILE *f = fopen(path, "r");
    long kib = -1;
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "Private_Dirty:", 14)) kib = strtol(line + 14, NULL, 10);
    fclose(f);
    return kib;
}

/* Reads "ping" from fd and answers "pong"; 0 if that went well. */
static int serve(int fd)
{
    char buf[4];
    size_t got = 0;
    while (fd >= 0 && got < 4) {
        ssize_t r = read(fd, buf + got, 4 - got);
        if (r <= 0) break;
        got += (size_t)r;
    }
    if (got != 4 || memcmp(buf, "ping", 4)) return -1;
    return write(fd, "pong", 4) == 4 ? 0 : -1;
}

/* The backend case: returns 0 if client and server child both did their part. */
static int backend(int lfd)
{
    int rep[2];
    if (pipe(rep) < 0) return -1;
    pid_t cli = fork();
    if (cli == 0) { close(lfd); _exit(exchange() ? 1 : 0); }
    int fd = accept(lfd, NULL, NULL);
    pid_t srv = fork();
    if (srv == 0) {
        close(lfd);
        close(rep[0]);
        long kib = serve(fd) ? -1 : private_dirty_kib(getpid());
        ssize_t w = write(rep[1], &kib, sizeof kib);
        (void)w;
        _exit(kib < 0);
    }
    if (fd >= 0) close(fd);                 /* at once, as a postmaster does */
    close(rep[1]);
    long kib = -1;
    if (read(rep[0], &kib, sizeof kib) != sizeof kib) kib = -1;
    close(rep[0]);
    int st1, st2;
    int ok = waitpid(srv, &st1, 0) == srv && WIFEXITED(st1) && WEXITSTATUS(st1) == 0;
    ok &= waitpid(cli, &st2, 0) == cli && WIFEXITED(st2) && WEXITSTATUS(st2) == 0;
    printf("backend_private_dirty_kib %ld\nchild backend %s\n", kib, ok ? "ok" : "failed");
    fflush(stdout);
    return ok ? 0 : -1;
}

int main(void)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof addr;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 16) < 0 ||
        getsockname(lfd, (struct sockaddr *)&addr, &al) < 0) { perror("listen"); return 2; }
    alarm(60);

    int hold[2];
    if (pipe(hold) < 0) return 2;
    pid_t idle = fork();
    if (idle == 0) { char c; close(hold[1]); ssize_t r = read(hold[0], &c, 1); _exit(r < 0); }
    close(hold[0]);
    usleep(300000);
    printf("idle_private_dirty_kib %ld\n", private_dirty_kib(idle));
    fflush(stdout);
    close(hold[1]);
    waitpid(idle, NULL, 0);

    const char *kinds[] = { "threaded", "nested", "direct" };
    int fails = 0;
    for (int i = 0; i < 3; i++) {
        pid_t c = fork();
        if (c == 0) { close(lfd); _exit(run_child(kinds[i]) ? 1 : 0); }
        int fd = accept(lfd, NULL, NULL);
        serve(fd);
        int st;
        int ok = waitpid(c, &st, 0) == c && WIFEXITED(st) && WEXITSTATUS(st) == 0;
        if (fd >= 0) close(fd);
        printf("child %s %s\n", kinds[i], ok ? "ok" : "failed");
        fflush(stdout);
        fails += !ok;
    }
    fails += backend(lfd) != 0;
    printf("done\n");
    return fails ? 1 : 0;
}
