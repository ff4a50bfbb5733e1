/* rs_lock.h - the lock of one direction of a connection.
 *
 * Held only while a call changes the direction's state (copying into or out of the ring,
 * moving cursors, reading doorbells), never while it sleeps or spins, so another thread's
 * recv, poll or close never waits for a peer.  Uncontended it costs one compare-and-swap
 * and one exchange; a waiter spins briefly, then sleeps on a private futex. */
#ifndef RS_LOCK_H
#define RS_LOCK_H
typedef struct { int v; } rs_lock_t;         /* 0 free, 1 held, 2 held with sleepers */

void rs_lock_wait(rs_lock_t *l);
void rs_lock_wake(rs_lock_t *l);

static inline void rs_lock(rs_lock_t *l)
{
    int c = 0;
    if (!__atomic_compare_exchange_n(&l->v, &c, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) rs_lock_wait(l);
}

static inline int rs_trylock(rs_lock_t *l)
{
    int c = 0;
    return __atomic_compare_exchange_n(&l->v, &c, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
}

static inline void rs_unlock(rs_lock_t *l)
{
    if (__atomic_exchange_n(&l->v, 0, __ATOMIC_RELEASE) == 2) rs_lock_wake(l);
}
#endif
