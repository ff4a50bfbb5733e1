/* rs_report.c - what the TCP socket reports about the stream, told as the kernel would tell
 * it for a connection whose bytes travel through the ring: TCP_INFO's counters and the
 * ancillary data of a receive.  Shared by the preload hooks and the Python API. */
#define _GNU_SOURCE
#include <linux/net_tstamp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "rs_conn.h"
#include "rs_sys.h"

/* The kernel's TCP_INFO describes the socket, which carried only the handshake and the
 * doorbells.  Its payload byte counters become the connection's (`in`, `out`: payload the
 * program received and sent; ring bytes are in the peer's memory when written: sent,
 * acknowledged and received at once), and each ring record counts as the segment that
 * would have carried it, on top of the socket's own segments (which then play the part of
 * TCP's control segments).  Offsets are those of the kernel's struct tcp_info (linux/tcp.h,
 * an ABI whose fields never move), which glibc's <netinet/tcp.h> does not declare this far. */
void rs_conn_tcp_info(rs_conn *c, uint64_t in, uint64_t out, void *info, unsigned len)
{
    ssize_t queued = rs_rx_available(c);
    if (queued > 0) in += (uint64_t)queued;
    out += 1 + (c->tx.fin_sent ? 1 : 0);          /* Linux counts the SYN and FIN as acknowledged bytes */
    static const struct { unsigned off; int in; } bytes[] = {
        { 120, 0 },     /* tcpi_bytes_acked */
        { 128, 1 },     /* tcpi_bytes_received */
        { 200, 0 },     /* tcpi_bytes_sent (counts the SYN and FIN too) */
    };
    for (unsigned i = 0; i < sizeof bytes / sizeof bytes[0]; i++)
        if (len >= bytes[i].off + 8) memcpy((char *)info + bytes[i].off, bytes[i].in ? &in : &out, 8);
    uint32_t recs_out = (uint32_t)__atomic_load_n(&c->tx.seq, __ATOMIC_RELAXED);
    uint32_t recs_in = (uint32_t)__atomic_load_n(&c->rx.seq, __ATOMIC_RELAXED);
    static const struct { unsigned off; int in; } segs[] = {
        { 136, 0 },     /* tcpi_segs_out */
        { 140, 1 },     /* tcpi_segs_in */
        { 152, 1 },     /* tcpi_data_segs_in */
        { 156, 0 },     /* tcpi_data_segs_out */
    };
    for (unsigned i = 0; i < sizeof segs / sizeof segs[0]; i++) {
        if (len < segs[i].off + 4) continue;
        uint32_t v;
        memcpy(&v, (char *)info + segs[i].off, 4);
        v += segs[i].in ? recs_in : recs_out;        /* the kernel's counters wrap the same way */
        memcpy((char *)info + segs[i].off, &v, 4);
    }
}

static int sockopt_int(int fd, int level, int name)
{
    int v = 0;
    socklen_t l = sizeof v;
    return rs_syscall(SYS_getsockopt, fd, level, name, &v, &l) == 0 ? v : 0;
}

/* The ancillary data a TCP socket gives with received bytes, if the program asked for it:
 * a receive timestamp (SO_TIMESTAMP / SO_TIMESTAMPNS, and SO_TIMESTAMPING's software one:
 * when the bytes were taken from the ring, which is when they became the socket's; no
 * hardware saw them) and TCP_INQ (bytes left to read), in the kernel's order.  Returns
 * the bytes of ctl used; *trunc set when they did not all fit (MSG_CTRUNC). */
enum { ANC_KNOWN = 1, ANC_NS = 2, ANC_US = 4, ANC_TS = 8, ANC_INQ = 16 };

/* Which of them the program asked for: asked of the socket once, then kept until the
 * program sets an option again (rs_conn_sockopt_set), so that a receive with a control
 * buffer costs no system call. */
static unsigned rx_options(rs_conn *c, int fd)
{
    unsigned o = __atomic_load_n(&c->rx.anc_opts, __ATOMIC_ACQUIRE);
    if (o & ANC_KNOWN) return o;
    int ts = sockopt_int(fd, SOL_SOCKET, SO_TIMESTAMPING);
    o = ANC_KNOWN | (sockopt_int(fd, SOL_SOCKET, SO_TIMESTAMPNS) ? ANC_NS : 0) |
        (sockopt_int(fd, SOL_SOCKET, SO_TIMESTAMP) ? ANC_US : 0) |
        ((ts & SOF_TIMESTAMPING_SOFTWARE) && (ts & SOF_TIMESTAMPING_RX_SOFTWARE) ? ANC_TS : 0) |
        (sockopt_int(fd, IPPROTO_TCP, TCP_INQ) ? ANC_INQ : 0);
    __atomic_store_n(&c->rx.anc_opts, (uint8_t)o, __ATOMIC_RELEASE);
    return o;
}

void rs_conn_sockopt_set(rs_conn *c)
{
    __atomic_store_n(&c->rx.anc_opts, 0, __ATOMIC_RELEASE);
}

size_t rs_conn_rx_ancillary(rs_conn *c, int fd, void *ctl, size_t room, int *trunc)
{
    size_t used = 0;
    *trunc = 0;
    if (!ctl || !room) return 0;
    unsigned o = rx_options(c, fd);
    int ns = (o & ANC_NS) != 0, us = !ns && (o & ANC_US), ts = (o & ANC_TS) != 0, inq = (o & ANC_INQ) != 0;
    struct timespec now, stamps[3] = { { 0, 0 } };
    clock_gettime(CLOCK_REALTIME, &now);
    stamps[0] = now;
    struct timeval tv = { now.tv_sec, now.tv_nsec / 1000 };
    int left = (int)rs_rx_available(c);
    struct { int on, level, type; const void *data; size_t len; } item[] = {
        { ns, SOL_SOCKET, SCM_TIMESTAMPNS, &now, sizeof now },
        { us, SOL_SOCKET, SCM_TIMESTAMP, &tv, sizeof tv },
        { ts, SOL_SOCKET, SCM_TIMESTAMPING, stamps, sizeof stamps },
        { inq, IPPROTO_TCP, TCP_CM_INQ, &left, sizeof left },
    };
    for (unsigned i = 0; i < sizeof item / sizeof item[0]; i++) {
        if (!item[i].on) continue;
        if (used + CMSG_SPACE(item[i].len) > room) { *trunc = 1; break; }
        struct cmsghdr *m = (struct cmsghdr *)((char *)ctl + used);
        m->cmsg_level = item[i].level;
        m->cmsg_type = item[i].type;
        m->cmsg_len = CMSG_LEN(item[i].len);
        memcpy(CMSG_DATA(m), item[i].data, item[i].len);
        used += CMSG_SPACE(item[i].len);
    }
    return used;
}
