/* rs_hooks_epoll.c - epoll on upgraded sockets.
 *
 * The kernel registration stays the application's (doorbells make it truthful for
 * EPOLLIN); per epoll instance we remember which members are tracked sockets, so that
 * epoll_wait can answer from their rings and spin before sleeping.  A set is reference
 * counted (an epoll_wait in progress keeps it, even if another thread closes the epoll
 * descriptor) and has its own lock, taken for every look at its members, so epoll_ctl
 * in one thread never changes the list under an epoll_wait in another.
 *
 * et_mark: for EPOLLET, the producer's byte count when we last reported the ring readable
 * (an edge is new data since then).  out_mark: for EPOLLET, the socket's count of writes
 * that stopped short (rs_sock write_stops: EAGAIN, or less than asked) when we last
 * reported EPOLLOUT.  TCP makes an EPOLLOUT edge of its own only after a write found no
 * room: then room in the ring is an edge, which the kernel's socket, always with room,
 * never makes.  And the kernel's socket is woken by our own bytes too (the handshake's,
 * doorbells), reporting EPOLLOUT at each such wake-up, even once those bytes are read
 * (then EPOLLOUT alone): such a wake-up is no edge unless a write stopped short since.
 * disarmed: EPOLLONESHOT fired, until EPOLL_CTL_MOD.
 *
 * Event bells (rs_bells.c): before a kernel sleep each member's bell is added to the
 * instance (once per instance, recorded in the connection), with data RS_BELL_EPOLL_DATA(fd).
 * The kernel's events with such data only say "look at fd's ring": they are never
 * returned.  `id` tells an instance from a later one under the same number.
 *
 * Quiet members (a clear bit in `awake`): armed for a kernel sleep with nothing to read,
 * and not heard of since.  An armed ring stays armed until its peer rings (the bell or a
 * doorbell byte: a kernel event naming the member), so its looks are skipped: a server's
 * wait looks at the rings it heard of, not at all of a thousand (quiet_trusted says when
 * the bits may be believed).
 *
 * others: registrations of descriptors that are not tracked sockets (a listener, a pipe),
 * counted from their EPOLL_CTL_ADD to their EPOLL_CTL_DEL; one closed without a DEL stays
 * counted.  While it is 0 the kernel has nothing to say that the rings do not, and a wait
 * may sleep on the members' shared words (FUTEX_WAKE) instead of in the kernel. */
#include "rs_preload.h"
#include "../rs_fdmap.h"
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct ep_member { int fd; uint32_t events; epoll_data_t data; uint64_t et_mark, out_mark; uint8_t disarmed, idle_waits; unsigned idle_seen; };
struct ep_set {
    int refs;                  /* the map's + waits in progress; 0: free */
    pthread_mutex_t lock;
    int n, cap;
    int others;
    uint32_t id;               /* unique in the process: instances reuse numbers */
    uint8_t bells;             /* an event bell was added to this instance */
    unsigned waits;            /* epoll_waits on it so far (whose turn the kernel's look is) */
    uint8_t scan_ok;           /* the last ep_scan holds (ep_scan_kept), and what it found: */
    uint8_t scan_apart, scan_lt_out;
    uint64_t scan_ns;
    uint8_t quiet_ok;          /* the members' quiet flags hold (quiet_trusted) */
    uint8_t no_quiet;          /* none quiet until a member leaves: a bell was renamed */
    uint64_t quiet_gen, quiet_ns;   /* rs_silent_changes() and the time the flags were reset */
    struct ep_member *m;
    uint64_t *awake;           /* bit i: member i is to be looked at (not quiet); cap bits */
    int *slot;                 /* slot[fd] (fd < slots): 1 + the index of fd's member, 0 none; event
                                * loops change a member's events at every request, in sets of */
    int slots;                 /* a thousand members */
    struct ep_set *free_next;
};

static struct rs_fdmap sets = RS_FDMAP_INIT;       /* epoll descriptor -> struct ep_set */
static pthread_mutex_t sets_lock = PTHREAD_MUTEX_INITIALIZER;   /* creating and freeing sets */
static struct ep_set *free_sets;
static uint32_t set_ids;
static int bells_added;        /* an event bell was added to some instance: the kernel's events
                                * may carry RS_BELL_TAG even where we do not look at rings */

/* The index of fd's member, or s->n (caller holds the set's lock). */
static int find_member(const struct ep_set *s, int fd)
{
    return fd >= 0 && fd < s->slots && s->slot[fd] ? s->slot[fd] - 1 : s->n;
}

static inline int is_quiet(const struct ep_set *s, int i) { return !(s->awake[i >> 6] >> (i & 63) & 1); }

static inline void set_quiet(struct ep_set *s, int i, int quiet)
{
    uint64_t bit = 1ull << (i & 63);
    if (quiet) s->awake[i >> 6] &= ~bit;
    else s->awake[i >> 6] |= bit;
}

/* The first member from index i on to look at: any, or with `trust` one not quiet; s->n
 * if none. */
static int next_awake(const struct ep_set *s, int i, int trust)
{
    if (!trust || i >= s->n) return i < s->n ? i : s->n;
    int w = i >> 6, words = (s->n + 63) >> 6;
    uint64_t bits = s->awake[w] & (~0ull << (i & 63));
    while (!bits) {
        if (++w >= words) return s->n;
        bits = s->awake[w];
    }
    int j = (w << 6) + __builtin_ctzll(bits);
    return j < s->n ? j : s->n;
}

/* Removes the events of event bells from ev[0..k); returns how many remain, *seen how
 * many were removed.  The members they name are no longer quiet (s: the set, its lock
 * held, or NULL). */
static int strip_bells(struct ep_set *s, struct epoll_event *ev, int k, int *seen)
{
    int n = 0;
    *seen = 0;
    for (int j = 0; j < k; j++) {
        if (RS_IS_BELL(ev[j].data.u64)) {
            ++*seen;
            int i = s ? find_member(s, RS_BELL_FD(ev[j].data.u64)) : 0;
            if (s && i < s->n) {
                set_quiet(s, i, 0);
                s->m[i].idle_waits = 0;
            }
            continue;
        }
        ev[n++] = ev[j];
    }
    return n;
}

/* fd's member is (i >= 0) or is no longer (i < 0) at index i; 0, or -1 without memory
 * for the index (then the member is not kept). */
static int set_slot(struct ep_set *s, int fd, int i)
{
    if (fd >= s->slots) {
        if (i < 0) return 0;
        int n = s->slots ? s->slots : 64;
        while (n <= fd) n *= 2;
        int *p = realloc(s->slot, (size_t)n * sizeof *p);
        if (!p) return -1;
        memset(p + s->slots, 0, (size_t)(n - s->slots) * sizeof *p);
        s->slot = p;
        s->slots = n;
    }
    s->slot[fd] = i + 1;
    return 0;
}

static void set_put(struct ep_set *s)
{
    if (__atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL)) return;
    pthread_mutex_lock(&sets_lock);
    for (int i = 0; i < s->n; i++) set_slot(s, s->m[i].fd, -1);
    s->n = 0;
    s->free_next = free_sets;
    free_sets = s;
    pthread_mutex_unlock(&sets_lock);
}

/* The set of epfd with a reference, or NULL.  Sets are never given back to malloc, so a
 * pointer read from the map stays safe to look at (see rs_sock_of). */
static struct ep_set *set_get(int epfd)
{
    for (int tries = 0; tries < 100; tries++) {
        struct ep_set *s = rs_fdmap_get(&sets, epfd);
        if (!s) return NULL;
        int r = __atomic_load_n(&s->refs, __ATOMIC_ACQUIRE);
        if (!r || !__atomic_compare_exchange_n(&s->refs, &r, r + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
        if (rs_fdmap_get(&sets, epfd) == s) return s;
        set_put(s);
    }
    return NULL;
}

static struct ep_set *set_create(int epfd)
{
    pthread_mutex_lock(&sets_lock);
    struct ep_set *s = rs_fdmap_get(&sets, epfd);
    if (!s) {
        s = free_sets;
        if (s) free_sets = s->free_next;
        else if ((s = calloc(1, sizeof *s))) pthread_mutex_init(&s->lock, NULL);
        if (s) {
            s->n = s->others = 0;
            s->bells = s->scan_ok = s->quiet_ok = s->no_quiet = 0;
            s->id = __atomic_add_fetch(&set_ids, 1, __ATOMIC_RELAXED);
            __atomic_store_n(&s->refs, 1, __ATOMIC_RELEASE);          /* the map's */
            if (rs_fdmap_swap(&sets, epfd, s) == RS_FDMAP_FAIL) {
                s->refs = 0;
                s->free_next = free_sets;
                free_sets = s;
                s = NULL;
            }
        }
    }
    pthread_mutex_unlock(&sets_lock);
    return s ? set_get(epfd) : NULL;
}

static void scan_add(struct ep_set *s, int i);

static void drop_member(struct ep_set *s, int fd)
{
    int i = find_member(s, fd);
    if (i >= s->n) return;
    s->no_quiet = 0;            /* a ring under two numbers may have been one of them */
    set_slot(s, fd, -1);
    s->m[i] = s->m[--s->n];
    set_quiet(s, i, is_quiet(s, s->n));
    if (i < s->n) set_slot(s, s->m[i].fd, i);
}

int rs_ep_is_set(int fd) { return rs_fdmap_get(&sets, fd) != NULL; }

struct closed_range { unsigned first, last; };
static int in_range(int fd, const struct closed_range *r) { return (unsigned)fd >= r->first && (unsigned)fd <= r->last; }

static void forget_in(int epfd, void *p, void *arg)
{
    (void)p;
    const struct closed_range *r = arg;
    struct ep_set *s = set_get(epfd);
    if (!s) return;
    pthread_mutex_lock(&s->lock);
    if (r->first == r->last) {
        drop_member(s, (int)r->first);
    } else {
        for (int i = s->n - 1; i >= 0; i--)         /* drop_member moves the last one to i */
            if (in_range(s->m[i].fd, r)) drop_member(s, s->m[i].fd);
    }
    pthread_mutex_unlock(&s->lock);
    set_put(s);
    if (in_range(epfd, r)) {                        /* the epoll instance itself is closed */
        struct ep_set *was = rs_fdmap_swap(&sets, epfd, NULL);
        if (was && was != RS_FDMAP_FAIL) set_put(was);
    }
}

/* The descriptors first..last were closed: the kernel dropped their registrations, so do
 * we (their numbers may be reused by sockets the application registers with other data). */
void rs_ep_forget_range(unsigned first, unsigned last)
{
    struct closed_range r = { first, last };
    rs_fdmap_each(&sets, forget_in, &r);
}

void rs_ep_forget(int fd) { rs_ep_forget_range((unsigned)fd, (unsigned)fd); }

/* A registration of a tracked socket changes (caller holds the set's lock). */
static void remember_locked(struct ep_set *s, int op, int fd, const struct epoll_event *ev)
{
    int i = find_member(s, fd);
    if (op == EPOLL_CTL_DEL) {
        drop_member(s, fd);
    } else if (ev) {
        if (i == s->n && s->n == s->cap) {
            int cap = s->cap ? s->cap * 2 : 8;
            size_t had = ((size_t)s->cap + 63) / 64, words = ((size_t)cap + 63) / 64;
            uint64_t *a = words > had ? realloc(s->awake, words * sizeof *a) : s->awake;
            if (a) {
                memset(a + had, 0, (words - had) * sizeof *a);
                s->awake = a;
                struct ep_member *m = realloc(s->m, (size_t)cap * sizeof *m);
                if (m) { s->m = m; s->cap = cap; }
            }
        }
        if (i == s->n && i < s->cap && set_slot(s, fd, i) < 0) i = s->cap;     /* not kept: no memory */
        if (i < s->cap) {
            if (i == s->n) s->n++;
            s->m[i].fd = fd; s->m[i].events = ev->events; s->m[i].data = ev->data;
            s->m[i].et_mark = s->m[i].out_mark = (uint64_t)-1; s->m[i].disarmed = s->m[i].idle_waits = 0;
            s->m[i].idle_seen = s->waits;
            set_quiet(s, i, 0);
            scan_add(s, i);
        }
    }
}

/* The kernel's epoll_ctl for a tracked socket (or any DEL), and our record of it, under
 * the set's lock: a wait in another thread changes the kernel's registration too (a
 * fired one-shot turned off, or armed again when its event was not the program's), with
 * the events and data it has on record.  Between the program's change and our record of
 * it, that would undo the change (a writer's EPOLLOUT lost, and with it its wake-up). */
static int ep_ctl_remember(int epfd, int op, int fd, struct epoll_event *ev)
{
    struct ep_set *s = op == EPOLL_CTL_DEL ? set_get(epfd) : set_create(epfd);
    if (!s) return rs_real.epoll_ctl(epfd, op, fd, ev);
    pthread_mutex_lock(&s->lock);
    int r = rs_real.epoll_ctl(epfd, op, fd, ev), e = errno;
    if (r == 0) remember_locked(s, op, fd, ev);
    pthread_mutex_unlock(&s->lock);
    set_put(s);
    errno = e;
    return r;
}

/* Registrations of a socket made before it was tracked (registered, then connected, as
 * some event loops do).  connect adopts them (rs_ep_adopt): without that, waits on the
 * socket would go to the kernel alone, never arm, and a reader that reads until EAGAIN
 * would not be woken.  One registration per fd is kept; a second epoll instance makes
 * it unknown (n = 2). */
struct ep_early { int epfd; uint32_t events; epoll_data_t data; uint8_t n; };
static struct rs_fdmap early = RS_FDMAP_INIT;      /* fd -> struct ep_early (kept once made) */
static pthread_mutex_t early_lock = PTHREAD_MUTEX_INITIALIZER;

static void ep_note_early(int epfd, int op, int fd, const struct epoll_event *ev)
{
    pthread_mutex_lock(&early_lock);
    struct ep_early *e = rs_fdmap_get(&early, fd);
    if (!e && op != EPOLL_CTL_DEL && ev && (e = calloc(1, sizeof *e)) && rs_fdmap_swap(&early, fd, e) == RS_FDMAP_FAIL) {
        free(e);
        e = NULL;
    }
    if (e && op == EPOLL_CTL_DEL) {
        if (e->n == 1 && e->epfd == epfd) e->n = 0;
    } else if (e && ev && e->n != 2) {
        if (e->n == 1 && e->epfd != epfd) e->n = 2;
        else { e->epfd = epfd; e->events = ev->events; e->data = ev->data; e->n = 1; }
    }
    pthread_mutex_unlock(&early_lock);
}

/* fd was closed or is new (accepted): no registration of an earlier file is its own. */
void rs_ep_fd_fresh(int fd)
{
    struct ep_early *e = rs_fdmap_get(&early, fd);
    if (e && __atomic_load_n(&e->n, __ATOMIC_RELAXED)) {
        pthread_mutex_lock(&early_lock);
        e->n = 0;
        pthread_mutex_unlock(&early_lock);
    }
}

static void fresh_in(int fd, void *p, void *arg)
{
    (void)p;
    if (in_range(fd, arg)) rs_ep_fd_fresh(fd);
}

void rs_ep_fresh_range(unsigned first, unsigned last)
{
    struct closed_range r = { first, last };
    rs_fdmap_each(&early, fresh_in, &r);
}

/* fd just became tracked: take over its earlier registration.  Returns 1 if every epoll
 * registration of the socket is now known (or there is none), 0 if not: a one-shot (its
 * state cannot be read back without re-arming it) or more than one epoll instance. */
int rs_ep_adopt(int fd)
{
    struct ep_early e = { 0 };
    pthread_mutex_lock(&early_lock);
    struct ep_early *p = rs_fdmap_get(&early, fd);
    if (p) { e = *p; p->n = 0; }
    pthread_mutex_unlock(&early_lock);
    if (!e.n) return 1;
    if (e.n == 2 || (e.events & EPOLLONESHOT)) return 0;
    /* Is it still registered there (the epoll fd may have been closed and its number
     * reused)?  MOD to the same events and data changes nothing else. */
    struct epoll_event ev = { .events = e.events, .data = e.data };
    if (ep_ctl_remember(e.epfd, EPOLL_CTL_MOD, fd, &ev) != 0) return errno == ENOENT || errno == EBADF || errno == EINVAL;
    return 1;
}

/* An untracked descriptor joins (op ADD) or leaves (DEL) epfd's registrations.  A wait
 * asleep on the members' words is woken to look again: it now has the kernel to ask. */
static void ep_count_other(int epfd, int op)
{
    if (op != EPOLL_CTL_ADD && op != EPOLL_CTL_DEL) return;
    struct ep_set *s = op == EPOLL_CTL_ADD ? set_create(epfd) : set_get(epfd);
    if (!s) return;
    pthread_mutex_lock(&s->lock);
    if (op == EPOLL_CTL_DEL) {
        if (s->others > 0) s->others--;
    } else if (s->others++ == 0) {
        for (int i = 0; i < s->n; i++) {
            struct rs_sock *k = rs_ring_sock(s->m[i].fd);
            if (!k) continue;
            if (k->conn->word_wake_ok) rs_word_raise(&k->conn->rx.ctl->data_seq);
            rs_sock_put(k);
        }
    }
    pthread_mutex_unlock(&s->lock);
    set_put(s);
}

RS_EXPORT int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (rs_in_engine) return rs_real.epoll_ctl(epfd, op, fd, ev);
    int tracked = rs_is_tracked(fd);
    int r = tracked || op == EPOLL_CTL_DEL ? ep_ctl_remember(epfd, op, fd, ev) : rs_real.epoll_ctl(epfd, op, fd, ev);
    if (r == 0 && !tracked) {
        int e = errno;
        ep_note_early(epfd, op, fd, ev);
        ep_count_other(epfd, op);
        errno = e;
    }
    return r;
}

static inline size_t data_hash(uint64_t x) { return (size_t)((x * 0x9E3779B97F4A7C15ull) >> 32); }

/* Quiet members are kept in sets of more than RS_EP_QUIET_MIN members, where a look at every
 * ring is the server's main cost (a thousand connections: most of redis-server's CPU);
 * there a member whose ring was found empty in RS_EP_ARM_AFTER waits in a row is armed
 * on the spot (arm_member): from then on its peer's next record rings its bell, and looks
 * pass it over.  A smaller set is cheaper to look at than to ring: with a hundred busy
 * connections the looks cost less than a bell per request did (redis GET -c 100 slowed
 * down with them), and a program waiting for one peer that answers within its spin must
 * not make that peer ring. */
#define RS_EP_QUIET_MIN 256
#define RS_EP_ARM_AFTER 2

/* Member i was found with nothing to read by this wait (caller holds the set's lock): 1 if
 * it was by RS_EP_ARM_AFTER waits in a row (a wait that spins looks many times: it counts
 * once). */
static int idle_long_enough(struct ep_set *s, int i)
{
    struct ep_member *m = &s->m[i];
    if (m->idle_seen == s->waits) return 0;
    m->idle_seen = s->waits;
    return ++m->idle_waits >= RS_EP_ARM_AFTER;
}

/* Whether the members' quiet bits may be believed (caller holds the set's lock): in a large
 * set, while no bell was renamed, nothing that no doorbell announces happened (rs_silent_changes), for
 * 50 ms at most.  Otherwise every member is awake again and its count starts anew: each
 * is looked at and armed again (a thousand arms: well under 1% of a CPU at that rate),
 * which also bounds what a change that slipped past all this would cost. */
static int quiet_trusted(struct ep_set *s)
{
    if (s->no_quiet || s->n <= RS_EP_QUIET_MIN) {
        s->quiet_ok = 0;
        return 0;
    }
    uint64_t gen = rs_silent_changes(), now = rs_now_ns();
    if (s->quiet_ok && gen == s->quiet_gen && now - s->quiet_ns <= 50000000u) return 1;
    for (int w = 0; w < (s->n + 63) >> 6; w++) s->awake[w] = ~0ull;
    for (int i = 0; i < s->n; i++) s->m[i].idle_waits = 0;
    s->quiet_ok = 1;
    s->quiet_gen = gen;
    s->quiet_ns = now;
    return 1;
}

/* Arms member m, whose ring is c's, for a kernel sleep (caller holds the set's lock); with
 * `trust` (quiet_trusted) marks it quiet if it was armed with nothing to read and nothing
 * but its peer can change that.  Returns rs_ring_arm's answer: 1 ready after all. */
static int arm_member(int epfd, struct ep_set *s, int i, rs_conn *c, int trust)
{
    struct ep_member *m = &s->m[i];
    /* a wait for input: the member's event bell wakes this instance too, if it has one (not
     * for a fired one-shot, which nothing may wake until EPOLL_CTL_MOD) */
    int bell = (m->events & EPOLLIN) && !m->disarmed && m->fd < (int)RS_BELL_FD_MASK ?
               rs_bell_in_epoll(c, epfd, s->id, m->fd) : 0;
    if (bell == 2) {
        /* the instance's reports named another member for this ring until now */
        s->no_quiet = 1;
        s->quiet_ok = 0;
        trust = 0;
    }
    if (bell && !s->bells) { s->bells = 1; __atomic_store_n(&bells_added, 1, __ATOMIC_RELAXED); }
    /* EPOLLOUT too: a full ring asks its reader for a credit doorbell, which wakes the
     * kernel's wait (edge-triggered waiters have no other wake-up) */
    int r = rs_ring_arm(c, (m->events & EPOLLIN ? POLLIN : 0) | (m->events & EPOLLOUT ? POLLOUT : 0), bell);
    set_quiet(s, i, trust && !r && !m->disarmed && (m->events & (EPOLLIN | EPOLLOUT)) == EPOLLIN &&
                    !RS_GET(c->rx.pre.active) && !rs_fb_tx_pending(c));
    return r;
}

/* Events from the rings of the tracked members that the kernel did not report (caller
 * holds the set's lock). */
static int ep_from_rings(int epfd, struct ep_set *s, struct epoll_event *out, int have, int max)
{
    int n = have, trust = quiet_trusted(s);
    for (int i = next_awake(s, 0, trust); i < s->n && n < max; i = next_awake(s, i + 1, trust)) {
        if (s->m[i].disarmed) continue;
        struct rs_sock *k = rs_ring_sock(s->m[i].fd);
        if (!k) continue;
        rs_conn *c = k->conn;
        uint64_t stops = __atomic_load_n(&k->write_stops, __ATOMIC_RELAXED), produced = 0;
        int et = s->m[i].events & EPOLLET;
        short re = 0, want = 0;
        /* a set may hold a thousand idle members: the locked looks only where a record,
         * an end or an error may be */
        if ((s->m[i].events & (EPOLLIN | EPOLLRDHUP)) && rs_rx_maybe_ready(c)) {
            if (et) produced = rs_rx_produced(c);
            if (!et || produced != s->m[i].et_mark || c->rx.fin_seen)
                want |= (s->m[i].events & EPOLLIN ? POLLIN : 0) | (s->m[i].events & EPOLLRDHUP ? POLLRDHUP : 0);
        }
        /* level-triggered EPOLLOUT: the kernel's report, checked against the ring, says it;
         * edge-triggered: room after a write that found the ring full, and with an input
         * edge (the kernel reports every ready event at each wake-up) */
        if (et && (s->m[i].events & EPOLLOUT) && stops != s->m[i].out_mark) want |= POLLOUT;
        if (want) re = rs_ring_revents(c, want);
        if (et && (s->m[i].events & EPOLLOUT) && !(want & POLLOUT) && (re & (POLLIN | POLLRDHUP | POLLHUP | POLLERR)))
            re |= rs_ring_revents(c, POLLOUT) & POLLOUT;
        if (!(re & (POLLIN | POLLOUT | POLLRDHUP | POLLHUP | POLLERR))) {
            if (trust && !want && (s->m[i].events & (EPOLLIN | EPOLLOUT)) == EPOLLIN &&
                idle_long_enough(s, i))
                arm_member(epfd, s, i, c, trust);
            rs_sock_put(k);
            continue;
        }
        s->m[i].idle_waits = 0;
        rs_sock_put(k);
        int dup = 0;
        for (int j = 0; j < have && !dup; j++) dup = out[j].data.u64 == s->m[i].data.u64;
        if (dup) continue;
        out[n].events = (re & POLLIN ? EPOLLIN : 0) | (re & POLLOUT ? EPOLLOUT : 0) | (re & POLLRDHUP ? EPOLLRDHUP : 0) |
                        (re & POLLHUP ? EPOLLHUP : 0) | (re & POLLERR ? EPOLLERR : 0);
        out[n].data = s->m[i].data;
        n++;
        if (et && (re & (POLLIN | POLLRDHUP | POLLHUP | POLLERR))) s->m[i].et_mark = produced;
        if (re & POLLOUT) s->m[i].out_mark = stops;
        if (s->m[i].events & EPOLLONESHOT) {
            /* fired: disable the kernel registration too, as EPOLLONESHOT does */
            struct epoll_event off = { .events = 0, .data = s->m[i].data };
            rs_real.epoll_ctl(epfd, EPOLL_CTL_MOD, s->m[i].fd, &off);
            s->m[i].disarmed = 1;
        }
    }
    return n;
}

/* One kernel event e of member m, checked against its ring (caller holds the set's
 * lock). */
static void ep_filter_one(int epfd, struct epoll_event *e, struct ep_member *m)
{
    uint64_t stops = (uint64_t)-1;          /* an upgraded or upgrading socket's write stops */
    struct rs_sock *h = rs_handshake_sock(m->fd);
    if (h) {
        /* woken by handshake bytes: settle; a ring it ends with is judged below */
        stops = __atomic_load_n(&h->write_stops, __ATOMIC_RELAXED);
        rs_sock_settle(h);
        struct rs_sock *r = rs_ring_sock(m->fd);
        if (!r && rs_only_handshake(h)) e->events &= ~(uint32_t)(EPOLLIN | EPOLLRDNORM);
        if (r) rs_sock_put(r);
        rs_sock_put(h);
    }
    struct rs_sock *k2 = rs_ring_sock(m->fd);
    if (k2) {
        rs_conn *c = k2->conn;
        if (!h) stops = __atomic_load_n(&k2->write_stops, __ATOMIC_RELAXED);
        /* the kernel's EPOLLIN may be a doorbell of records already consumed (no tidy
         * under the preload, rs_doorbell.c), or the handshake's last bytes: the ring says
         * whether data is there; for an edge-triggered member, whether new data came since
         * its last edge (the doorbell of data already reported makes a kernel edge of its
         * own) */
        int stale_edge = (m->events & EPOLLET) && !c->rx.fin_seen && rs_rx_produced(c) == m->et_mark;
        if ((e->events & (EPOLLIN | EPOLLRDNORM)) && !(e->events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR)) &&
            (stale_edge || !rs_rx_ready(c))) {
            uint32_t in = e->events & (EPOLLIN | EPOLLRDNORM);
            e->events &= ~in;
            /* stale bells go; the peer's end or garbage on the socket is reported (this is
             * where an epoll wait learns of them: its arming does not peek) */
            rs_rx_drop_stale_bells(c);
            if (RS_GET(c->tcp_eof) || RS_GET(c->err)) e->events |= in;
        }
        if ((e->events & EPOLLOUT) && !rs_tx_writable(c)) {
            if (!rs_tx_arm_credit(c) && !rs_tx_writable(c)) e->events &= ~(uint32_t)EPOLLOUT;
        }
        /* the kernel's report counts as ours: no second edge */
        if ((e->events & EPOLLIN) && (m->events & EPOLLET)) m->et_mark = rs_rx_produced(c);
        rs_sock_put(k2);
    }
    if (stops != (uint64_t)-1) {
        if ((m->events & EPOLLET) && !(e->events & ~(uint32_t)(EPOLLOUT | EPOLLWRNORM)) && m->out_mark == stops)
            e->events &= ~(uint32_t)(EPOLLOUT | EPOLLWRNORM);
        if (e->events & EPOLLOUT) m->out_mark = stops;
    }
    if (m->events & EPOLLONESHOT) {
        if (e->events) {
            m->disarmed = 1;            /* reported: nothing more until EPOLL_CTL_MOD */
        } else {
            /* the kernel's one shot went on bytes that were not the program's (a doorbell,
             * the handshake): the program still waits for its event, so arm it again */
            struct epoll_event again = { .events = m->events, .data = m->data };
            rs_real.epoll_ctl(epfd, EPOLL_CTL_MOD, m->fd, &again);
        }
    }
}

/* who[j]: the first member whose data is ev[j]'s (-1: none; the kernel returns only the
 * data), found in O(members + events) rather than a search per event, as a set may hold
 * a thousand members.  Every member whose data an event has is awake: two members with
 * the same data cannot be told apart, so both are looked at.  The buffers are per thread
 * and grow; NULL if they cannot (caller holds the set's lock). */
static int *ep_match(struct ep_set *s, const struct epoll_event *ev, int k)
{
    static __thread int *buf;
    static __thread size_t cap;
    size_t t = 16;
    while (t < 2 * (size_t)k) t <<= 1;
    size_t need = 2 * (size_t)k + t;
    if (need > cap) {
        int *b = realloc(buf, need * sizeof *b);
        if (!b) return NULL;
        buf = b;
        cap = need;
    }
    int *who = buf, *next = buf + k, *head = buf + 2 * (size_t)k;
    for (size_t h = 0; h < t; h++) head[h] = -1;
    for (int j = k - 1; j >= 0; j--) {
        size_t h = data_hash(ev[j].data.u64) & (t - 1);
        next[j] = head[h];
        head[h] = j;
        who[j] = -1;
    }
    for (int i = 0; i < s->n; i++)
        for (int j = head[data_hash(s->m[i].data.u64) & (t - 1)]; j >= 0; j = next[j])
            if (ev[j].data.u64 == s->m[i].data.u64) {
                if (who[j] < 0) who[j] = i;
                set_quiet(s, i, 0);
                s->m[i].idle_waits = 0;
            }
    return who;
}

/* The kernel's events, checked against the rings (caller holds the set's lock).  The
 * kernel's EPOLLOUT only says the TCP socket has room; for an upgraded socket the ring
 * must have it: EPOLLOUT is dropped for full rings (asking the peer for a credit
 * doorbell).  Events of event bells go (*bells: how many).  Returns how many events remain. */
static int ep_filter_out(int epfd, struct ep_set *s, struct epoll_event *ev, int k, int *bells)
{
    *bells = 0;
    if (s->bells) k = strip_bells(s, ev, k, bells);
    int n = 0, *who = ep_match(s, ev, k);
    if (!who) s->quiet_ok = 0;          /* which members the events name is not known: all are */
    for (int j = 0; j < k; j++) {
        int i = who ? who[j] : 0;
        if (!who)
            while (i < s->n && s->m[i].data.u64 != ev[j].data.u64) i++;
        if (i >= 0 && i < s->n) ep_filter_one(epfd, &ev[j], &s->m[i]);
        if (ev[j].events) ev[n++] = ev[j];
    }
    return n;
}

/* What member i adds to a scan (caller holds the set's lock): *any: it is upgraded or
 * settling; *apart: set if its peer is on another CPU; *lt_out: it waits
 * for level-triggered EPOLLOUT, which only the kernel's report gives; *settling: it is
 * still in its handshake, which `settle` first tries to finish. */
static void scan_member(struct ep_set *s, int i, int settle, int *any, int *apart, int *lt_out, int *settling)
{
    if ((s->m[i].events & (EPOLLOUT | EPOLLET)) == EPOLLOUT) *lt_out = 1;
    struct rs_sock *k = rs_waited_sock(s->m[i].fd);       /* one look-up for every question */
    if (!k) return;
    if (rs_sock_in_handshake(k)) {
        if (settle) rs_sock_settle(k);
        *any = 1;
        if (rs_sock_in_handshake(k)) *settling = 1;
    }
    if (rs_ring_answers(k)) {
        *any = 1;
        if (!*apart && !rs_peer_shares_cpu(k->conn)) *apart = 1;
    }
    rs_sock_put(k);
}

/* Settles members still in the handshake and sums up the set (scan_member). */
static void ep_scan(struct ep_set *s, int *any, int *apart, int *lt_out, int *settling)
{
    *any = *apart = *lt_out = *settling = 0;
    for (int i = 0; i < s->n; i++) scan_member(s, i, 1, any, apart, lt_out, settling);
}

/* Member i was added or changed (caller holds the set's lock): a kept scan takes it in,
 * rather than being dropped, as event loops change members at every request (a thousand
 * look-ups at the next wait); one in its handshake drops it (the next wait settles it).
 * A member that leaves is not taken out: until the next scan, at most 10 ms later, a wait
 * may spin or ask the kernel a little more than it needs. */
static void scan_add(struct ep_set *s, int i)
{
    if (!s->scan_ok) return;
    int any = 1, apart = s->scan_apart, lt_out = s->scan_lt_out, settling = 0;
    scan_member(s, i, 0, &any, &apart, &lt_out, &settling);
    s->scan_ok = !settling;
    s->scan_apart = (uint8_t)apart;
    s->scan_lt_out = (uint8_t)lt_out;
}

/* ep_scan, or what it found last (caller holds the set's lock).  A server's wait asks it
 * of a thousand members: a look-up and a line of shared memory each, most of its time at
 * a thousand connections.  So its answer is kept while it holds: upgraded members and
 * none in its handshake (a wait must settle those), members that epoll_ctl added or
 * changed taken in (scan_add), at most 10 ms old (a peer that moved to another CPU, a member gone back to TCP: the wait tells them
 * as before, it only spins or looks a little differently meanwhile).  A set without
 * upgraded members is always scanned: its wait would not arm a ring that became one. */
static void ep_scan_kept(struct ep_set *s, int *any, int *apart, int *lt_out)
{
    uint64_t now = rs_now_ns();
    if (s->scan_ok && now - s->scan_ns < 10000000u) {
        *any = 1;
        *apart = s->scan_apart;
        *lt_out = s->scan_lt_out;
        return;
    }
    int settling;
    ep_scan(s, any, apart, lt_out, &settling);
    s->scan_ok = *any && !settling;
    s->scan_apart = (uint8_t)*apart;
    s->scan_lt_out = (uint8_t)*lt_out;
    s->scan_ns = now;
}

/* Every member of the set is a tracked socket waited on for input, whose peer can raise a
 * shared word, and nothing else is registered (caller holds the set's lock): arms them
 * all.  1 one is ready after all, 0 armed (words and seen filled, *n of them), -1 not
 * possible: the kernel's wait. */
static int ep_arm_words(struct ep_set *s, const uint32_t **words, uint32_t *seen, int *n)
{
    *n = 0;
    if (s->others || s->n > RS_WORDS_MAX) return -1;
    for (int i = 0; i < s->n; i++) {
        if (s->m[i].disarmed) continue;
        if (s->m[i].events & ~(uint32_t)(EPOLLIN | EPOLLRDNORM | EPOLLRDHUP | EPOLLET | EPOLLONESHOT | EPOLLERR | EPOLLHUP))
            return -1;
        struct rs_sock *k = rs_ring_sock(s->m[i].fd);
        if (!k) return -1;
        rs_conn *c = k->conn;
        words[*n] = NULL;
        int a = rs_ring_arm_word(c, POLLIN, &words[*n], &seen[*n]);
        /* edge-triggered, its data reported and not read yet: only new data is an event,
         * and the word is raised with it */
        if (a > 0 && words[*n] && (s->m[i].events & EPOLLET) && rs_rx_produced(c) == s->m[i].et_mark &&
            !c->rx.fin_seen && !RS_GET(c->err) && !RS_GET(c->tcp_eof))
            a = 0;
        rs_sock_put(k);
        if (a) return a;
        ++*n;
    }
    if (*n) s->quiet_ok = 0;            /* armed for the word, not for a kernel event */
    return *n ? 0 : -1;
}

/* Arms the members for a kernel sleep (caller holds the set's lock): each one not quiet.
 * 1 if one is ready after all.  *resend: a member has a resend after an RDMA failure to
 * push (the sleep is short); *cap: how long the sleep may last for the members waiting
 * for room (-1: no limit). */
static int ep_arm_kernel(int epfd, struct ep_set *s, int *resend, int *cap)
{
    int trust = quiet_trusted(s), ready = 0;
    *resend = 0;
    *cap = -1;
    for (int i = next_awake(s, 0, trust); i < s->n; i = next_awake(s, i + 1, trust)) {
        struct ep_member *m = &s->m[i];
        struct rs_sock *k = rs_ring_sock(m->fd);
        if (!k) continue;
        rs_conn *c = k->conn;
        ready |= arm_member(epfd, s, i, c, trust);
        if (m->events & EPOLLOUT) {
            int ms = rs_ring_sleep_cap_ms(c, POLLOUT);
            /* edge-triggered and room without a new edge: nothing to report, sleep */
            if (ms == 0 && (m->events & EPOLLET)) ms = -1;
            *cap = rs_min_ms(*cap, ms);
        }
        /* a resend after an RDMA failure: push it now and then */
        if (rs_fb_tx_pending(c)) { rs_fb_kick(c); *resend = 1; }
        rs_sock_put(k);
    }
    return ready;
}

static int kernel_wait(int epfd, struct epoll_event *ev, int max, int ms, const sigset_t *mask)
{
    return mask ? rs_real.epoll_pwait(epfd, ev, max, ms, mask) : rs_real.epoll_wait(epfd, ev, max, ms);
}

/* The kernel's wait where no ring needs looking at (ts: epoll_pwait2's timeout, else ms).
 * An event bell may still be in the instance (added for a member since gone, whose
 * connection lives on): its events are not the program's, and the wait goes on. */
static int plain_wait(int epfd, struct epoll_event *ev, int max, int ms, const sigset_t *mask, const struct timespec *ts)
{
    uint64_t deadline = rs_deadline(ms);
    for (int rounds = 0;; rounds++) {
        int r = ts ? rs_real.epoll_pwait2(epfd, ev, max, ts, mask) : kernel_wait(epfd, ev, max, ms, mask);
        int bells;
        if (r <= 0 || !__atomic_load_n(&bells_added, __ATOMIC_RELAXED)) return r;
        r = strip_bells(NULL, ev, r, &bells);
        if (r || ms == 0 || rs_passed(deadline) || rounds >= 1000) return r;
        if (ts || ms > 0) { ts = NULL; ms = rs_ms_until(deadline); }
    }
}

/* One look at the rings, and at the kernel's events first if `kernel`: how many events
 * are in ev, or -1 (errno). */
static int ep_look(int epfd, struct ep_set *s, struct epoll_event *ev, int max, int kernel)
{
    int k = kernel ? rs_real.epoll_wait(epfd, ev, max, 0) : 0, bells;
    if (k < 0) return k;
    pthread_mutex_lock(&s->lock);
    if (k > 0) k = ep_filter_out(epfd, s, ev, k, &bells);
    int n = ep_from_rings(epfd, s, ev, k, max);
    pthread_mutex_unlock(&s->lock);
    return n;
}

/* kernel_turn: the first look takes the kernel's events too.  Every other wait it does
 * not: a server's wait mostly finds its ring ready, or sleeps in the kernel's wait, which
 * reports what the look would have; the other descriptors (a latch, a listener) are
 * reported at the latest by the next wait, as ready ones take turns in the kernel's too.
 * A wait that ends empty without having asked the kernel asks it once before it returns. */
static int epoll_rings(int epfd, struct ep_set *s, struct epoll_event *ev, int max, int timeout_ms, const sigset_t *mask,
                       int apart, int kernel_turn)
{
    uint64_t start = rs_now_ns();
    uint64_t deadline = rs_deadline(timeout_ms);
    uint64_t budget = apart ? rs_spin_allow(rs_wait_spin()) : 0;   /* spin only for peers on other CPUs */
    uint64_t spin_end = rs_earlier(start + budget, deadline);
    struct rs_sigwait sw = { 0 };
    int kernel_seen = 0;
    for (unsigned it = 0;; it++) {
        int kernel = (it & 15) == 0 && (it || kernel_turn);
        kernel_seen |= kernel;
        int n = ep_look(epfd, s, ev, max, kernel);
        if (n < 0) { rs_sigwait_end(&sw); return n; }
        if (n) { rs_sigwait_end(&sw); if (timeout_ms && apart) rs_spin_result(rs_wait_spin(), 1); return n; }
        if (rs_now_ns() >= spin_end) break;
        if (rs_spin_pause(rs_now_ns() - start, &sw)) break;
    }
    if (rs_spin_done(&sw, RS_SIG_EINTR) < 0) { errno = EINTR; return -1; }   /* epoll_wait is never restarted */
    if (timeout_ms && apart) rs_spin_result(rs_wait_spin(), 0);
    unsigned nap_us = 20;
    uint64_t words_until = mask ? 0 : start + RS_WORD_WINDOW_MS * 1000000ull;
    for (;;) {
        if (timeout_ms == 0 || rs_passed(deadline)) return kernel_seen ? 0 : ep_look(epfd, s, ev, max, 1);
        if (!rs_passed(words_until)) {
            /* the word sleeps of one wait last RS_WORD_WINDOW_MS at most: then the kernel's,
             * which sees a peer that died */
            const uint32_t *words[RS_WORDS_MAX];
            uint32_t seen[RS_WORDS_MAX];
            int nw, n = 0;
            pthread_mutex_lock(&s->lock);
            int a = ep_arm_words(s, words, seen, &nw);
            pthread_mutex_unlock(&s->lock);
            if (a == 0) {
                int w = rs_words_wait(words, seen, nw, rs_ms_until(rs_earlier(deadline, words_until)));
                if (w == -EINTR) { errno = EINTR; return -1; }   /* epoll_wait is never restarted */
                if (w < 0) a = -1;
            }
            if (a >= 0) {
                pthread_mutex_lock(&s->lock);
                n = ep_from_rings(epfd, s, ev, 0, max);
                pthread_mutex_unlock(&s->lock);
                if (n) return n;
                continue;
            }
            words_until = 0;            /* not possible for this set now: the kernel's wait */
        }
        int resend, cap, n = 0;
        pthread_mutex_lock(&s->lock);
        if (ep_arm_kernel(epfd, s, &resend, &cap)) n = ep_from_rings(epfd, s, ev, 0, max);
        pthread_mutex_unlock(&s->lock);
        if (n) return n;
        int ms = rs_min_ms(rs_ms_until(deadline), resend ? 10 : cap);
        int k = kernel_wait(epfd, ev, max, ms, mask);
        kernel_seen = 1;
        if (k < 0) return k;
        if (k == 0) continue;          /* the deadline, or a limit above: look at the rings again */
        int bells;
        pthread_mutex_lock(&s->lock);
        k = ep_filter_out(epfd, s, ev, k, &bells);
        if (bells) k = ep_from_rings(epfd, s, ev, k, max);       /* the rings the bells named */
        pthread_mutex_unlock(&s->lock);
        if (k && apart) rs_spin_missed(rs_wait_spin(), rs_now_ns() - start);
        if (k) return k;               /* doorbells, checked against the ring, make it truthful */
        if (bells) continue;           /* bells of records already read: arm and sleep again */
        /* Only "writable" for a full ring: the credit comes through memory; nap and look.
         * A handled signal ends the wait, as it ends any epoll_wait (signal(7)). */
        if (rs_nap((uint64_t)nap_us * 1000, deadline, 1) < 0) { errno = EINTR; return -1; }
        if (nap_us < 1000) nap_us *= 2;
    }
}

static int epoll_common(int epfd, struct epoll_event *ev, int max, int timeout_ms, const sigset_t *mask,
                        const struct timespec *ts2)
{
    struct ep_set *s = max > 0 && !rs_in_engine ? set_get(epfd) : NULL;
    int any = 0, apart = 0, lt_out = 0, turn = 0;
    if (s) {
        pthread_mutex_lock(&s->lock);
        ep_scan_kept(s, &any, &apart, &lt_out);
        turn = lt_out || (s->waits++ & 1);
        pthread_mutex_unlock(&s->lock);
    }
    int r;
    if (!any) {
        r = plain_wait(epfd, ev, max, timeout_ms, mask, ts2);
    } else {
        r = epoll_rings(epfd, s, ev, max, timeout_ms, mask, apart, turn);
    }
    if (s) set_put(s);
    return r;
}

RS_EXPORT int epoll_wait(int epfd, struct epoll_event *ev, int max, int timeout_ms)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (rs_in_engine) return rs_real.epoll_wait(epfd, ev, max, timeout_ms);
    if (!rs_tracking()) return plain_wait(epfd, ev, max, timeout_ms, NULL, NULL);
    return epoll_common(epfd, ev, max, timeout_ms, NULL, NULL);
}

RS_EXPORT int epoll_pwait(int epfd, struct epoll_event *ev, int max, int timeout_ms, const sigset_t *mask)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (rs_in_engine) return rs_real.epoll_pwait(epfd, ev, max, timeout_ms, mask);
    if (!rs_tracking()) return plain_wait(epfd, ev, max, timeout_ms, mask, NULL);
    return epoll_common(epfd, ev, max, timeout_ms, mask, NULL);
}

/* epoll_pwait2 (glibc 2.35+): the same, with the timeout as a timespec (waits on upgraded
 * sockets round it up to whole milliseconds, like ppoll's). */
RS_EXPORT int epoll_pwait2(int epfd, struct epoll_event *ev, int max, const struct timespec *ts, const sigset_t *mask)
{
    if (__builtin_expect(!rs_real.read, 0)) rs_real_init();
    if (!rs_real.epoll_pwait2) { errno = ENOSYS; return -1; }
    if (rs_in_engine) return rs_real.epoll_pwait2(epfd, ev, max, ts, mask);
    if (!rs_tracking()) return plain_wait(epfd, ev, max, rs_ts_ms(ts), mask, ts);
    return epoll_common(epfd, ev, max, rs_ts_ms(ts), mask ? mask : NULL, ts);
}

static void set_after_fork(int epfd, void *p, void *arg)
{
    (void)epfd; (void)arg;
    struct ep_set *s = p;
    pthread_mutex_init(&s->lock, NULL);
    s->quiet_ok = 0;            /* the parent may have read what armed its quiet members */
}

void rs_ep_after_fork_child(void)
{
    rs_fdmap_each(&sets, set_after_fork, NULL);
    pthread_mutex_init(&sets_lock, NULL);
    pthread_mutex_init(&early_lock, NULL);
    rs_fdmap_after_fork(&sets);
    rs_fdmap_after_fork(&early);
}
