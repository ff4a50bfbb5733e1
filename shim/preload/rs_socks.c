/* rs_socks.c - which of the application's descriptors are sockets we look after.
 *
 * A descriptor number maps to an rs_sock (shim/rs_sock.h); every number that refers to the
 * same open file (dup, dup2, dup3, F_DUPFD) maps to the same object and holds it.  A hook
 * takes a call reference for as long as it works on the object, so a close() racing with
 * a recv() in another thread never frees what the recv uses. */
#include "rs_preload.h"
#include "../rs_fdmap.h"

static struct rs_fdmap socks = RS_FDMAP_INIT;
int rs_ntracked;

struct rs_sock *rs_sock_of(int fd)
{
    for (int tries = 0; tries < 100; tries++) {
        struct rs_sock *s = rs_fdmap_get(&socks, fd);
        if (__builtin_expect(!s, 1)) return NULL;
        if (!rs_sock_try_get(s)) continue;          /* torn down under us: look again */
        if (rs_fdmap_get(&socks, fd) == s) return s;
        rs_sock_put(s);                               /* the number moved on meanwhile */
    }
    return NULL;
}

int rs_is_tracked(int fd) { return rs_fdmap_get(&socks, fd) != NULL; }

/* Ends the application's hold of fd's socket.  `open`: fd is still that socket (it is
 * being closed or replaced next, and a last hold may end the stream through it); else the
 * number was closed where no hook of ours saw it, and may already be another file's,
 * which nothing of ours may read or write. */
static void drop(int fd, struct rs_sock *old, int open)
{
    if (old && old != RS_FDMAP_FAIL) {
        __atomic_sub_fetch(&rs_ntracked, 1, __ATOMIC_RELAXED);
        if (open) rs_sock_release_fd(old, fd);
        else rs_sock_abandon_fd(old, fd);
    }
}

struct rs_sock *rs_track(int fd, int state, int handle, int role)
{
    struct rs_sock *s = rs_sock_new(fd, state, handle, role);
    if (!s) return NULL;
    struct rs_sock *old = rs_fdmap_swap(&socks, fd, s);
    if (old == RS_FDMAP_FAIL) {                       /* no memory for the map */
        rs_sock_release_fd(s, fd);
        return NULL;
    }
    __atomic_add_fetch(&rs_ntracked, 1, __ATOMIC_RELAXED);
    drop(fd, old, 0);                                  /* a number reused without our close */
    return rs_sock_ref(s);
}

void rs_untrack(int fd)
{
    if (!rs_fdmap_get(&socks, fd)) return;
    drop(fd, rs_fdmap_swap(&socks, fd, NULL), 1);
}

void rs_forget_reused(int fd)
{
    if (!rs_fdmap_get(&socks, fd)) return;
    drop(fd, rs_fdmap_swap(&socks, fd, NULL), 0);
}

struct closed_range { unsigned first, last; };
static void untrack_in(int fd, void *p, void *arg)
{
    (void)p;
    const struct closed_range *r = arg;
    if ((unsigned)fd >= r->first && (unsigned)fd <= r->last) rs_untrack(fd);
}

void rs_untrack_range(unsigned first, unsigned last)
{
    struct closed_range r = { first, last };
    rs_fdmap_each(&socks, untrack_in, &r);
}

void rs_share(int oldfd, int newfd)
{
    struct rs_sock *s = rs_sock_of(oldfd);
    if (!s) { rs_forget_reused(newfd); return; }
    rs_sock_hold(s, newfd);
    struct rs_sock *old = rs_fdmap_swap(&socks, newfd, s);
    if (old == RS_FDMAP_FAIL) {
        rs_sock_release_fd(s, newfd);
    } else {
        __atomic_add_fetch(&rs_ntracked, 1, __ATOMIC_RELAXED);
        drop(newfd, old, 0);                          /* a number reused without our close */
    }
    rs_sock_put(s);
}

struct each_arg { void (*fn)(int, struct rs_sock *, void *); void *arg; };
static void each_one(int fd, void *p, void *arg)
{
    struct each_arg *a = arg;
    a->fn(fd, p, a->arg);
}

/* Every tracked descriptor with its socket (no call reference taken). */
void rs_socks_each(void (*fn)(int fd, struct rs_sock *s, void *arg), void *arg)
{
    struct each_arg a = { fn, arg };
    rs_fdmap_each(&socks, each_one, &a);
}

void rs_socks_after_fork_child(void)
{
    rs_fdmap_after_fork(&socks);
    rs_sock_after_fork_child();
}
