/* rs_preamble.c - bytes a client writes before the server has answered its HELLO.
 *
 * The client cannot know yet whether the ring will exist, and must not make the
 * application wait for the server's first read (a single-threaded program may do
 * connect, send, accept, recv in that order).  So, between HELLO and the server's answer,
 * its writes travel on the TCP stream as frames:
 *
 *     u8 kind | u8 zero[3] | u32 length (big endian) | payload[length]
 *
 * kind 0xDA carries 1..RS_PRE_MAX payload bytes; kind 0x5A (SWITCH, length 0) is the
 * client's last frame, sent as soon as it has read the answer: after it, the client's data
 * goes into the ring (ACCEPT) or follows as plain TCP bytes (DECLINE).  The server reads
 * frames until SWITCH before it looks at the ring, so the order of bytes is kept.
 * A blocking write sends its frames whole.  A non-blocking one returns what the socket
 * took, as TCP's does: a frame it began and could not finish stays open (struct
 * rs_pre_open), and the next writes owe its tail, their first bytes being the stream's
 * next bytes anyway; nothing else goes on the socket meanwhile (rs_sock.c
 * frame_closed_within).
 * The server takes headers and payload in parts, as TCP hands them over (read_header).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <time.h>
#include "rs_conn.h"
#include "rs_sys.h"

static void put_header(uint8_t h[RS_PRE_HDR], uint8_t kind, uint32_t len)
{
    h[0] = kind; h[1] = h[2] = h[3] = 0;
    h[4] = (uint8_t)(len >> 24); h[5] = (uint8_t)(len >> 16); h[6] = (uint8_t)(len >> 8); h[7] = (uint8_t)len;
}

/* Writes the whole of [p, p+n) blocking, whatever the socket's O_NONBLOCK: the rest of a
 * frame whose first bytes already left must follow before anything else. */
static int write_rest(int fd, const uint8_t *p, size_t n)
{
    while (n) {
        long r = rs_sys_send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r > 0) { p += r; n -= (size_t)r; continue; }
        if (r == -EAGAIN || r == -EINTR) {
            int w = rs_sleep_fd(fd, POLLOUT, RS_NEVER);   /* a signal must not leave half a frame */
            if (w < 0 && w != -EINTR) return w;
            continue;
        }
        return (int)r;
    }
    return 0;
}

/* A whole frame, blocking whatever the socket's O_NONBLOCK (SWITCH, a blocking write). */
static long send_frame(int fd, uint8_t kind, const void *buf, uint32_t n)
{
    uint8_t h[RS_PRE_HDR];
    put_header(h, kind, n);
    struct iovec iov[2] = { { h, RS_PRE_HDR }, { (void *)buf, n } };
    struct msghdr m = { .msg_iov = iov, .msg_iovlen = n ? 2 : 1 };
    long r;
    for (;;) {
        r = rs_syscall(SYS_sendmsg, fd, &m, MSG_NOSIGNAL);
        if (r >= 0) break;
        int e = errno;
        if (e != EAGAIN && e != EINTR) return -e;
        int w = rs_sleep_fd(fd, POLLOUT, RS_NEVER);
        if (w < 0 && w != -EINTR) return w;
    }
    size_t total = RS_PRE_HDR + (size_t)n;
    if ((size_t)r < total) {
        int e;
        if ((size_t)r < RS_PRE_HDR) {
            e = write_rest(fd, h + r, RS_PRE_HDR - (size_t)r);
            if (!e) e = write_rest(fd, buf, n);
        } else {
            e = write_rest(fd, (const uint8_t *)buf + (r - RS_PRE_HDR), total - (size_t)r);
        }
        if (e < 0) return e;
    }
    return 0;
}

/* Non-blocking: the rest of the open frame, header bytes first, then up to its owed
 * payload from buf.  Returns the payload bytes taken, or -errno (-EAGAIN: none). */
static ssize_t continue_frame(int fd, const void *buf, size_t len, struct rs_pre_open *o)
{
    size_t n = len < o->owed ? len : o->owed;
    struct iovec iov[2] = { { o->hdr + RS_PRE_HDR - o->hdr_left, o->hdr_left }, { (void *)buf, n } };
    struct msghdr m = { .msg_iov = o->hdr_left ? iov : iov + 1, .msg_iovlen = o->hdr_left ? 2 : 1 };
    long r = rs_syscall(SYS_sendmsg, fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) return -errno;
    size_t h = (size_t)r < o->hdr_left ? (size_t)r : o->hdr_left;
    o->hdr_left = (uint8_t)(o->hdr_left - h);
    o->owed -= (uint32_t)((size_t)r - h);
    return (size_t)r > h ? (ssize_t)((size_t)r - h) : -EAGAIN;
}

/* Sends up to RS_PRE_MAX bytes of buf as one DATA frame, or continues the frame `open`
 * holds.  Without `open` the frame goes whole (nonblock: only if the socket is writable
 * now, else -EAGAIN).  Non-blocking with `open`: what the socket took; a frame it took in
 * part stays open.  Returns the payload bytes taken, or -errno (-EAGAIN: none). */
ssize_t rs_pre_send(int fd, const void *buf, size_t len, int nonblock, int timeout_ms, struct rs_pre_open *open)
{
    if (len == 0) return 0;
    if (open && rs_pre_is_open(open)) return continue_frame(fd, buf, len, open);
    uint32_t n = len > RS_PRE_MAX ? RS_PRE_MAX : (uint32_t)len;
    if (nonblock && open) {
        if (n > RS_PRE_NONBLOCK_MAX) n = RS_PRE_NONBLOCK_MAX;
        put_header(open->hdr, RS_PRE_DATA, n);
        open->hdr_left = RS_PRE_HDR;
        open->owed = n;
        ssize_t r = continue_frame(fd, buf, n, open);
        if (open->hdr_left == RS_PRE_HDR) open->hdr_left = 0, open->owed = 0;   /* nothing left: no frame */
        return r;
    }
    if (nonblock) {
        /* A caller that waits anyway (open NULL) writes whole frames, and only starts one
         * that the socket can take now: where it cannot, the caller's wait looks for the
         * answer, which ends the preamble. */
        struct pollfd p = { .fd = fd, .events = POLLOUT };
        if (rs_sys_poll(&p, 1, 0) <= 0 || !(p.revents & POLLOUT)) return -EAGAIN;
        if (n > RS_PRE_NONBLOCK_MAX) n = RS_PRE_NONBLOCK_MAX;
    } else if (timeout_ms > 0) {
        uint64_t deadline = rs_deadline(timeout_ms);
        struct pollfd p = { .fd = fd, .events = POLLOUT };
        while (rs_sys_poll(&p, 1, 0) <= 0) {
            int r = rs_sleep_fd(fd, POLLOUT, deadline);
            if (r == 0) return -EAGAIN;
            if (r < 0) return r;
        }
    }
    long r = send_frame(fd, RS_PRE_DATA, buf, n);
    return r < 0 ? r : (ssize_t)n;
}

/* The client's last frame. */
int rs_pre_switch(int fd)
{
    return (int)send_frame(fd, RS_PRE_SWITCH, NULL, 0);
}

/* A client whose handshake ends outside a write sends its SWITCH lazily: just before its
 * first byte on the TCP socket after the answer (a doorbell, a RESYNC frame), just after
 * its first records are in the ring (rs_tx_flush_bell), data or FIN, or at its first
 * read (rs_recv).  A SWITCH sent at once would make the server's socket readable with
 * nothing to read; sent after the records, the server it wakes finds them, as a TCP
 * reader woken by data finds data.  The server reads no ring before SWITCH, so records
 * may precede it.  Not later than the first read: until SWITCH every readiness check of
 * the server peeks at its socket for frames (rs_rx_ready), and a client that only reads
 * would keep it there. */
void rs_pre_switch_later(rs_conn *c)
{
    RS_SET(c->switch_due, 1);
    rs_note_silent_change();
}

/* Never waits for room: the server may be reading nothing until it has what we are about
 * to read or write (a client whose preamble filled the socket, then reads), and a wait here
 * would outlast the caller's timeout.  What did not fit goes at a later call; until then
 * our other TCP bytes wait too (doorbells are sent later, credit is found in memory), and
 * our waits include room on the socket (rs_wait_fd, the preload's readiness). */
int rs_tx_switch_now(rs_conn *c)
{
    for (unsigned i = 0;; i++) {
        uint8_t due = 1;
        if (__atomic_compare_exchange_n(&c->switch_due, &due, 2, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            if (!c->switch_sent && c->ops->may_switch && !c->ops->may_switch(c)) {
                RS_SET(c->switch_due, 0);       /* the server closes: nobody reads it */
                return 1;
            }
            uint8_t h[RS_PRE_HDR];
            put_header(h, RS_PRE_SWITCH, 0);
            long n = 0;
            int fd = rs_fd_enter(c);
            while (c->switch_sent < RS_PRE_HDR) {
                n = rs_sys_send(fd, h + c->switch_sent, RS_PRE_HDR - c->switch_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (n > 0) c->switch_sent = (uint8_t)(c->switch_sent + n);
                else if (n != -EINTR) break;
            }
            rs_fd_leave(c);
            /* sent, or the socket failed (which shows at the next call) */
            int done = c->switch_sent == RS_PRE_HDR || (n < 0 && n != -EAGAIN);
            RS_SET(c->switch_due, done ? 0 : 1);
            if (!done) rs_note_silent_change();
            return done;
        }
        if (due == 0) return 1;
        /* Another thread is in its non-blocking send: a few microseconds. */
        if (i > 64) {
            struct timespec ts = { 0, 20000 };
            nanosleep(&ts, NULL);
        }
        if (i > 5000) return 0;
    }
}

/* The known bytes of a frame header (got of RS_PRE_HDR) can start a valid one. */
static int header_ok(const uint8_t *h, unsigned got)
{
    if (got >= 1 && h[0] != RS_PRE_DATA && h[0] != RS_PRE_SWITCH) return 0;
    for (unsigned i = 1; i < 4 && i < got; i++)
        if (h[i]) return 0;
    if (got < RS_PRE_HDR) return 1;
    uint32_t len = (uint32_t)h[4] << 24 | (uint32_t)h[5] << 16 | (uint32_t)h[6] << 8 | h[7];
    return h[0] == RS_PRE_DATA ? len >= 1 && len <= RS_PRE_MAX : len == 0;
}

/* The client's stream ended inside a frame: a client whose non-blocking write left the
 * frame open, then shut down writing or closed.  Its reader gets what came, then the end
 * of the stream, as over TCP, and after an ACCEPT our direction goes on (a half-close);
 * an end at a frame boundary after an ACCEPT only a client that is gone makes
 * (read_header).  1: the preamble is over (the ring reads the end), 0: end of stream. */
static int ended_inside_frame(rs_conn *c)
{
    c->rx.pre.hdr_got = 0;
    c->rx.pre.left = 0;
    if (!c->tx.ring) return 0;
    c->rx.fin_seen = 1;
    RS_SET(c->rx.pre.ended, 1);
    RS_SET(c->rx.pre.active, 0);
    return 1;
}

/* Server side, while c->rx.pre.active and no frame is open: takes the next frame header
 * off the socket.  Its bytes are taken as they come and kept (c->rx.pre.hdr): a client
 * sends the rest of a header only when its next write comes, or a receiver whose buffer
 * is full only after it has read what came, so a wait for all 8 bytes to be readable
 * could last for ever (and wake every poll on the socket meanwhile).  1 = a DATA frame is open
 * (c->rx.pre.left set) or SWITCH was seen (c->rx.pre.active cleared), 0 = EOF before a
 * header, -errno otherwise (-EAGAIN: not all there yet). */
static int read_header(rs_conn *c)
{
    struct rs_rx_pre *pre = &c->rx.pre;
    uint8_t *h = pre->hdr;
    while (pre->hdr_got < RS_PRE_HDR) {
        long n = rs_c_recv(c, h + pre->hdr_got, RS_PRE_HDR - pre->hdr_got, MSG_DONTWAIT);
        if (n > 0) {
            pre->hdr_got = (uint8_t)(pre->hdr_got + n);
            if (!header_ok(h, pre->hdr_got)) break;
            continue;
        }
        if (n != 0 && n != -ECONNRESET) return (int)n;
        if (pre->hdr_got && n) {
            rs_conn_set_error(c, ECONNRESET, "rdmasock: peer reset inside a preamble frame header");
            return -ECONNRESET;
        }
        if (pre->hdr_got) return ended_inside_frame(c);
        if (c->tx.ring) {
            /* An upgraded client's socket ended at a frame boundary: its process is gone (a
             * lazy client that never wrote again sends no SWITCH; its kernel may reset over
             * doorbell bytes it left unread).  What it wrote is in the ring, and the end
             * reads as it does on the ring: end of stream, or a reset if it left our data
             * unread. */
            RS_SET(c->tcp_eof, 1);
            RS_SET(pre->active, 0);
            return 1;
        }
        /* A client that closed right after its HELLO, having sent nothing: our ACCEPT
         * reached a closed socket (or sat unread in it) and its kernel answered with a
         * reset.  Over TCP that close is an end of stream, so it is one here. */
        if (n == 0 || (!c->rx.bytes && !pre->seen)) return 0;
        return (int)n;
    }
    uint32_t len = (uint32_t)h[4] << 24 | (uint32_t)h[5] << 16 | (uint32_t)h[6] << 8 | h[7];
    if (!header_ok(h, pre->hdr_got)) {
        if (pre->hdr_got == RS_PRE_HDR)
            rs_conn_set_error(c, EPROTO, "rdmasock: garbage preamble frame (kind 0x%02x, length %u)", h[0], len);
        else
            rs_conn_set_error(c, EPROTO, "rdmasock: garbage preamble frame (kind 0x%02x)", h[0]);
        return -EPROTO;
    }
    pre->hdr_got = 0;
    if (h[0] == RS_PRE_SWITCH) RS_SET(pre->active, 0);
    else pre->left = len;
    pre->seen = 1;
    return 1;
}

/* Waiting hooks: takes the next frame header off the socket if no frame is open (header
 * bytes are not application data, so they must not make the socket look readable, and a
 * SWITCH with nothing behind it is not data either).  Returns 1 when the preamble is over. */
int rs_pre_settle(rs_conn *c)
{
    if (!RS_GET(c->rx.pre.active)) return 1;
    if (!rs_trylock(&c->rx.lock)) return 0;            /* a reader is at it: it will see SWITCH */
    int over = rs_pre_settle_locked(c);
    rs_unlock(&c->rx.lock);
    return over;
}

/* Not while a thread is inside rs_pre_recv: it may be asleep on the socket, which the
 * SWITCH wakes; taken here, nothing would wake it for the ring's data, and the socket's
 * next bytes (a doorbell, a RESYNC frame) would be read as a frame header. */
int rs_pre_settle_locked(rs_conn *c)
{
    if (c->rx.pre.active && !c->rx.pre.left && !RS_GET(c->err) && !RS_GET(c->rx.sock_readers)) read_header(c);
    return !c->rx.pre.active;
}

/* Before a server closes a connection whose preamble it never read to the end: the
 * client's SWITCH frame, which our answer provoked and TCP would not have, must not be
 * left unread (the kernel's close would then be a reset, the client's reads would end in
 * ECONNRESET instead of its data and EOF).  Waits for it up to `ns`.  Frames with the
 * client's own data stay unread: TCP resets then too.  1 if the preamble is over. */
int rs_pre_quiesce(rs_conn *c, uint64_t ns)
{
    /* A lazy client's SWITCH is not in flight on its own: it comes at the client's next
     * call, maybe after our close.  Where the transport can tell the client that we close
     * (shm), it then sends none, and one it is sending already is waited for. */
    if (c->rx.pre.lazy && !(c->ops->closing_unswitched && c->ops->closing_unswitched(c))) ns = 0;
    uint64_t until = rs_now_ns() + ns;
    while (RS_GET(c->rx.pre.active)) {
        if (rs_pre_settle(c)) return 1;
        if (c->rx.pre.left || RS_GET(c->err)) return 0;
        if (c->rx.pre.hdr_got && c->rx.pre.hdr[0] != RS_PRE_SWITCH) return 0;
        uint8_t h;
        long n = rs_c_recv(c, &h, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0 || (n < 0 && n != -EAGAIN)) return 0;  /* EOF: nothing more comes */
        if (rs_now_ns() >= until) return 0;
        struct timespec ts = { 0, 200000 };
        nanosleep(&ts, NULL);
    }
    return 1;
}

/* One step of rs_pre_recv, without waiting (caller holds rx_lock): bytes, 0 EOF, -errno,
 * RS_PRE_OVER, or RS_PRE_AGAIN (a header was consumed: step again). */
#define RS_PRE_AGAIN (-100001)
static long pre_step(rs_conn *c, void *buf, size_t len, int peek)
{
    if (RS_GET(c->err)) return -RS_GET(c->err);
    if (!c->rx.pre.active) return RS_PRE_OVER;          /* another thread read the SWITCH */
    if (c->rx.pre.left == 0) {
        long r = read_header(c);
        if (r == 1) return c->rx.pre.active ? RS_PRE_AGAIN : RS_PRE_OVER;
        return r;
    }
    size_t want = len < c->rx.pre.left ? len : c->rx.pre.left;
    long r = rs_c_recv(c, buf, want, MSG_DONTWAIT | (peek ? MSG_PEEK : 0));
    if (r > 0 && !peek) { c->rx.pre.left -= (uint32_t)r; c->rx.pre.bytes += (uint64_t)r; }
    if (r == 0) return ended_inside_frame(c) ? RS_PRE_OVER : 0;
    return r;
}

static ssize_t pre_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms);

/* Reads preamble payload into buf.  Returns bytes (> 0), 0 at EOF, -errno, or
 * RS_PRE_OVER once SWITCH has been consumed (the caller goes on with the ring).  While a
 * thread is in here, no other takes a frame header (rs_pre_settle_locked). */
ssize_t rs_pre_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms)
{
    __atomic_add_fetch(&c->rx.sock_readers, 1, __ATOMIC_SEQ_CST);
    ssize_t r = pre_recv(c, buf, len, flags, timeout_ms);
    __atomic_sub_fetch(&c->rx.sock_readers, 1, __ATOMIC_SEQ_CST);
    return r;
}

static ssize_t pre_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms)
{
    int peek = flags & RS_MSG_PEEK;
    int nonblock = (flags & RS_MSG_DONTWAIT) || timeout_ms == 0;
    uint64_t deadline = rs_deadline(nonblock ? 0 : timeout_ms);
    for (;;) {
        rs_lock(&c->rx.lock);
        long r = pre_step(c, buf, len, peek);
        rs_unlock(&c->rx.lock);
        if (r == RS_PRE_AGAIN) continue;
        if (r != -EAGAIN) return r;
        if (nonblock || (deadline == RS_NEVER && rs_conn_app_nonblocking(c))) return -EAGAIN;
        int w = rs_sleep_fd(rs_fd_peek(c), POLLIN, deadline);
        if (w == 0) return -EAGAIN;
        if (w < 0) return w;
    }
}

/* recv on a plain TCP socket with the data path's flag and timeout conventions (the
 * Python API keeps sockets with a timeout in O_NONBLOCK mode). */
ssize_t rs_tcp_recv(rs_conn *c, void *buf, size_t len, int flags, int timeout_ms)
{
    int nonblock = (flags & RS_MSG_DONTWAIT) || timeout_ms == 0;
    uint64_t deadline = rs_deadline(nonblock ? 0 : timeout_ms);
    size_t got = 0;
    for (;;) {
        long r = rs_c_recv(c, (uint8_t *)buf + got, len - got, flags & (RS_MSG_PEEK | RS_MSG_WAITALL));
        if (r > 0) {
            got += (size_t)r;
            if (got == len || !(flags & RS_MSG_WAITALL) || (flags & RS_MSG_PEEK)) return (ssize_t)got;
            continue;
        }
        if (r == 0) return (ssize_t)got;
        if (r != -EAGAIN) return got ? (ssize_t)got : r;
        if (nonblock || (deadline == RS_NEVER && rs_conn_app_nonblocking(c))) return got ? (ssize_t)got : -EAGAIN;
        int w = rs_sleep_fd(rs_fd_peek(c), POLLIN, deadline);
        if (w == 0) return got ? (ssize_t)got : -EAGAIN;
        if (w < 0) return got ? (ssize_t)got : w;
    }
}
