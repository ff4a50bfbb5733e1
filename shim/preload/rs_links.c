/* rs_links.c - fd -> connection state, reference-counted across dup and fork. */
#include "rs_preload.h"
#include <stdlib.h>
#include "../rs_sys.h"

struct rs_link *rs_fdmap[RS_MAXFD];
int rs_nlinks;
static pthread_mutex_t map_lock = PTHREAD_MUTEX_INITIALIZER;

static void rehome(struct rs_link *l, int gone);

struct rs_link *rs_link_new(int fd, int state)
{
    if ((unsigned)fd >= RS_MAXFD) return NULL;
    struct rs_link *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->refs = 1;
    l->state = state;
    pthread_mutex_init(&l->lock, NULL);
    int fl = rs_real.fcntl(fd, F_GETFL);
    l->nonblock = fl >= 0 && (fl & O_NONBLOCK);
    pthread_mutex_lock(&map_lock);
    struct rs_link *old = rs_fdmap[fd];
    __atomic_store_n(&rs_fdmap[fd], l, __ATOMIC_RELEASE);
    rs_nlinks++;
    pthread_mutex_unlock(&map_lock);
    if (old && --old->refs == 0) rs_link_free(old, -1);   /* fd reused without our close */
    return l;
}

void rs_link_share(int newfd, struct rs_link *l)
{
    if ((unsigned)newfd >= RS_MAXFD) return;
    pthread_mutex_lock(&map_lock);
    struct rs_link *old = rs_fdmap[newfd];
    l->refs++;
    __atomic_store_n(&rs_fdmap[newfd], l, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&map_lock);
    if (old && old != l) {
        pthread_mutex_lock(&map_lock);
        int last = --old->refs == 0;
        if (!last) rehome(old, newfd);
        pthread_mutex_unlock(&map_lock);
        if (last) rs_link_free(old, -1);
    }
}

/* The connection's doorbells and waits use one descriptor number; when that number is
 * closed while duplicates live on, they move to a surviving duplicate.  (Called with
 * map_lock held; a linear scan, but only in this rare case.) */
static void rehome(struct rs_link *l, int gone)
{
    if (!l->conn || l->conn->fd != gone) return;
    for (int fd = 0; fd < RS_MAXFD; fd++)
        if (rs_fdmap[fd] == l) { __atomic_store_n(&l->conn->fd, fd, __ATOMIC_RELEASE); return; }
}

struct rs_link *rs_link_detach(int fd)
{
    if ((unsigned)fd >= RS_MAXFD) return NULL;
    pthread_mutex_lock(&map_lock);
    struct rs_link *l = rs_fdmap[fd];
    int last = 0;
    if (l) {
        __atomic_store_n(&rs_fdmap[fd], NULL, __ATOMIC_RELEASE);
        last = --l->refs == 0;
        if (!last) rehome(l, fd);
    }
    pthread_mutex_unlock(&map_lock);
    return last ? l : NULL;
}

/* Frees the state of an open file nobody refers to any more (the fd is closed or about
 * to be).  An upgraded connection ends with a FIN record unless another process still
 * holds the socket (then the last holder's kernel close ends it). */
/* Reads what the peer sent that nobody will read (a HELLO never answered, a SWITCH behind
 * the last request): closing a TCP socket with unread bytes sends RST, and the peer would
 * see ECONNRESET instead of EOF.  Not after fork: the other process reads them. */
static void drain_unread(int fd)
{
    char buf[512];
    for (int i = 0; i < 64; i++)
        if (rs_sys_recv(fd, buf, sizeof buf, MSG_DONTWAIT) <= 0) break;
}

void rs_link_free(struct rs_link *l, int fd)
{
    rs_stat_close(l->stat);
    if (fd >= 0 && !l->forked && (l->state == RS_SERVER_HS || (l->state == RS_RING && l->conn->rx_pre)))
        drain_unread(fd);
    switch (l->state) {
    case RS_RING:
        if (!l->forked) rs_send_fin(l->conn);
        rs_br_conn_free(l->conn, l->forked);
        break;
    case RS_PRE_RX:
        rs_conn_free(l->conn);
        break;
    case RS_CLIENT_HS:
    case RS_SERVER_HS:
        rs_br_drop(l->handle);
        break;
    case RS_LISTEN:
        rs_br_unlisten(l->handle);
        break;
    }
    pthread_mutex_lock(&map_lock);
    rs_nlinks--;
    pthread_mutex_unlock(&map_lock);
    pthread_mutex_destroy(&l->lock);
    free(l);
}

void rs_links_mark_forked(void)
{
    if (!rs_nlinks) return;
    for (int fd = 0; fd < RS_MAXFD; fd++)
        if (rs_fdmap[fd]) rs_fdmap[fd]->forked = 1;
}
