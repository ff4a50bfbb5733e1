/* rs_diag.c - the kernel's sock_diag answers (netlink, the interface `ss` uses) that a
 * rendezvous needs: who owns a TCP connection, and which abstract UNIX names listen.
 *
 * The owner of a TCP connection is one exact lookup by addresses and ports (any user may
 * make it, as any user may read /proc/net/tcp).  A server compares it with the
 * SO_PEERCRED uid of the process behind a client's rendezvous name (rs_answer.c, and
 * rdmasock/sockdiag.py for the control plane).
 *
 * The rendezvous (rdmasock/rendezvous.py) also looks its peer's name up at every connect
 * and accept.  The kernel cannot filter a unix_diag dump by name, so each lookup reads
 * every listening UNIX socket of the network namespace, and during a storm of connections
 * every client's name is one of them: a thousand entries per lookup, a thousand lookups.
 * Scanned here rather than in Python, that is microseconds, not milliseconds.  A socket's
 * body is struct unix_diag_msg and then attributes; UNIX_DIAG_NAME holds the name (an
 * abstract one with its leading NUL), UNIX_DIAG_UID the owner (Linux 5.3).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>
#include <netinet/in.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <linux/unix_diag.h>
#include "rs_diag.h"
#include "rs_sys.h"

#define NL_HDR    sizeof(struct nlmsghdr)
#define UDIAG_MSG sizeof(struct unix_diag_msg)

static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* One socket's attributes: if its name is names[i], uids[i] gets its owner. */
static void match(const uint8_t *a, size_t len, const uint8_t *names, const uint32_t *lens, int n, int64_t *uids)
{
    const uint8_t *name = NULL;
    size_t name_len = 0;
    int64_t uid = RS_DIAG_NO_UID;
    for (size_t pos = 0; pos + 4 <= len;) {
        uint16_t alen = get16(a + pos), type = get16(a + pos + 2);
        if (alen < 4 || pos + alen > len) break;
        if (type == UNIX_DIAG_NAME) { name = a + pos + 4; name_len = alen - 4u; }
        else if (type == UNIX_DIAG_UID && alen >= 8) uid = get32(a + pos + 4);
        pos += (alen + 3u) & ~3u;
    }
    if (!name) return;
    size_t off = 0;
    for (int i = 0; i < n; off += lens[i], i++)
        if (lens[i] == name_len && memcmp(names + off, name, name_len) == 0) uids[i] = uid;
}

/* Scans one chunk of the answer to a dump asked with UDIAG_SHOW_NAME | UDIAG_SHOW_UID for
 * the n names wanted (concatenated in names, lens[i] bytes each, as the kernel reports
 * them).  uids[i] gets the owner of the listener named names[i] (RS_DIAG_NO_UID if the
 * kernel reports none) and is left alone if there is none.  Returns 1 at the end of the
 * dump, 0 if more chunks follow, -errno for the kernel's error or a malformed chunk. */
int rs_diag_unix_scan(const uint8_t *buf, size_t len, const uint8_t *names, const uint32_t *lens, int n,
                      int64_t *uids)
{
    for (size_t pos = 0; pos + NL_HDR <= len;) {
        uint32_t mlen = get32(buf + pos);
        uint16_t type = get16(buf + pos + 4);
        if (mlen < NL_HDR || mlen > len - pos) return -EPROTO;
        const uint8_t *body = buf + pos + NL_HDR;
        size_t blen = mlen - NL_HDR;
        if (type == NLMSG_DONE) return 1;
        if (type == NLMSG_ERROR) {
            int32_t code = blen >= 4 ? (int32_t)get32(body) : -EIO;
            return code < 0 ? code : 1;
        }
        if (blen >= UDIAG_MSG) match(body + UDIAG_MSG, blen - UDIAG_MSG, names, lens, n, uids);
        pos += (mlen + 3u) & ~3u;
    }
    return 0;
}

static int owner_in(int family, const uint8_t src[16], uint16_t sport, const uint8_t dst[16], uint16_t dport)
{
    size_t alen = family == AF_INET ? 4 : family == AF_INET6 ? 16 : 0;
    if (!alen) return -EAFNOSUPPORT;
    int nl = (int)rs_syscall(SYS_socket, AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (nl < 0) return -errno;
    struct timeval tv = { .tv_sec = 1 };
    rs_syscall(SYS_setsockopt, nl, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct { struct nlmsghdr h; struct inet_diag_req_v2 r; } req;
    memset(&req, 0, sizeof req);
    req.h.nlmsg_len = sizeof req;
    req.h.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    req.h.nlmsg_flags = NLM_F_REQUEST;
    req.h.nlmsg_seq = 1;
    req.r.sdiag_family = (uint8_t)family;
    req.r.sdiag_protocol = IPPROTO_TCP;
    req.r.idiag_states = (1u << 12) - 1;                   /* any state */
    req.r.id.idiag_sport = htons(sport);
    req.r.id.idiag_dport = htons(dport);
    memcpy(req.r.id.idiag_src, src, alen);
    memcpy(req.r.id.idiag_dst, dst, alen);
    req.r.id.idiag_cookie[0] = req.r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
    struct sockaddr_nl kernel = { .nl_family = AF_NETLINK };
    int r = -EPROTO;
    if (rs_syscall(SYS_sendto, nl, &req, sizeof req, 0, &kernel, sizeof kernel) != (long)sizeof req) {
        r = -errno;
    } else {
        union { struct nlmsghdr h; char b[8192]; } buf;
        long n = rs_syscall(SYS_recvfrom, nl, buf.b, sizeof buf.b, 0, NULL, NULL);
        if (n < 0) r = -errno;
        for (struct nlmsghdr *h = &buf.h; n > 0 && NLMSG_OK(h, (unsigned long)n); h = NLMSG_NEXT(h, n)) {
            if (h->nlmsg_type == NLMSG_ERROR) {
                const struct nlmsgerr *e = NLMSG_DATA(h);
                r = h->nlmsg_len >= NLMSG_LENGTH(sizeof *e) && e->error ? e->error : -ENOENT;
                break;
            }
            if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY || h->nlmsg_len < NLMSG_LENGTH(sizeof(struct inet_diag_msg)))
                break;
            const struct inet_diag_msg *m = NLMSG_DATA(h);
            if (m->id.idiag_sport == htons(sport) && m->id.idiag_dport == htons(dport) &&
                !memcmp(m->id.idiag_src, src, alen) && !memcmp(m->id.idiag_dst, dst, alen)) {
                r = m->idiag_uid > 0x7fffffffu ? -EOVERFLOW : (int)m->idiag_uid;
                break;
            }
            r = -ENOENT;
        }
    }
    rs_syscall(SYS_close, nl);
    return r;
}

/* An IPv4 connection may belong to an AF_INET6 socket (IPv4-mapped addresses, as Java
 * and other dual-stack programs make them): the kernel lists that one among the IPv6
 * sockets, with ::ffff:a.b.c.d addresses. */
static void v4_mapped(uint8_t out[16], const uint8_t v4[16])
{
    memset(out, 0, 10);
    out[10] = out[11] = 0xff;
    memcpy(out + 12, v4, 4);
}

int rs_diag_tcp_owner(int family, const uint8_t src[16], uint16_t sport, const uint8_t dst[16], uint16_t dport)
{
    int r = owner_in(family, src, sport, dst, dport);
    if (family != AF_INET || r != -ENOENT) return r;
    uint8_t msrc[16], mdst[16];
    v4_mapped(msrc, src);
    v4_mapped(mdst, dst);
    return owner_in(AF_INET6, msrc, sport, mdst, dport);
}
