/* rs_bells.c - event bells: an eventfd per direction of a shm connection (EVENT_BELL
 * feature, docs/PROTOCOL.md 6.12).
 *
 * A doorbell byte on the TCP socket costs its sender a TCP send and its receiver a wake-up
 * through the TCP stack and a read: on one CPU a round trip of two of them takes ~15 us,
 * where two eventfd writes take ~5 us.  A receiver that waits in the preload's epoll_wait
 * adds its eventfd to the program's epoll instance beside the socket, edge-triggered, and
 * asks for RS_WANT_EVENT instead of RS_WANT_NEXT; the producer then writes the eventfd.
 * Every other wait (poll, select, one we do not see) keeps asking for the socket's byte.
 *
 * The eventfds start at 1 and the producer writes 0: a write of 0 never blocks (the peer
 * shares the file and could clear O_NONBLOCK, then fill the counter, and a write of 1
 * would then wait for ever), leaves the counter alone, and still wakes the waiters; the
 * counter at 1 makes epoll report each such wake-up once.  Nobody reads the counter.  That
 * is also why poll cannot use them: it would see the counter, always readable.
 *
 * The server makes both eventfds and passes them with the segment; each side holds both,
 * its own to wait on and the peer's to raise.  They count against the process's
 * descriptors, so a process holds at most an eighth of RLIMIT_NOFILE's soft limit of
 * them (further connections use the socket's bytes), at numbers from seven eighths of that
 * limit up: out of the range the program's own descriptors take first, and of the round
 * numbers a program may take for free (CPython's test_epoll counts on 10000 being closed;
 * half the hosts' limit of 20000 was our first bell).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include "rs_conn.h"
#include "rs_sys.h"

static int bells_held;          /* descriptors held by this copy of the data path */

static long nofile_soft(void)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) < 0 || r.rlim_cur == RLIM_INFINITY || r.rlim_cur > (1u << 30)) return 1 << 20;
    return (long)r.rlim_cur;
}

/* Room for two more bell descriptors in this process. */
static int budget_allows_two(void)
{
    return __atomic_load_n(&bells_held, __ATOMIC_RELAXED) + 2 <= nofile_soft() / 8;
}

int rs_fd_move_high(int fd)
{
    long soft = nofile_soft();
    int high = (int)rs_syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, (int)(soft - soft / 8));
    if (high < 0) return fd;
    rs_syscall(SYS_close, fd);
    return high;
}

/* Server: two new eventfds for a connection, [0] to wake the server, [1] the client.
 * 0, or -errno (-EMFILE: the budget is spent). */
int rs_bells_create(int fds[2])
{
    if (!budget_allows_two()) return -EMFILE;
    fds[0] = eventfd(1, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fds[0] < 0) return -errno;
    fds[1] = eventfd(1, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fds[1] < 0) {
        int e = errno;
        rs_syscall(SYS_close, fds[0]);
        return -e;
    }
    return 0;
}

/* 1 if fd is an eventfd.  A peer passes any descriptor it likes: one we write to must be
 * an eventfd (a write of 0 has no effect but a wake-up, and never blocks). */
static int is_eventfd(int fd)
{
    char path[64], link[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    long n = readlink(path, link, sizeof link - 1);
    if (n <= 0) return 0;
    link[n] = 0;
    return strcmp(link, "anon_inode:[eventfd]") == 0;
}

/* The connection takes both descriptors: `own` is raised by the peer, `peer` by us.  0, or
 * -errno if either is not an eventfd or the budget is spent: then they stay the caller's
 * to close (a peer's descriptor may be anything, rdmasock.rendezvous.defuse), and the
 * socket's bytes wake us (the peer may still ask for an event bell: a byte answers). */
int rs_conn_set_bells(rs_conn *c, int own, int peer)
{
    if (!is_eventfd(own) || !is_eventfd(peer)) return -EBADF;
    if (!budget_allows_two()) return -EMFILE;
    __atomic_add_fetch(&bells_held, 2, __ATOMIC_RELAXED);
    c->rx.bell_fd = rs_fd_move_high(own);
    c->tx.bell_fd = rs_fd_move_high(peer);
    return 0;
}

/* Producer: raises the peer's event bell (a write of 0, see above).  1 if it was raised. */
int rs_bell_raise(rs_conn *c)
{
    uint64_t zero = 0;
    if (c->tx.bell_fd < 0 || rs_syscall(SYS_write, c->tx.bell_fd, &zero, sizeof zero) != (long)sizeof zero) return 0;
    __atomic_fetch_add(&c->tx.event_bells, 1, __ATOMIC_RELAXED);
    return 1;
}

/* Our event bell is in the epoll instance epfd (instance `id`: a number closed and reused
 * is another instance), added now if not yet, edge-triggered, with data RS_BELL_EPOLL_DATA(fd):
 * fd is the socket the instance waits on for this connection.  1 if it is, 2 if it is but
 * was there under another socket's number until now (a dup, or the same connection under
 * two numbers: the instance's earlier reports named the other), 0 if it cannot be (no
 * bell, no room in the list of instances, epoll refused). */
int rs_bell_in_epoll(rs_conn *c, int epfd, uint32_t id, int fd)
{
    if (c->rx.bell_fd < 0) return 0;
    rs_lock(&c->rx.lock);
    int i, ok = 0;
    struct epoll_event ev = { .events = EPOLLIN | EPOLLET, .data.u64 = RS_BELL_EPOLL_DATA(fd) };
    for (i = 0; i < c->rx.bell_nsets && c->rx.bell_sets[i].epfd != epfd; i++) {}
    if (i < c->rx.bell_nsets && c->rx.bell_sets[i].id == id) {
        if (c->rx.bell_sets[i].fd == fd) ok = 1;
        else if (rs_syscall(SYS_epoll_ctl, epfd, EPOLL_CTL_MOD, c->rx.bell_fd, &ev) == 0) {
            c->rx.bell_sets[i].fd = fd;
            ok = 2;
        }
    } else if (i < RS_BELL_SETS) {
        /* already there (an instance shared under another number): its data is made ours */
        if (rs_syscall(SYS_epoll_ctl, epfd, EPOLL_CTL_ADD, c->rx.bell_fd, &ev) == 0 ||
            (errno == EEXIST && rs_syscall(SYS_epoll_ctl, epfd, EPOLL_CTL_MOD, c->rx.bell_fd, &ev) == 0)) {
            c->rx.bell_sets[i].epfd = epfd;            /* a reused number's entry is replaced */
            c->rx.bell_sets[i].id = id;
            c->rx.bell_sets[i].fd = fd;
            if (i == c->rx.bell_nsets) c->rx.bell_nsets++;
            ok = 1;
        }
    }
    rs_unlock(&c->rx.lock);
    return ok;
}

/* The connection is freed: its bell leaves the epoll instances it was added to (the peer
 * still holds the file, so closing ours would leave it there), then both are closed. */
void rs_bells_release(rs_conn *c)
{
    if (c->rx.bell_fd < 0 && c->tx.bell_fd < 0) return;
    rs_bells_drop_own(c);
    if (c->tx.bell_fd >= 0) {
        rs_syscall(SYS_close, c->tx.bell_fd);
        __atomic_sub_fetch(&bells_held, 1, __ATOMIC_RELAXED);
    }
    c->tx.bell_fd = -1;
}

/* Our own bell closed (its registrations, if any, gone first): a receiver whose program
 * waits for the socket in the kernel (the Python API) never adds it to an epoll instance
 * nor asks for it, so it would only hold a descriptor.  The peer's bell stays: we raise it. */
void rs_bells_drop_own(rs_conn *c)
{
    if (c->rx.bell_fd < 0) return;
    for (int i = 0; i < c->rx.bell_nsets; i++)
        rs_syscall(SYS_epoll_ctl, c->rx.bell_sets[i].epfd, EPOLL_CTL_DEL, c->rx.bell_fd, NULL);
    c->rx.bell_nsets = 0;
    rs_syscall(SYS_close, c->rx.bell_fd);
    c->rx.bell_fd = -1;
    __atomic_sub_fetch(&bells_held, 1, __ATOMIC_RELAXED);
}

/* In a fork's child, a connection it inherited gives up its bells: the child's copy would
 * share the parent's epoll instances, and the removals at its free would take the
 * parent's registrations away.  Closing the child's copies leaves those alone (the files
 * stay open in the parent); the child's waits on the connection ask for doorbell bytes. */
void rs_bells_after_fork_child(rs_conn *c)
{
    if (c->rx.bell_fd < 0 && c->tx.bell_fd < 0) return;
    c->rx.bell_nsets = 0;
    rs_bells_release(c);
}
