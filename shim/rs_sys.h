/* rs_sys.h - the system calls the library makes for itself, issued directly so they never
 * re-enter an interposer (the preload library defines send/recv/poll, and syscall, itself). */
#ifndef RS_SYS_H
#define RS_SYS_H
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

/* syscall(), without passing through any interposer (rs_sys.c): -1 and errno on failure.
 * The macro gives the call its six arguments (missing ones 0), so nothing reads past what
 * the caller passed, as a variadic function would. */
long rs_syscall6(long n, long a, long b, long c, long d, long e, long f);
#define rs_syscall(...) rs_syscall_pad_(__VA_ARGS__, 0, 0, 0, 0, 0, 0)
#define rs_syscall_pad_(n, a, b, c, d, e, f, ...) \
    rs_syscall6((long)(n), (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), (long)(f))

static inline long rs_sys_send(int fd, const void *b, size_t n, int fl)
{
    long r = rs_syscall(SYS_sendto, fd, b, n, fl, NULL, 0);
    return r < 0 ? -errno : r;
}
static inline long rs_sys_recv(int fd, void *b, size_t n, int fl)
{
    long r = rs_syscall(SYS_recvfrom, fd, b, n, fl, NULL, NULL);
    return r < 0 ? -errno : r;
}
static inline int rs_sys_poll(struct pollfd *p, unsigned n, int timeout_ms)
{
    long r = rs_syscall(SYS_poll, p, n, timeout_ms);
    return r < 0 ? -errno : (int)r;
}
/* The socket's pending error (SO_ERROR), 0 if none. */
static inline int rs_sys_sockerr(int fd)
{
    int e = 0;
    socklen_t l = sizeof e;
    if (rs_syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_ERROR, &e, &l) < 0) return 0;
    return e;
}
#endif
