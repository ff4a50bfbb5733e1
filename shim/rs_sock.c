/* rs_sock.c - the socket object: lifetime, descriptor, handshake steps, and the I/O entry
 * points every host (the LD_PRELOAD hooks) calls.  See rs_sock.h for the model. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>
#include <linux/net_tstamp.h>
#include "rs_sock.h"
#include "rs_answer.h"
#include "rs_sys.h"

const struct rs_host_ops *rs_host;

#define HOLD   (1ull << 32)
#define CALLS  (HOLD - 1)
#define RS_HS_WRITE_WAIT_MS 5000   /* a server's write waits this long for the HELLO */
#define PRIVATE_FD_MIN 1024         /* private duplicates sit above the numbers select() can see */

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static struct rs_sock *all_socks, *free_socks;

/* ---- lifetime ---------------------------------------------------------------------- */

static int timeo_ms(int fd, int name)
{
    struct timeval tv = { 0, 0 };
    socklen_t l = sizeof tv;
    if (rs_syscall(SYS_getsockopt, fd, SOL_SOCKET, name, &tv, &l) < 0 || (!tv.tv_sec && !tv.tv_usec)) return -1;
    long long ms = (long long)tv.tv_sec * 1000 + (tv.tv_usec + 999) / 1000;
    return ms > 0x7fffffff ? 0x7fffffff : (int)ms;
}

struct rs_sock *rs_sock_new(int fd, int state, int handle, int role)
{
    pthread_mutex_lock(&pool_lock);
    struct rs_sock *s = free_socks;
    if (s) free_socks = s->free_next;
    pthread_mutex_unlock(&pool_lock);
    if (!s) {
        s = calloc(1, sizeof *s);
        if (!s) return NULL;
        pthread_mutex_lock(&pool_lock);
        s->all_next = all_socks;
        all_socks = s;
        pthread_mutex_unlock(&pool_lock);
    }
    int *fds = s->fds, capfds = s->capfds;
    uint32_t gen = s->gen + 1;
    struct rs_sock *all_next = s->all_next;
    if (!fds) {
        fds = malloc(2 * sizeof *fds);
        if (!fds) {
            pthread_mutex_lock(&pool_lock);
            s->free_next = free_socks;
            free_socks = s;
            pthread_mutex_unlock(&pool_lock);
            return NULL;
        }
        capfds = 2;
    }
    /* refs stays 0 until everything else is in place: a stale rs_sock_try_get sees 0.
     * all_next is cleared and put back under pool_lock: the list's walkers read it. */
    pthread_mutex_lock(&pool_lock);
    memset((char *)s + sizeof s->refs, 0, sizeof *s - sizeof s->refs);
    s->all_next = all_next;
    pthread_mutex_unlock(&pool_lock);
    s->gen = gen;
    s->fds = fds;
    s->capfds = capfds;
    s->fds[0] = fd;
    s->nfds = 1;
    s->fd = fd;
    s->state = state;
    s->handle = handle;
    s->role = (uint8_t)role;
    int fl = (int)rs_syscall(SYS_fcntl, fd, F_GETFL);
    s->nonblock = fl >= 0 && (fl & O_NONBLOCK);
    struct stat st;
    s->ino = rs_syscall(SYS_fstat, fd, &st) == 0 ? (uint64_t)st.st_ino : 0;
    s->rcvtimeo_ms = timeo_ms(fd, SO_RCVTIMEO);
    s->sndtimeo_ms = timeo_ms(fd, SO_SNDTIMEO);
    pthread_mutex_init(&s->lock, NULL);
    __atomic_store_n(&s->refs, HOLD, __ATOMIC_RELEASE);
    return s;
}

int rs_sock_try_get(struct rs_sock *s)
{
    uint64_t r = __atomic_load_n(&s->refs, __ATOMIC_ACQUIRE);
    do {
        if (!r) return 0;                             /* being torn down, or free */
    } while (!__atomic_compare_exchange_n(&s->refs, &r, r + 1, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    return 1;
}

int rs_sock_get_gen(struct rs_sock *s, uint32_t gen)
{
    if (!rs_sock_try_get(s)) return 0;
    if (__atomic_load_n(&s->gen, __ATOMIC_RELAXED) == gen) return 1;
    rs_sock_put(s);                                   /* the object lives on as another socket */
    return 0;
}

struct rs_sock *rs_sock_ref(struct rs_sock *s)
{
    __atomic_add_fetch(&s->refs, 1, __ATOMIC_ACQ_REL);
    return s;
}

/* Reads what the peer sent that nobody will read (a HELLO never answered, a SWITCH behind
 * the last request): closing a TCP socket with unread bytes sends RST, and the peer would
 * see ECONNRESET instead of EOF.  Not after fork: the other process reads them. */
static void drain_unread(int fd)
{
    char buf[512];
    for (int i = 0; i < 64; i++)
        if (rs_sys_recv(fd, buf, sizeof buf, MSG_DONTWAIT) <= 0) break;
}

/* Would the kernel end this connection with a reset?  It does when the application set
 * SO_LINGER to {1, 0}, or closes with data it has not read.  Then the peer gets a RESET
 * record instead of a FIN: its reads end in ECONNRESET, as over TCP. */
static int abortive_close(struct rs_sock *s)
{
    struct linger lg = { 0, 0 };
    socklen_t l = sizeof lg;
    if (rs_syscall(SYS_getsockopt, s->fd, SOL_SOCKET, SO_LINGER, &lg, &l) == 0 && lg.l_onoff && !lg.l_linger) return 1;
    return rs_rx_available(s->conn) > 0;
}

static void forget_answer(struct rs_sock *s)
{
    if (s->answer && s->answer->link_fd >= 0) rs_syscall(SYS_close, s->answer->link_fd);
    free(s->answer);
    s->answer = NULL;
}

/* ---- processes holding a socket ----------------------------------------------------
 * fork gives the child every descriptor, and the kernel closes a socket when the last
 * process holding it closes it: the stream ends there (end_stream), and nowhere else,
 * since another holder may go on with the connection.  Each forked socket counts its
 * holders in a record of anonymous shared memory, which fork shares with the child and
 * which nobody else sees (not the peer).  fork_prepare adds the child to the count before
 * the fork, so a parent that closes its copy at once (a forking server) never finds itself
 * last; the child lists its pid once it runs.  Each process takes its count back at its
 * last close or its exit.  One that never does (killed, or ended by _exit where nothing of
 * ours runs: a Python API process) is taken off by the next to let go, once its pid is
 * gone (kill(pid, 0): ESRCH).  A holder that execs, or is not listed (more than
 * HOLDER_PIDS of them, a child not yet running), stays counted: nobody is then last, and
 * the kernel's close ends the stream, as for a socket with no record. */

#define HOLDER_PIDS 15

struct holders {
    uint32_t count;
    int32_t  pid[HOLDER_PIDS];          /* holders known by pid; 0: free */
};
_Static_assert(sizeof(struct holders) == 64, "a cache line each");

#define HOLDER_RECORDS (4096 / sizeof(struct holders))

struct holder_page { struct holders *rec; struct holder_page *next; };
static struct holder_page *holder_pages;        /* under pool_lock */

static void holder_list(struct holders *h, int32_t pid)
{
    for (int i = 0; i < HOLDER_PIDS; i++) {
        int32_t zero = 0;
        if (__atomic_compare_exchange_n(&h->pid[i], &zero, pid, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return;
    }
}

/* A free record (count 0) of a page this process shares with its family: count n, this
 * process listed; NULL if none can be had. */
static struct holders *holders_new(uint32_t n)
{
    struct holders *h = NULL;
    for (struct holder_page *p = holder_pages; p && !h; p = p->next)
        for (size_t i = 0; i < HOLDER_RECORDS && !h; i++) {
            uint32_t zero = 0;
            if (!__atomic_load_n(&p->rec[i].count, __ATOMIC_RELAXED) &&
                __atomic_compare_exchange_n(&p->rec[i].count, &zero, n, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                h = &p->rec[i];
        }
    if (!h) {
        struct holder_page *p = malloc(sizeof *p);
        void *m = p ? mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0) : MAP_FAILED;
        if (m == MAP_FAILED) { free(p); return NULL; }
        p->rec = m;
        p->next = holder_pages;
        holder_pages = p;
        h = &p->rec[0];
        h->count = n;
    }
    for (int i = 0; i < HOLDER_PIDS; i++) __atomic_store_n(&h->pid[i], 0, __ATOMIC_RELAXED);
    holder_list(h, (int32_t)rs_syscall(SYS_getpid));
    return h;
}

/* Takes one count back; 1 if it was the last. */
static int holders_drop(struct holders *h) { return __atomic_sub_fetch(&h->count, 1, __ATOMIC_ACQ_REL) == 0; }

/* The child's memory is this process's as it is at the fork itself, some time after
 * fork_prepare marked every socket.  A ring made in between by another thread's handshake
 * would be in the child too, yet marked as this process's alone (adopt_ring): both would
 * end its stream.  A last close in between would take this process's count back before
 * the child's is added, and end the stream the child still holds.  So a fork holds
 * fork_gate from the marking until it is done, and a ring's adoption and a letting go
 * take it: each happens wholly before the marking or wholly after the fork.  At exit
 * (which may run in a signal handler on a thread inside the gate) it is tried for about a
 * millisecond, then the count is taken back without it. */
static pthread_mutex_t fork_gate = PTHREAD_MUTEX_INITIALIZER;
static int exiting;

static int forked(struct rs_sock *s) { return __atomic_load_n(&s->forked, __ATOMIC_ACQUIRE); }

static int gate_enter(void)
{
    if (!__atomic_load_n(&exiting, __ATOMIC_RELAXED)) return !pthread_mutex_lock(&fork_gate);
    for (int i = 0; i < 100; i++) {
        if (!pthread_mutex_trylock(&fork_gate)) return 1;
        struct timespec ts = { 0, 10000 };
        nanosleep(&ts, NULL);
    }
    return 0;
}

static int let_go_gated(struct rs_sock *s)
{
    if (__atomic_exchange_n(&s->let_go, 1, __ATOMIC_ACQ_REL)) return 0;
    struct holders *h = __atomic_load_n(&s->holders, __ATOMIC_ACQUIRE);
    int was_forked = forked(s);
    if (!h) return !was_forked;
    int32_t me = (int32_t)rs_syscall(SYS_getpid);
    for (int i = 0; i < HOLDER_PIDS; i++) {
        int32_t mine = me;
        if (__atomic_compare_exchange_n(&h->pid[i], &mine, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) break;
    }
    int last = holders_drop(h);
    for (int i = 0; i < HOLDER_PIDS && !last; i++) {
        int32_t p = __atomic_load_n(&h->pid[i], __ATOMIC_ACQUIRE);
        if (p <= 0 || p == me || rs_syscall(SYS_kill, p, 0) == 0 || errno != ESRCH) continue;
        if (__atomic_compare_exchange_n(&h->pid[i], &p, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) last = holders_drop(h);
    }
    return !was_forked || last;
}

/* This process stops holding s, once: 1 if the stream's end is its to write, since no
 * other process holds s now, or this process made the ring (adopt_ring: the others
 * only close their copies). */
static int let_go(struct rs_sock *s)
{
    if (__atomic_load_n(&s->let_go, __ATOMIC_ACQUIRE)) return 0;
    int gated = gate_enter();
    int r = let_go_gated(s);
    if (gated) pthread_mutex_unlock(&fork_gate);
    return r;
}

/* The child of a fork lists itself as a holder of what it inherited. */
static void holders_after_fork_child(struct rs_sock *s)
{
    if (s->holders && !s->let_go) holder_list(s->holders, (int32_t)rs_syscall(SYS_getpid));
}

/* The end of the stream as the peer sees it, once per socket: a FIN record, or a RESET
 * where the kernel would reset.  The peer's doorbells and handshake bytes are read first:
 * unread, they would make the kernel's close a reset, which throws away what is still in
 * flight to the peer (spilled bytes, a moved stream).  Only in the last process that
 * holds the socket: another may go on with the connection and reads them.  Left to the
 * kernel by a forked last holder whose ring cursors another holder has moved on since the
 * fork (its end would land on their records), by a forked transport with objects of
 * the control plane (rdma): its objects are the parent's, and by a socket passed to
 * another process, which we cannot count. */
static void end_stream(struct rs_sock *s)
{
    int st = rs_sock_state(s);
    if ((st != RS_RING && st != RS_SERVER_HS) || __atomic_exchange_n(&s->ended, 1, __ATOMIC_ACQ_REL))
        return;
    if (!let_go(s) || s->passed) return;
    if (forked(s) && st == RS_RING && (s->conn->ops->host_objects || !rs_tx_tail_is_ours(s->conn))) return;
    /* Its number closed where we did not see it (rs_sock_abandon_fd), a socket has no
     * descriptor left to read off: the kernel's close came first.  The ring still ends. */
    int open = s->fd >= 0;
    int abort = st == RS_RING && abortive_close(s);
    if (st == RS_RING && !abort && open) rs_quiesce_bells(s->conn);
    if (open) drain_unread(s->fd);
    if (st != RS_RING) return;
    abort ? rs_send_reset(s->conn) : rs_send_fin(s->conn);
    s->conn->ops->closed(s->conn);             /* rdma: the doorbells its last WRITEs rang */
}

/* 1 once neither direction's lock is held, tried for about a millisecond.  exit may run
 * in a signal handler that interrupted this very thread inside a call that holds one. */
static int directions_free(rs_conn *c)
{
    for (int i = 0; i < 100; i++) {
        if (rs_trylock(&c->rx.lock)) {
            int tx = rs_trylock(&c->tx.lock);
            if (tx) rs_unlock(&c->tx.lock);
            rs_unlock(&c->rx.lock);
            if (tx) return 1;
        }
        struct timespec ts = { 0, 10000 };
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* The process ends (exit): the kernel closes the socket next, without our close hook.
 * Skipped where a lock it needs stays held (see directions_free) or another thread's
 * handshake step holds the object: waiting for them could hang the exit. */
void rs_sock_at_exit(struct rs_sock *s)
{
    __atomic_store_n(&exiting, 1, __ATOMIC_RELAXED);
    if (rs_sock_state(s) == RS_RING) {
        if (directions_free(s->conn)) end_stream(s);
        let_go(s);
        return;
    }
    if (!pthread_mutex_trylock(&s->lock)) {
        end_stream(s);
        pthread_mutex_unlock(&s->lock);
    }
    let_go(s);                                  /* this process is done with it either way */
}

/* The last reference is gone: nobody can reach the object any more. */
static void destroy(struct rs_sock *s)
{
    end_stream(s);
    let_go(s);
    switch (s->state) {
    case RS_RING:
        /* A transport with objects of the control plane (rdma: its verbs objects) has them
         * released, its last WRITEs first, before the memory is unmapped.  After fork they
         * belong to the parent: the child only drops its copy. */
        if (!forked(s) && s->conn->ops->host_objects && rs_host && rs_host->release) rs_host->release(s->conn);
        rs_conn_free(s->conn);
        break;
    case RS_PRE_RX:
        rs_conn_free(s->conn);
        break;
    case RS_CLIENT_HS:
        /* The server's answer may arrive after the close and provoke a reset, which would
         * overtake the end of what we sent: our FIN goes first, as TCP's close sends it. */
        if (!forked(s) && !s->passed) rs_syscall(SYS_shutdown, s->fd, SHUT_WR);
        if (rs_host && rs_host->drop) rs_host->drop(s->handle);
        break;
    case RS_SERVER_HS:
        /* A forking server closes its copy at once: without entering the control plane,
         * whose writes would unshare the child's copies of its pages. */
        if (s->answer && rs_host && rs_host->answer_done) rs_host->answer_done(s->handle, -1, s->answer);
        else if (s->handle && rs_host && rs_host->drop) rs_host->drop(s->handle);
        break;
    case RS_LISTEN:
        if (rs_host && rs_host->unlisten) rs_host->unlisten(s->handle);
        break;
    }
    forget_answer(s);
    if (rs_host && rs_host->stat_close) rs_host->stat_close(s->stat);   /* after the rings are gone */
    if (s->own_fd) rs_syscall(SYS_close, s->fd);
    s->conn = NULL;
    __atomic_store_n(&s->stat, NULL, __ATOMIC_RELAXED);
    pthread_mutex_destroy(&s->lock);
    pthread_mutex_lock(&pool_lock);
    s->free_next = free_socks;
    free_socks = s;
    pthread_mutex_unlock(&pool_lock);
}

void rs_sock_put(struct rs_sock *s)
{
    if (__atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL) == 0) destroy(s);
}

void rs_sock_hold(struct rs_sock *s, int fd)
{
    pthread_mutex_lock(&s->lock);
    if (s->nfds == s->capfds) {
        int *n = realloc(s->fds, (size_t)s->capfds * 2 * sizeof *n);
        if (n) { s->fds = n; s->capfds *= 2; }
    }
    if (s->nfds < s->capfds) s->fds[s->nfds++] = fd;
    pthread_mutex_unlock(&s->lock);
    __atomic_add_fetch(&s->refs, HOLD, __ATOMIC_ACQ_REL);
}

/* Points our calls at fd (the socket's own descriptor for them). */
static void use_fd(struct rs_sock *s, int fd)
{
    s->fd = fd;
    if (s->conn) rs_conn_move_fd(s->conn, fd);
}

/* fd's hold ends.  fd_open: the number is still the socket's (the caller closes it next);
 * else it is closed already and may be another file's: nothing of ours may use it. */
static void drop_hold(struct rs_sock *s, int fd, int fd_open)
{
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < s->nfds; i++)
        if (s->fds[i] == fd) { s->fds[i] = s->fds[--s->nfds]; break; }
    if (s->fd == fd && !s->own_fd) {
        if (s->nfds) {
            use_fd(s, s->fds[0]);                   /* another number of the application */
        } else if (!fd_open) {
            use_fd(s, -1);
        } else if (__atomic_load_n(&s->refs, __ATOMIC_ACQUIRE) & CALLS) {
            /* A call is still inside: it keeps the socket, as the kernel's would, on a
             * duplicate of our own (the application's number may be reused at once). */
            int priv = (int)rs_syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, PRIVATE_FD_MIN);
            if (priv < 0) priv = (int)rs_syscall(SYS_fcntl, fd, F_DUPFD_CLOEXEC, 0);
            if (priv >= 0) { use_fd(s, priv); s->own_fd = 1; }
        }
    }
    pthread_mutex_unlock(&s->lock);
    if (__atomic_sub_fetch(&s->refs, HOLD, __ATOMIC_ACQ_REL) == 0) destroy(s);
}

void rs_sock_release_fd(struct rs_sock *s, int fd) { drop_hold(s, fd, 1); }
void rs_sock_abandon_fd(struct rs_sock *s, int fd) { drop_hold(s, fd, 0); }

/* A client connection still in its handshake when its process forks would have the
 * server's answer taken by whichever of the two processes calls first: the other would
 * read the server's next bytes as a broken answer and send its data where the server
 * does not read it (a client that forks a writer right after connect, the parent
 * reading: the stream arrived garbled).  So fork first waits for the answer, as the first
 * read would have (at most RS_SETTLE_MS, for all of them together), and sends a SWITCH
 * still due: the child inherits settled sockets.  A server's socket is left as it
 * is: a forking server's parent closes it without a look, and its child answers. */
/* Waits (until deadline) for the answer of a client handshake still under way, and sends
 * a lazy SWITCH still due: from then on either process may be the one that goes on. */
static int step(struct rs_sock *s, int wait_ms, int try_only);

void rs_sock_finish_client(struct rs_sock *s, uint64_t deadline)
{
    /* A thread of ours already waiting for the answer gets it itself: it may be the fork's
     * child's to make (a forking server in this process), and its lock is not ours to
     * wait for. */
    if (rs_sock_state(s) == RS_CLIENT_HS) step(s, rs_ms_until(deadline), 1);
    if (rs_sock_state(s) == RS_RING && s->role == RS_ROLE_CLIENT) rs_tx_switch(s->conn);
}

/* A server answers at once when it serves the connection: a millisecond or two.  Not the
 * whole handshake timeout: the server may not be reading (busy, or a process that does not
 * serve the connection yet), and the fork would stall that long.  Nor at all when the
 * server's end is in this process, unanswered (answer_due_here). */
#define RS_SETTLE_MS 200
uint64_t rs_settle_deadline(void) { return rs_now_ns() + RS_SETTLE_MS * 1000000ull; }

/* An INET endpoint as 18 bytes: the IPv6 address (IPv4 mapped) and the port.  0 if none. */
static int endpoint(int fd, int peer, uint8_t out[18])
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (rs_syscall(peer ? SYS_getpeername : SYS_getsockname, fd, &ss, &sl) < 0) return 0;
    if (ss.ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)&ss;
        memset(out, 0, 10);
        out[10] = out[11] = 0xff;
        memcpy(out + 12, &in->sin_addr, 4);
        memcpy(out + 16, &in->sin_port, 2);
        return 1;
    }
    if (ss.ss_family != AF_INET6) return 0;
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)&ss;
    memcpy(out, &in6->sin6_addr, 16);
    memcpy(out + 16, &in6->sin6_port, 2);
    return 1;
}

/* Is the server's end of client connection c a socket of this process that has not
 * answered the HELLO (one of all[0..n))?  Then the answer is this process's own to make,
 * or the fork's child's (a forking server whose client runs in the same process, as in a
 * test harness): waiting for it would only stall the fork. */
static int answer_due_here(struct rs_sock *c, struct rs_sock **all, size_t n)
{
    uint8_t cl[18], cp[18], sl[18], sp[18];
    if (!endpoint(c->fd, 0, cl) || !endpoint(c->fd, 1, cp)) return 0;
    for (size_t i = 0; i < n; i++)
        if (rs_sock_state(all[i]) == RS_SERVER_HS && endpoint(all[i]->fd, 0, sl) && !memcmp(sl, cp, 18) &&
            endpoint(all[i]->fd, 1, sp) && !memcmp(sp, cl, 18))
            return 1;
    return 0;
}

static void settle_clients_before_fork(void)
{
    struct rs_sock **todo = NULL;
    size_t n = 0, cap = 0;
    pthread_mutex_lock(&pool_lock);
    /* A reference first: then nothing frees it, and an object still being made (no
     * reference yet) is not looked at. */
    for (struct rs_sock *s = all_socks; s; s = s->all_next) {
        if (n == cap) {
            struct rs_sock **more = realloc(todo, (cap = cap ? 2 * cap : 8) * sizeof *more);
            if (!more) break;
            todo = more;
        }
        if (rs_sock_try_get(s)) todo[n++] = s;
    }
    pthread_mutex_unlock(&pool_lock);
    uint64_t deadline = rs_settle_deadline();
    for (size_t i = 0; i < n; i++) {
        struct rs_sock *s = todo[i];
        int st = rs_sock_state(s);
        if ((st == RS_CLIENT_HS || (st == RS_RING && s->role == RS_ROLE_CLIENT)) &&
            !__atomic_load_n(&s->let_go, __ATOMIC_ACQUIRE) && !(st == RS_CLIENT_HS && answer_due_here(s, todo, n)))
            rs_sock_finish_client(s, deadline);
        rs_sock_put(s);                             /* outside pool_lock: a last put destroys */
    }
    free(todo);
}

/* fork_prepare: the gate stays held until the fork is done (rs_sock_after_fork_parent,
 * rs_sock_after_fork_child). */
void rs_sock_mark_all_forked(void)
{
    settle_clients_before_fork();
    pthread_mutex_lock(&fork_gate);
    pthread_mutex_lock(&pool_lock);
    for (struct rs_sock *s = all_socks; s; s = s->all_next) {
        if (!__atomic_load_n(&s->refs, __ATOMIC_ACQUIRE)) continue;
        struct rs_stat_slot *row = __atomic_load_n(&s->stat, __ATOMIC_ACQUIRE);
        s->stat_at_fork.used = 0;
        if (row && rs_host && rs_host->stat_copy) rs_host->stat_copy(row, &s->stat_at_fork);
        if (__atomic_load_n(&s->let_go, __ATOMIC_ACQUIRE)) continue;
        struct holders *h = __atomic_load_n(&s->holders, __ATOMIC_ACQUIRE);
        if (h) __atomic_add_fetch(&h->count, 1, __ATOMIC_ACQ_REL);
        else if (!__atomic_load_n(&s->forked, __ATOMIC_ACQUIRE))
            __atomic_store_n(&s->holders, holders_new(2), __ATOMIC_RELEASE);    /* this process and the child */
        __atomic_store_n(&s->forked, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&pool_lock);
}

void rs_sock_after_fork_parent(void) { pthread_mutex_unlock(&fork_gate); }

/* In the child, only the thread that forked exists: calls other threads had in progress
 * will never end, and locks they held will never be released. */
void rs_sock_after_fork_child(void)
{
    pthread_mutex_init(&pool_lock, NULL);
    pthread_mutex_init(&fork_gate, NULL);
    for (struct rs_sock *s = all_socks; s; s = s->all_next) {
        uint64_t r = __atomic_load_n(&s->refs, __ATOMIC_RELAXED);
        if (!r) continue;
        __atomic_store_n(&s->refs, r & ~CALLS, __ATOMIC_RELAXED);
        pthread_mutex_init(&s->lock, NULL);
        holders_after_fork_child(s);
        if (s->conn) rs_conn_after_fork_child(s->conn);
        if (s->stat && rs_host && rs_host->stat_inherit) {
            struct rs_stat_slot *was = &s->stat_at_fork;
            s->stat = was->used ? rs_host->stat_inherit(was) : NULL;
            if (!s->stat && was->used) {
                s->rx_bytes += was->rx_bytes;       /* no row of its own: the socket counts all */
                s->tx_bytes += was->tx_bytes;
            }
        }
    }
}

/* ---- handshake --------------------------------------------------------------------- */

/* The socket gets its statistics row: what it counted so far moves there, as later calls
 * count there (rx_count).  A call that did not see the row yet adds to the socket's own
 * count, which TCP_INFO adds (rs_sock_tcp_info).  Under the fork gate: a fork copies each
 * row with its socket's counts (rs_sock_mark_all_forked). */
void rs_sock_open_stat(struct rs_sock *s, struct rs_stat_slot *row)
{
    if (!row) return;
    pthread_mutex_lock(&fork_gate);
    __atomic_store_n(&s->stat, row, __ATOMIC_RELEASE);
    __atomic_fetch_add(&row->rx_bytes, __atomic_exchange_n(&s->rx_bytes, 0, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    __atomic_fetch_add(&row->tx_bytes, __atomic_exchange_n(&s->tx_bytes, 0, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    pthread_mutex_unlock(&fork_gate);
}

static int roles[] = { [RS_CLIENT_HS] = RS_ROLE_CLIENT, [RS_SERVER_HS] = RS_ROLE_SERVER };

/* The send buffer a new TCP socket gets (tcp_wmem's default), read once; 0 if unknown. */
static int default_sndbuf(void)
{
    static int v = -1;
    int cur = __atomic_load_n(&v, __ATOMIC_RELAXED);
    if (cur >= 0) return cur;
    char buf[64] = "";
    int fd = (int)rs_syscall(SYS_openat, AT_FDCWD, "/proc/sys/net/ipv4/tcp_wmem", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        long n = rs_syscall(SYS_read, fd, buf, sizeof buf - 1);
        buf[n > 0 ? n : 0] = 0;
        rs_syscall(SYS_close, fd);
    }
    int lo = 0, def = 0;
    cur = sscanf(buf, "%d %d", &lo, &def) == 2 && def > 0 ? def : 0;
    __atomic_store_n(&v, cur, __ATOMIC_RELAXED);
    return cur;
}

/* What TCP keeps in flight is bounded by the send buffer (and the peer's receive buffer).
 * A program that makes its send buffer smaller than a new socket's (SO_SNDBUF, on the
 * socket, before connect or on its listener) expects its writes to wait, and to fail once
 * the peer is gone, that much sooner (asyncio's sendfile tests do): its ring's window then
 * stays at the first one, 16 KiB (rs_produce.c tx_grow), about what two such buffers hold.
 * A larger buffer asks for more in flight, which the ring gives anyway.  An rdma ring is
 * whole from the start. */
static void cap_window(struct rs_sock *s)
{
    int v = 0, def = default_sndbuf();
    socklen_t l = sizeof v;
    if (!s->conn || rs_syscall(SYS_getsockopt, s->fd, SOL_SOCKET, SO_SNDBUF, &v, &l) < 0 || v <= 0) return;
    uint32_t cap = v < (def ? def : (int)RS_WINDOW_MIN) ? RS_WINDOW_MIN : s->conn->ring_size;
    __atomic_store_n(&s->conn->tx.window_max, cap < s->conn->ring_size ? cap : s->conn->ring_size, __ATOMIC_RELAXED);
}

/* Makes the connection the control plane built this socket's own (caller holds lock). */
static void adopt_ring(struct rs_sock *s, rs_conn *c)
{
    int one = 1, v = 0;
    socklen_t sl = sizeof v;
    c->fd = s->fd;                              /* the engine worked on a descriptor of its own */
    if (rs_syscall(SYS_getsockopt, s->fd, IPPROTO_TCP, TCP_NODELAY, &v, &sl) == 0) s->app_nodelay = v != 0;
    sl = sizeof v;
    if (rs_syscall(SYS_getsockopt, s->fd, IPPROTO_TCP, TCP_CORK, &v, &sl) == 0) s->app_cork = v != 0;
    /* The TCP socket now carries only doorbells: Nagle would hold one back for a delayed
     * ACK, a cork for up to 200 ms.  The application's own settings are kept virtually
     * (the getsockopt/setsockopt hooks). */
    int zero = 0;
    rs_syscall(SYS_setsockopt, s->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (s->app_cork) rs_syscall(SYS_setsockopt, s->fd, IPPROTO_TCP, TCP_CORK, &zero, sizeof zero);
    s->conn = c;
    int fl = (int)rs_syscall(SYS_fcntl, s->fd, F_GETFL);
    if (!s->kernel_readiness) {
        c->rx.lazy_tidy = !s->ep_unknown && !(fl >= 0 && (fl & O_ASYNC));
        c->rx.flags_unseen = 0;                 /* the fcntl hook tells us (rs_sock_flags_seen) */
        if (fl >= 0 && (fl & O_ASYNC)) rs_rx_bell_every(c, 1);
    } else {
        rs_bells_drop_own(c);                   /* no hook of ours adds it to an epoll instance */
    }
    cap_window(s);
    __atomic_store_n(&s->forked, 0, __ATOMIC_RELEASE);   /* made here: nobody else has the ring */
    rs_hold_list(c);                            /* its hold may be filled by any waiting writer */
}

/* The handshake ended (caller holds lock): the half-closes asked for meanwhile go the way
 * the data now goes. */
static void shut_pending_now(struct rs_sock *s)
{
    int p = s->shut_pending;
    s->shut_pending = 0;
    if (s->state == RS_RING) {
        if (p & 1) rs_shutdown_rd(s->conn);
        if (p & 2) rs_send_fin(s->conn);
    } else {
        rs_syscall(SYS_shutdown, s->fd, p == 3 ? SHUT_RDWR : p == 1 ? SHUT_RD : SHUT_WR);
    }
}

/* The handshake failed (caller holds lock): every call reports err from now on.  The
 * kernel socket is shut down for reading, so that any wait on it (poll, select, epoll,
 * in this thread or another) wakes and the program's next call sees the error: a failed
 * handshake may have discarded the bytes the wait was woken for. */
static void set_broken(struct rs_sock *s, int err)
{
    s->err = err;
    __atomic_store_n(&s->state, RS_BROKEN, __ATOMIC_RELEASE);
    rs_syscall(SYS_shutdown, s->fd, SHUT_RD);
}

/* A preamble frame that a non-blocking write began is still open: the answer waits, since
 * the SWITCH that follows it must come after the frame's tail, which only the program's
 * next writes bring.  Waits up to wait_ms (another thread may be writing), looking every
 * 2 ms at first, every 50 ms at most, the lock taken only to look (try_only: not waited
 * for).  1: no frame open. */
static int frame_closed_within(struct rs_sock *s, int wait_ms, int try_only)
{
    uint64_t deadline = rs_deadline(wait_ms), nap_ns = 2000000;
    for (;;) {
        if (!try_only) pthread_mutex_lock(&s->lock);
        else if (pthread_mutex_trylock(&s->lock)) return 0;
        int open = rs_pre_is_open(&s->pre_open);
        pthread_mutex_unlock(&s->lock);
        if (!open) return 1;
        if (rs_nap(nap_ns, deadline, 0) <= 0) return 0;
        if (nap_ns < 50000000) nap_ns *= 2;
    }
}

/* The program ends its writing while a frame is open: the stream ends inside it (the
 * server reads what came, then the end, as over TCP), and the answer may be processed
 * for the reading side (a SWITCH after our FIN goes nowhere).  1 if so. */
static int end_inside_frame(struct rs_sock *s)
{
    pthread_mutex_lock(&s->lock);
    int open = s->state == RS_CLIENT_HS && rs_pre_is_open(&s->pre_open);
    if (open) {
        rs_syscall(SYS_shutdown, s->fd, SHUT_WR);
        s->pre_open = (struct rs_pre_open){ 0 };
    }
    pthread_mutex_unlock(&s->lock);
    return open;
}

/* try_only: not if another thread is taking a step (it holds the lock, maybe waiting). */
static int step(struct rs_sock *s, int wait_ms, int try_only)
{
    int st = rs_sock_state(s);
    if (st != RS_CLIENT_HS && st != RS_SERVER_HS) return 1;
    if (st == RS_CLIENT_HS && !frame_closed_within(s, wait_ms, try_only)) return 0;
    if (!rs_host || !rs_host->step) { __atomic_store_n(&s->state, RS_PLAIN, __ATOMIC_RELEASE); return 1; }
    if (!try_only) pthread_mutex_lock(&s->lock);
    else if (pthread_mutex_trylock(&s->lock)) return 0;
    int r = 1;
    st = s->state;
    if (st == RS_CLIENT_HS && rs_pre_is_open(&s->pre_open)) {
        r = 0;                                      /* a write opened a frame meanwhile */
    } else if (st == RS_CLIENT_HS || st == RS_SERVER_HS) {
        uintptr_t out[2] = { 0, 0 };
        int res = RS_ANSWER_DEFER;
        if (st == RS_SERVER_HS && s->answer && rs_host->answer_done) {
            res = rs_answer_shm(s->answer, s->fd, wait_ms, out);
            if (res == RS_STEP_RING) rs_host->answer_done(s->handle, s->fd, s->answer);
            if (res != RS_STEP_PENDING) forget_answer(s);   /* answered, or the control plane's from now on */
        }
        if (res == RS_ANSWER_DEFER && !s->handle) {
            int h = rs_host->accept_late ? rs_host->accept_late(s->fd) : 0;
            if (h > 0) s->handle = h;
            else res = RS_STEP_TCP, out[1] = (uintptr_t)-h;
        }
        if (res == RS_ANSWER_DEFER) res = rs_host->step(s->handle, wait_ms, out);
        s->role = (uint8_t)roles[st];
        if (res != RS_STEP_PENDING && res != RS_STEP_CONNECTING) s->reason = (uint16_t)out[1];
        if (res != RS_STEP_PENDING && res != RS_STEP_CONNECTING && rs_host->stat_open) {
            int transport = res != RS_STEP_RING ? RS_TRANSPORT_TCP : ((rs_conn *)out[0])->ops->id;
            rs_sock_open_stat(s, rs_host->stat_open(s->nfds ? s->fds[0] : s->fd, s->role, transport, (int)out[1]));
        }
        if (res < 0) {
            set_broken(s, -res);
        } else if (res == RS_STEP_RING) {
            pthread_mutex_lock(&fork_gate);
            adopt_ring(s, (rs_conn *)out[0]);
            __atomic_store_n(&s->state, RS_RING, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&fork_gate);
        } else if (res == RS_STEP_PRE_RX) {
            s->conn = (rs_conn *)out[0];
            s->conn->fd = s->fd;
            __atomic_store_n(&s->state, RS_PRE_RX, __ATOMIC_RELEASE);
        } else if (res == RS_STEP_TCP) {
            /* a client's HELLO that met the end of the stream may have provoked a reset */
            s->hello_met_eof = st == RS_CLIENT_HS && out[1] == RS_REASON_CLOSED_DURING_HANDSHAKE;
            __atomic_store_n(&s->state, RS_PLAIN, __ATOMIC_RELEASE);
        } else {
            r = 0;
            s->hello_pending = res == RS_STEP_CONNECTING;
        }
        if (r && s->shut_pending) shut_pending_now(s);
    }
    pthread_mutex_unlock(&s->lock);
    return r;
}

int rs_sock_step(struct rs_sock *s, int wait_ms) { return step(s, wait_ms, 0); }

int rs_sock_in_handshake(struct rs_sock *s)
{
    int st = rs_sock_state(s);
    return st == RS_CLIENT_HS || st == RS_SERVER_HS || (st == RS_RING && RS_GET(s->conn->rx.pre.active));
}

void rs_sock_settle(struct rs_sock *s)
{
    rs_sock_step(s, 0);
    if (rs_sock_state(s) == RS_RING) rs_pre_settle(s->conn);
}

/* An rdma connection's transport failed and it goes on over TCP: `rdmasock stat` shows
 * transport tcp with reason rdma_failed, and the log says why (once per connection). */
void rs_sock_note_fallback(struct rs_sock *s)
{
    struct rs_stat_slot *row = s->stat;
    if (!row || __atomic_load_n(&row->transport, __ATOMIC_RELAXED) == RS_TRANSPORT_TCP) return;
    __atomic_store_n(&row->transport, RS_TRANSPORT_TCP, __ATOMIC_RELAXED);    /* a fork may copy it */
    __atomic_store_n(&row->reason, RS_GET(s->conn->fb_reason) ? RS_GET(s->conn->fb_reason) : RS_REASON_RDMA_FAILED,
                     __ATOMIC_RELAXED);
    if (rs_host && rs_host->fell_back) rs_host->fell_back(s->fd, s->role, s->conn);
}

/* ---- I/O --------------------------------------------------------------------------- */

/* The wait a blocking call may make: 0 (non-blocking), the socket's timeout, or -1. */
static int call_timeout(struct rs_sock *s, int flags, int timeo)
{
    if (s->nonblock || (flags & MSG_DONTWAIT)) return 0;
    return timeo;
}

/* Where a socket counts the payload it moves: in its row of the statistics table (which
 * `rdmasock stat` reads from another process) once it has one, before that in its own
 * counts (rs_sock_open_stat moves them).  One locked add per call; TCP_INFO adds the two up
 * (rs_sock_tcp_info). */
static inline uint64_t *rx_count(struct rs_sock *s)
{
    struct rs_stat_slot *k = s->stat;
    return k ? &k->rx_bytes : &s->rx_bytes;
}

static inline uint64_t *tx_count(struct rs_sock *s)
{
    struct rs_stat_slot *k = s->stat;
    return k ? &k->tx_bytes : &s->tx_bytes;
}

/* Settles what can be settled of a handshake before data moves.  Returns the state to act
 * on, or -errno (-EAGAIN: not yet). */
static int prepare(struct rs_sock *s, int for_write, int timeout)
{
    int st = rs_sock_state(s);
    if (st == RS_CLIENT_HS) {
        if (rs_sock_step(s, for_write ? 0 : timeout)) return rs_sock_state(s);
        if (for_write && !s->hello_pending) return RS_CLIENT_HS;   /* a preamble frame */
        return -EAGAIN;
    }
    if (st == RS_SERVER_HS) {
        /* The server must not send first: a write waits for the HELLO, bounded by the
         * handshake limit and the socket's own send timeout. */
        int wait = for_write ? RS_HS_WRITE_WAIT_MS : timeout;
        if (for_write && timeout > 0 && timeout < wait) wait = timeout;
        if (rs_sock_step(s, wait)) return rs_sock_state(s);
        if (for_write && wait == RS_HS_WRITE_WAIT_MS) {
            pthread_mutex_lock(&s->lock);
            if (s->state == RS_SERVER_HS) {
                s->reason = RS_REASON_HANDSHAKE_TIMEOUT;
                set_broken(s, ETIMEDOUT);
            }
            pthread_mutex_unlock(&s->lock);
            return -ETIMEDOUT;
        }
        return -EAGAIN;
    }
    return st;
}

static void end_preamble(struct rs_sock *s)
{
    pthread_mutex_lock(&s->lock);
    if (s->state == RS_PRE_RX && !s->conn->rx.pre.active) {
        rs_conn *c = s->conn;
        __atomic_store_n(&s->state, RS_PLAIN, __ATOMIC_RELEASE);
        s->conn = NULL;
        rs_conn_free(c);
    }
    pthread_mutex_unlock(&s->lock);
}

/* The handshake took part of a read's timeout and the socket stayed TCP: the kernel's read
 * would start its SO_RCVTIMEO afresh, so wait here for the rest, then let it read. */
static ssize_t plain_within(struct rs_sock *s, uint64_t deadline, int *plain)
{
    struct pollfd p = { .fd = s->fd, .events = POLLIN };
    int r = rs_sys_poll(&p, 1, rs_ms_until(deadline));
    if (r < 0) return r;                 /* -EINTR: a call with a timeout is never restarted */
    if (r == 0) return -EAGAIN;
    *plain = 1;
    return 0;
}

ssize_t rs_sock_recv(struct rs_sock *s, void *buf, size_t n, int flags, int *plain)
{
    return rs_sock_recv_within(s, buf, n, flags, call_timeout(s, flags, s->rcvtimeo_ms), plain);
}

ssize_t rs_sock_recv_within(struct rs_sock *s, void *buf, size_t n, int flags, int timeout, int *plain)
{
    /* The error queue (transmit timestamps, errors) is the kernel socket's, never stream. */
    if (flags & MSG_ERRQUEUE) { *plain = 1; return 0; }
    uint64_t deadline = rs_deadline(timeout);
    int entry = rs_sock_state(s), st = prepare(s, 0, timeout);
    *plain = 0;
    if (st < 0) return st;
    if (st == RS_BROKEN) return -RS_GET(s->err);
    int waited = timeout > 0 && (entry == RS_CLIENT_HS || entry == RS_SERVER_HS);
    if (waited) timeout = rs_ms_until(deadline);
    if (st != RS_RING && st != RS_PRE_RX) {
        if (waited) return plain_within(s, deadline, plain);
        *plain = 1;
        return 0;
    }
    /* Urgent data only ever travels over TCP (send_urgent): the kernel has it, or none. */
    if (flags & MSG_OOB) { *plain = 1; return 0; }
    ssize_t r = rs_recv(s->conn, buf, n, flags & (MSG_PEEK | MSG_WAITALL | MSG_DONTWAIT | MSG_TRUNC), timeout);
    if (st == RS_PRE_RX && !RS_GET(s->conn->rx.pre.active)) end_preamble(s);
    else if (__builtin_expect(RS_GET(s->conn->fb), 0)) rs_sock_note_fallback(s);
    if (r > 0 && !(flags & MSG_PEEK)) __atomic_fetch_add(rx_count(s), (uint64_t)r, __ATOMIC_RELAXED);
    return r;
}

/* A client's writes before the server's answer travel as preamble frames, each under the
 * lock so another thread's SWITCH never lands inside one; waiting for room happens outside
 * the lock, so a reader thread can take the answer meanwhile.  A blocking call goes on
 * until all is sent or its deadline passes, as a TCP send does.  Returns the bytes sent;
 * *state is updated if the handshake finished meanwhile (the caller sends the rest). */
static ssize_t send_preamble(struct rs_sock *s, const void *buf, size_t n, uint64_t deadline, int *state)
{
    size_t sent = 0;
    int nonblock = deadline != RS_NEVER && rs_passed(deadline);
    while (sent < n) {
        pthread_mutex_lock(&s->lock);
        int st = s->state;
        /* A call that may wait writes whole frames (it waits for their tails, as TCP's
         * blocking send waits for room); a non-blocking one what the socket takes. */
        struct rs_pre_open *o = nonblock || rs_pre_is_open(&s->pre_open) ? &s->pre_open : NULL;
        ssize_t r = st == RS_CLIENT_HS ? rs_pre_send(s->fd, (const uint8_t *)buf + sent, n - sent, 1, 0, o) : 0;
        int closed = !rs_pre_is_open(&s->pre_open);
        pthread_mutex_unlock(&s->lock);
        if (st != RS_CLIENT_HS) { *state = st; break; }
        if (r > 0) {
            sent += (size_t)r;
            /* Between frames: the answer, once there (the socket is readable: nothing
             * else comes before it), ends the preamble, and the rest goes into the ring
             * rather than frame after frame into a socket that keeps taking them. */
            struct pollfd p = { .fd = s->fd, .events = POLLIN };
            if (closed && rs_sys_poll(&p, 1, 0) > 0 && step(s, 0, 1)) { *state = rs_sock_state(s); break; }
            continue;
        }
        if (r != -EAGAIN && r != -EINTR) return sent ? (ssize_t)sent : r;
        if (nonblock || rs_passed(deadline)) return sent ? (ssize_t)sent : -EAGAIN;
        int w = rs_sleep_fd(s->fd, POLLOUT | POLLIN, rs_earlier(deadline, rs_deadline(50)));
        if (w < 0) return sent ? (ssize_t)sent : w;
        if (rs_sock_step(s, 0)) { *state = rs_sock_state(s); break; }
    }
    return (ssize_t)sent;
}

/* A call that must travel the way the data will (a half-close, urgent data) first waits,
 * bounded, for a handshake to end; one that does not end leaves the socket plain TCP.
 * Returns the state. */
static int settle_handshake(struct rs_sock *s)
{
    int st = rs_sock_state(s);
    if (st != RS_CLIENT_HS && st != RS_SERVER_HS) return st;
    if (!rs_sock_step(s, RS_HS_WRITE_WAIT_MS)) {
        pthread_mutex_lock(&s->lock);
        if (s->state == RS_CLIENT_HS || s->state == RS_SERVER_HS) {
            if (rs_host && rs_host->drop) rs_host->drop(s->handle);
            s->handle = -1;
            s->reason = RS_REASON_HANDSHAKE_TIMEOUT;
            __atomic_store_n(&s->state, RS_PLAIN, __ATOMIC_RELEASE);
            if (s->shut_pending) shut_pending_now(s);
        }
        pthread_mutex_unlock(&s->lock);
    }
    return rs_sock_state(s);
}

/* A write only the kernel can make (urgent data, splice): the connection moves to TCP
 * first (docs/PROTOCOL.md 6.8), behind every byte written before, and the caller's own
 * call then goes to the kernel (*plain). */
int rs_sock_move_tx(struct rs_sock *s, int reason, int flags, int *plain)
{
    *plain = 1;
    if (settle_handshake(s) != RS_RING) return 0;
    int r = rs_fb_move_tx(s->conn, reason, call_timeout(s, flags, s->sndtimeo_ms));
    rs_sock_note_fallback(s);
    if (r == 0) return 0;
    *plain = 0;
    if (r == -EPIPE && !(flags & MSG_NOSIGNAL)) raise(SIGPIPE);
    return r;
}

int rs_tx_stamps_asked(int level, int name, const void *val, size_t len)
{
    int flags;
    if (level != SOL_SOCKET || name != SO_TIMESTAMPING || !val || len < sizeof flags) return 0;
    memcpy(&flags, val, sizeof flags);          /* an int, or struct so_timestamping's first field */
    return (flags & SOF_TIMESTAMPING_TX_RECORD_MASK) != 0;
}

ssize_t rs_sock_send(struct rs_sock *s, const void *buf, size_t n, int flags, int *plain)
{
    return rs_sock_send_within(s, buf, n, flags, call_timeout(s, flags, s->sndtimeo_ms), plain);
}

ssize_t rs_sock_send_within(struct rs_sock *s, const void *buf, size_t n, int flags, int timeout, int *plain)
{
    /* urgent data exists only in TCP: the kernel marks the byte, as it always does */
    if (__builtin_expect(flags & MSG_OOB, 0)) return rs_sock_move_tx(s, RS_REASON_URGENT_DATA, flags, plain);
    uint64_t deadline = rs_deadline(timeout);
    int st = prepare(s, 1, timeout);
    *plain = 0;
    if (st < 0) return st;
    if (st == RS_BROKEN) return -RS_GET(s->err);
    if (timeout > 0) timeout = rs_ms_until(deadline);    /* what the handshake left of it */
    ssize_t r = 0, pre = 0;
    if (st == RS_CLIENT_HS) {
        r = pre = send_preamble(s, buf, n, deadline, &st);
        /* The handshake may have ended partway: the rest goes into the ring; after a
         * fallback or failure the count so far is the answer (the next call goes on). */
        if (r < 0 || (size_t)r == n || st != RS_RING) {
            if (r == 0 && st == RS_BROKEN) return -RS_GET(s->err);
            if (r == 0 && st != RS_CLIENT_HS && st != RS_RING) { *plain = 1; return 0; }
            st = RS_CLIENT_HS;
        } else if (timeout > 0) {
            timeout = rs_ms_until(deadline);
        }
    }
    if (st == RS_BROKEN) return -RS_GET(s->err);
    if (st == RS_RING) {
        r = rs_send(s->conn, (const uint8_t *)buf + pre, n - (size_t)pre, timeout == 0, timeout);
        if (pre) r = r < 0 ? pre : r + pre;
        if (__builtin_expect(RS_GET(s->conn->fb), 0)) rs_sock_note_fallback(s);
        uint64_t spilled = __atomic_load_n(&s->conn->tx.spilled, __ATOMIC_RELAXED);
        if (s->stat && __builtin_expect(spilled != s->stat->tx_spilled, 0))
            __atomic_store_n(&s->stat->tx_spilled, spilled, __ATOMIC_RELAXED);
    } else if (st != RS_CLIENT_HS) {
        *plain = 1;
        return 0;
    }
    if (r == -EPIPE && !(flags & MSG_NOSIGNAL)) raise(SIGPIPE);
    if (r == -EAGAIN || (r >= 0 && (size_t)r < n)) __atomic_add_fetch(&s->write_stops, 1, __ATOMIC_RELAXED);
    if (r > 0) __atomic_fetch_add(tx_count(s), (uint64_t)r, __ATOMIC_RELAXED);
    return r;
}

int rs_sock_shutdown(struct rs_sock *s, int how, int *plain)
{
    return rs_sock_shutdown_nonblock(s, how, s->nonblock, plain);
}

/* A blocking half-close during the handshake waits for it, bounded (settle_handshake): it
 * must travel the way the data will.  A non-blocking one must not wait (an event loop
 * may be what runs the peer): it is noted, and done when the handshake ends
 * (shut_pending, rs_sock_step), which the caller's next call on the socket drives. */
int rs_sock_shutdown_nonblock(struct rs_sock *s, int how, int nonblock, int *plain)
{
    *plain = 0;
    if (how != SHUT_RD && how != SHUT_WR && how != SHUT_RDWR) { *plain = 1; return 0; }   /* the kernel's EINVAL */
    int st = rs_sock_state(s);
    if (st == RS_CLIENT_HS && how != SHUT_RD && end_inside_frame(s)) {
        if (how == SHUT_WR) return 0;
        how = SHUT_RD;
    }
    if (nonblock && (st == RS_CLIENT_HS || st == RS_SERVER_HS) && !rs_sock_step(s, 0)) {
        pthread_mutex_lock(&s->lock);
        int open = s->state == RS_CLIENT_HS || s->state == RS_SERVER_HS;
        if (open) s->shut_pending |= (how != SHUT_WR ? 1 : 0) | (how != SHUT_RD ? 2 : 0);
        pthread_mutex_unlock(&s->lock);
        if (open) return 0;
    }
    if (settle_handshake(s) != RS_RING) { *plain = 1; return 0; }
    if (how != SHUT_WR) rs_shutdown_rd(s->conn);
    if (how != SHUT_RD) rs_send_fin(s->conn);
    return 0;
}

/* After the peer's FIN record no MOVED record follows (its direction is over; it closes
 * its kernel side once it follows, rs_fallback.c): what the socket still holds before
 * the end of the stream are doorbell bytes, which the new program must not read.  1 when
 * the socket is at its end, 0 not yet, -EBADE if a byte is not a doorbell. */
static int drain_to_end(rs_conn *c)
{
    uint8_t buf[256];
    for (int rounds = 0; rounds < 64; rounds++) {
        long n = rs_c_recv(c, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0) return 1;
        if (n < 0) return n == -EAGAIN ? 0 : 1;
        int next;
        long k = rs_bell_scan(buf, n, &next, NULL);
        if (k > 0) rs_c_recv(c, buf, (size_t)k, MSG_DONTWAIT);
        if (next >= 0) return -EBADE;
        if (k < n) return 0;
    }
    return 0;
}

/* Before exec, or before the socket is passed to another process: the new program reads
 * and writes the kernel socket and knows nothing of the ring, so a connection it gets
 * must be plain TCP by then.  Both directions move
 * (docs/PROTOCOL.md 6.8): ours at once, the peer's when its reader meets our MOVED record
 * (peer_moved).  This waits, bounded, until the stream reads straight from the socket, so
 * that the new program's first read is data (or the end), not doorbells or the peer's
 * RESYNC frame.  No engine call: the caller may be a vfork child.  0: plain TCP now (or
 * never upgraded); -EAGAIN: the peer did not follow in time; -EBADE: bytes had arrived
 * that the old program never read, which the new one cannot be handed. */
int rs_sock_to_kernel(struct rs_sock *s, int reason, int timeout_ms)
{
    if (rs_sock_state(s) != RS_RING) return 0;
    rs_conn *c = s->conn;
    uint64_t deadline = rs_deadline(timeout_ms);
    int r = rs_fb_move_tx(c, reason, timeout_ms);
    if (r < 0) return r;
    for (;;) {
        if (rs_pre_settle(c) && rs_rx_reach_tcp(c)) break;
        if (rs_rx_available(c) > 0) return -EBADE;
        if (RS_GET(c->rx.fin_seen) && !rs_rx_on_tcp(c)) {
            int end = drain_to_end(c);
            if (end) return end < 0 ? end : 0;
        }
        if (rs_passed(deadline)) return -EAGAIN;
        rs_sleep_fd(s->fd, POLLIN, rs_earlier(deadline, rs_deadline(10)));
    }
    return 0;
}

/* SIOCATMARK: urgent data comes only over TCP, behind everything the ring carried, so the
 * mark can be reached only once the stream reads from the socket; until then the answer
 * is "not at the mark", from then on the kernel's (*plain). */
int rs_sock_at_mark(struct rs_sock *s, int *plain)
{
    *plain = rs_sock_state(s) != RS_RING || rs_rx_reach_tcp(s->conn);
    return 0;
}

/* SO_ERROR as the kernel reported (and cleared) it.  While a client's handshake is open
 * and on an upgraded connection, a reset of the TCP socket can be our own doing: a HELLO,
 * SWITCH or doorbell byte reaching a peer that had already closed, where TCP would have
 * sent nothing (a server that accepts and closes at once; the handshake then ends as
 * plain TCP, closed_during_handshake).  The stream's own resets reach
 * the application through its reads (RESET records, docs/PROTOCOL.md 7; a handshake
 * that meets the end of the stream ends as plain TCP), so the socket's are not reported
 * here; errors of the path (refused, a timed-out keepalive) are. */
int rs_sock_so_error(struct rs_sock *s, int err)
{
    int st = rs_sock_state(s);
    if ((st == RS_RING || st == RS_CLIENT_HS || s->hello_met_eof) && (err == ECONNRESET || err == EPIPE)) return 0;
    return err;
}

/* TCP_INFO of an upgraded connection counts the stream, not the socket (rs_report.c). */
void rs_sock_tcp_info(struct rs_sock *s, void *info, unsigned len)
{
    if (rs_sock_state(s) != RS_RING) return;
    uint64_t rx = __atomic_load_n(&s->rx_bytes, __ATOMIC_RELAXED), tx = __atomic_load_n(&s->tx_bytes, __ATOMIC_RELAXED);
    if (s->stat) {
        rx += __atomic_load_n(&s->stat->rx_bytes, __ATOMIC_RELAXED);
        tx += __atomic_load_n(&s->stat->tx_bytes, __ATOMIC_RELAXED);
    }
    rs_conn_tcp_info(s->conn, rx, tx, info, len);
}

/* The application's file status flags (F_SETFL, already done; or as found).  The hooks
 * answer readiness from the ring, so doorbells of consumed records may stay unread
 * (lazy tidy), except where a doorbell is all there is to see: a socket registered with
 * epoll in a way we could not take over, or one that signals SIGIO (O_ASYNC), whose
 * program learns of each new record only from a new doorbell's arrival. */
void rs_sock_flags_seen(struct rs_sock *s, int fl)
{
    s->nonblock = (fl & O_NONBLOCK) != 0;
    if (!s->conn) return;
    s->conn->rx.lazy_tidy = !s->ep_unknown && !(fl & O_ASYNC);
    if (!(fl & O_ASYNC) != !s->conn->rx.bell_every) rs_rx_bell_every(s->conn, fl & O_ASYNC);
}

/* The application set an option on the kernel socket (already done): what we mirror. */
void rs_sock_setopt_seen(struct rs_sock *s, int level, int name, const void *val, unsigned len)
{
    if (s->conn) rs_conn_sockopt_set(s->conn);        /* receive options (timestamps, TCP_INQ) */
    if (level == SOL_SOCKET && name == SO_SNDBUF && rs_sock_state(s) == RS_RING) cap_window(s);
    if (level != SOL_SOCKET || (name != SO_RCVTIMEO && name != SO_SNDTIMEO) || !val || len < sizeof(struct timeval))
        return;
    const struct timeval *tv = val;
    long long ms = (long long)tv->tv_sec * 1000 + (tv->tv_usec + 999) / 1000;
    int v = ms <= 0 ? -1 : ms > 0x7fffffff ? 0x7fffffff : (int)ms;
    if (name == SO_RCVTIMEO) s->rcvtimeo_ms = v;
    else s->sndtimeo_ms = v;
}
