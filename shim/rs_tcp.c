/* rs_tcp.c - the `tcp` transport: a connection without rings.
 *
 * The server declined the upgrade, but the client had already sent its first bytes as
 * preamble frames (rs_preamble.c), which must still be unwrapped before the stream is
 * plain TCP again.  Everything else is the kernel's: there is no ring to publish into,
 * no credit and no doorbell, so every operation of the table is empty.
 */
#define _GNU_SOURCE
#include "rs_conn.h"

rs_conn *rs_conn_new_tcp(int fd)
{
    rs_conn *c = rs_conn_alloc();
    if (!c) return NULL;
    c->fd = fd;
    c->rx.pre.active = 1;
    return c;
}

static void nothing(rs_conn *c) { (void)c; }
static int none(rs_conn *c) { (void)c; return 0; }
static int no_word(rs_conn *c, const uint32_t **w, uint32_t *v, size_t room) { (void)c; (void)w; (void)v; (void)room; return -1; }
static void no_credit(rs_conn *c, int force) { (void)c; (void)force; }
static void no_bells(rs_conn *c, int on) { (void)c; (void)on; }

static uint64_t nothing_posted(rs_conn *c) { (void)c; return 0; }

const struct rs_transport rs_transport_tcp = {
    .name = "tcp",
    .id = RS_TRANSPORT_TCP,
    .refresh_credit = nothing,
    .flush = nothing,
    .arm_credit = none,
    .unread_at_peer = none,
    .check_peer = nothing,
    .silence = nothing,
    .publish_credit = no_credit,
    .arm_word = no_word,
    .go_idle = none,
    .nonblock_empty = none,
    .tidy = nothing,
    .drop_stale = nothing,
    .bell_every = no_bells,
    .peer_posted = nothing_posted,
    .quiesce = nothing,
    .closed = nothing,
    .after_fork_child = nothing,
    .free = nothing,
};
