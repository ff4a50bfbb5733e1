/* rs_api.c - the Python API (rdmasock/api.py) as a host of the socket object: the same
 * rs_sock, state machine and data path the preload hooks drive, reached through cffi.
 *
 * The control plane is rdmasock/engine.py, in the same interpreter: its entry points are
 * cffi callbacks (extern "Python+C", defined in api.py).  Each rdmasock.socket keeps a
 * pointer to its rs_sock and the life (gen) it was made in, and every call takes a call
 * reference for that life first, so a close() in another thread never frees what a call
 * is using and never lets a call land on the object's next life. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include "rs_api.h"

/* The control plane, in Python: cffi callbacks (extern "Python+C", rdmasock/api.py) */
int  rs_api_py_step(int handle, int wait_ms, uintptr_t *out);
void rs_api_py_drop(int handle);
void rs_api_py_unlisten(int handle);
void rs_api_py_release(rs_conn *c);
void rs_api_py_fell_back(int fd, int role, rs_conn *c);

/* ---- what the socket object asks of this host --------------------------------------- */

static struct rs_stat_slot *api_stat_open(int fd, int role, int transport, int reason)
{
    /* Not a row of a shared table (that is the preload's `rdmasock stat`): the socket's
     * own record of its transport and reason, which a fallback updates once. */
    struct rs_stat_slot *slot = calloc(1, sizeof *slot);
    if (!slot) return NULL;
    slot->used = 1;
    slot->fd = fd;
    slot->role = (uint8_t)role;
    slot->transport = (uint8_t)transport;
    slot->reason = (uint16_t)reason;
    return slot;
}

static void api_stat_close(struct rs_stat_slot *slot) { free(slot); }

static const struct rs_host_ops api_host = {
    .step = rs_api_py_step, .drop = rs_api_py_drop, .unlisten = rs_api_py_unlisten,
    .release = rs_api_py_release, .fell_back = rs_api_py_fell_back,
    .stat_open = api_stat_open, .stat_close = api_stat_close,
};

/* os.fork() (or a fork in any library of the process) gives the child every socket: an
 * object that existed at the fork is `forked`, with the child counted as one more holder,
 * so that only the last process to let go of it ends its stream (a forking server's
 * parent closes its copy at once); the child forgets calls of threads it does not have. */
static void api_fork_prepare(void) { rs_sock_mark_all_forked(); }
static void api_fork_parent(void) { rs_sock_after_fork_parent(); }
static void api_fork_child(void) { rs_sock_after_fork_child(); }

void rs_api_install(void)
{
    static int once;
    rs_host = &api_host;
    if (!__atomic_exchange_n(&once, 1, __ATOMIC_ACQ_REL)) pthread_atfork(api_fork_prepare, api_fork_parent, api_fork_child);
}

/* ---- objects ------------------------------------------------------------------------ */

struct rs_sock *rs_api_new(int fd, int state, int handle, int role)
{
    struct rs_sock *s = rs_sock_new(fd, state, handle, role);
    if (!s) return NULL;
    s->nonblock = 0;              /* Python's timeout travels with each call */
    s->kernel_readiness = 1;      /* select/selectors/asyncio wait on the kernel socket */
    return s;
}

int rs_api_hold(struct rs_sock *s, uint32_t gen, int fd)
{
    if (!rs_sock_get_gen(s, gen)) return 0;
    rs_sock_hold(s, fd);
    rs_sock_put(s);
    return 1;
}

/* ---- calls -------------------------------------------------------------------------- */

static int wait_of(int flags, int timeout_ms, int timeo)
{
    if (flags & MSG_DONTWAIT) return 0;
    return timeout_ms < 0 ? timeo : timeout_ms;
}

ssize_t rs_api_recv(struct rs_sock *s, uint32_t gen, void *buf, size_t n, int flags, int timeout_ms)
{
    if (!rs_sock_get_gen(s, gen)) return -EBADF;
    int plain;
    ssize_t r = rs_sock_recv_within(s, buf, n, flags, wait_of(flags, timeout_ms, s->rcvtimeo_ms), &plain);
    rs_sock_put(s);
    return plain ? RS_API_PLAIN : r;
}

ssize_t rs_api_send(struct rs_sock *s, uint32_t gen, const void *buf, size_t n, int flags, int timeout_ms)
{
    if (!rs_sock_get_gen(s, gen)) return -EBADF;
    int plain;
    ssize_t r = rs_sock_send_within(s, buf, n, flags, wait_of(flags, timeout_ms, s->sndtimeo_ms),
                                    &plain);
    rs_sock_put(s);
    return plain ? RS_API_PLAIN : r;
}

int rs_api_step(struct rs_sock *s, uint32_t gen, int wait_ms)
{
    if (!rs_sock_get_gen(s, gen)) return -EBADF;
    rs_sock_step(s, wait_ms);
    if (rs_sock_state(s) == RS_RING && RS_GET(s->conn->fb)) rs_sock_note_fallback(s);
    int st = rs_sock_state(s);
    rs_sock_put(s);
    return st;
}

int rs_api_shutdown(struct rs_sock *s, uint32_t gen, int how, int nonblock)
{
    if (!rs_sock_get_gen(s, gen)) return -EBADF;
    int plain, r = rs_sock_shutdown_nonblock(s, how, nonblock, &plain);
    rs_sock_put(s);
    return plain ? RS_API_PLAIN : r;
}

int rs_api_move_tx(struct rs_sock *s, uint32_t gen, int reason, int flags)
{
    if (!rs_sock_get_gen(s, gen)) return -EBADF;
    int plain, r = rs_sock_move_tx(s, reason, flags, &plain);
    rs_sock_put(s);
    return plain ? RS_API_PLAIN : r;
}
