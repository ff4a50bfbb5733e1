/* rs_conn.c - connection set-up and teardown on top of a mapped segment. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include "rs_conn.h"
#include "rs_sys.h"

/* A connection without rings: the server declined, but the client's preamble frames must
 * still be unwrapped before the stream is plain TCP again. */
rs_conn *rs_conn_new_tcp(int fd)
{
    rs_conn *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->fd = fd;
    c->rx_pre = 1;
    return c;
}

/* Takes ownership of the mapping [base, base+len).  The server consumes ring 0 and
 * produces into ring 1; the client the other way round. */
rs_conn *rs_conn_attach_shm(void *base, size_t len, int fd, int is_server, uint32_t spin_ns)
{
    struct rs_seg_hdr *h = base;
    rs_conn *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->fd = fd;
    c->ring_size = h->ring_size;
    c->mask = h->ring_size - 1;
    c->max_payload = rs_max_payload(h->ring_size);
    c->salt = h->salt;
    uint8_t *ring0 = (uint8_t *)base + RS_SEG_HDR_SIZE, *ring1 = ring0 + h->ring_size;
    int rx_dir = is_server ? RS_DIR_C2S : RS_DIR_S2C;
    c->rx_ctl = &h->dir[rx_dir];
    c->tx_ctl = &h->dir[1 - rx_dir];
    c->rx_ring = rx_dir == RS_DIR_C2S ? ring0 : ring1;
    c->tx_ring = rx_dir == RS_DIR_C2S ? ring1 : ring0;
    c->spin_ns = c->spin_cur = spin_ns;
    c->map_base = base;
    c->map_len = len;
    return c;
}

void rs_conn_free(rs_conn *c)
{
    if (!c) return;
    rs_rdma_free(c);
    if (c->map_base) munmap(c->map_base, c->map_len);
    free(c);
}

const char *rs_conn_errmsg(const rs_conn *c) { return c->errmsg; }

/* Records the first error only: later failures are consequences of it. */
void rs_conn_set_error(rs_conn *c, int err, const char *fmt, ...)
{
    if (c->err) return;
    c->err = err;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->errmsg, sizeof c->errmsg, fmt, ap);
    va_end(ap);
}

/* recvfrom(2) for the control plane: Python's socket.recv waits for the socket's timeout
 * before honouring MSG_DONTWAIT, which the handshake reader must not do. */
long rs_fd_recv(int fd, void *buf, size_t n, int flags)
{
    return rs_sys_recv(fd, buf, n, flags);
}
