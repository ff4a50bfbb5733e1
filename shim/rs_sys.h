/* rs_sys.h - the few system calls the data path makes, issued directly so they never
 * re-enter an interposer (the preload library defines send/recv/poll itself). */
#ifndef RS_SYS_H
#define RS_SYS_H
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline long rs_sys_send(int fd, const void *b, size_t n, int fl)
{
    long r = syscall(SYS_sendto, fd, b, n, fl, NULL, 0);
    return r < 0 ? -errno : r;
}
static inline long rs_sys_recv(int fd, void *b, size_t n, int fl)
{
    long r = syscall(SYS_recvfrom, fd, b, n, fl, NULL, NULL);
    return r < 0 ? -errno : r;
}
static inline int rs_sys_poll(struct pollfd *p, unsigned n, int timeout_ms)
{
    long r = syscall(SYS_poll, p, n, timeout_ms);
    return r < 0 ? -errno : (int)r;
}
/* The socket's pending error (SO_ERROR), 0 if none. */
static inline int rs_sys_sockerr(int fd)
{
    int e = 0;
    socklen_t l = sizeof e;
    if (syscall(SYS_getsockopt, fd, SOL_SOCKET, SO_ERROR, &e, &l) < 0) return 0;
    return e;
}
#endif
