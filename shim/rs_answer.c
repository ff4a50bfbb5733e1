/* rs_answer.c - a server's side of the handshake, in C, for the common case (docs/PROTOCOL.md
 * 1.2, 2.5, 2.6): see struct rs_answer (rs_contract.h) for why.
 *
 * At accept, rs_answer_plan decides what rdmasock/upgrade.py server_plan would for an IPv4
 * client: one whose rendezvous name is owned by the owner of its TCP socket sends a HELLO,
 * one without a name and without a HELLO on the way is plain TCP.  At the first read,
 * rs_answer_shm answers a complete HELLO that offers shm, byte for byte as upgrade.py
 * would.  Everything else (IPv6, a name of another owner, a partial or bad message, rdma,
 * a client that closed, any failure before the answer is sent) goes to the control plane
 * untouched: it looks at the same socket and decides as it always does.
 */
#define _GNU_SOURCE
#include "rs_answer.h"
#include <arpa/inet.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/un.h>
#include "rs_diag.h"
#include "rs_sys.h"
#include "rs_wait.h"

const char *rs_fd_tag(void) { return "RSKFD2"; }

struct rs_answer *rs_answer_new(void)
{
    struct rs_answer *a = calloc(1, sizeof *a);
    if (a) a->engine_fd = a->link_fd = -1;
    return a;
}

static uint64_t get_be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

static void put_be(uint8_t *p, int n, uint64_t v)
{
    for (int i = n - 1; i >= 0; i--, v >>= 8) p[i] = (uint8_t)v;
}

/* A HELLO this file may answer: version 1 or later (read as 1), no extension, shm offered,
 * the required features spoken. */
static int answerable(const uint8_t m[RS_HS_LEN])
{
    return get_be(m, 8) == RS_HS_MAGIC && get_be(m + RS_HS_AT_VERSION, 2) != 0 && get_be(m + RS_HS_AT_OP, 2) == RS_HS_HELLO &&
           get_be(m + RS_HS_AT_LEN, 4) == RS_HS_LEN && (get_be(m + RS_HS_AT_TRANSPORTS, 4) & RS_HS_T_SHM) &&
           (get_be(m + RS_HS_AT_FEATURES, 8) & RS_HS_REQUIRED) == RS_HS_REQUIRED;
}

/* Peeks the first RS_HS_LEN bytes, waiting up to wait_ms (-1: no limit) for anything to
 * arrive.  Returns the bytes peeked, 0 if nothing came in time, -1 for what the control
 * plane must look at (end of stream, an error, a signal). */
static long peek_hello(int fd, uint8_t m[RS_HS_LEN], int wait_ms)
{
    uint64_t deadline = rs_deadline(wait_ms);
    for (;;) {
        long n = rs_sys_recv(fd, m, RS_HS_LEN, MSG_PEEK | MSG_DONTWAIT);
        if (n > 0) return n;
        if (n != -EAGAIN || rs_passed(deadline) || wait_ms == 0) return n == -EAGAIN ? 0 : -1;
        struct pollfd p = { .fd = fd, .events = POLLIN };
        int r = rs_sys_poll(&p, 1, rs_ms_until(deadline));
        if (r < 0) return -1;
        if (r == 0) return 0;
    }
}

/* A connection to the client's rendezvous name (rendezvous.py send_fd), shut down for
 * reading: nothing is ever read from it.  -errno if the name takes none. */
static int link_to(const struct rs_answer *a)
{
    if (!a->name_len || a->name_len > sizeof a->name) return -EINVAL;
    int u = (int)rs_syscall(SYS_socket, AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (u < 0) return -errno;
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    memcpy(sa.sun_path + 1, a->name, a->name_len);          /* sun_path[0] = 0: abstract */
    socklen_t sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + a->name_len);
    if (rs_syscall(SYS_connect, u, &sa, sl) < 0) {
        int e = errno;
        rs_syscall(SYS_close, u);
        return -e;
    }
    rs_syscall(SYS_shutdown, u, SHUT_RD);
    return u;
}

/* Passes the segment (and the event bells) with the client's nonce over the link made at
 * accept, else over a new one. */
static int pass_fds(const struct rs_answer *a, const uint8_t *nonce, const int *fds, int nfds)
{
    int u = a->link_fd >= 0 ? a->link_fd : link_to(a);
    if (u < 0) return u;
    uint8_t msg[6 + 16];
    memcpy(msg, rs_fd_tag(), 6);
    memcpy(msg + 6, nonce, 16);
    union { struct cmsghdr h; char b[CMSG_SPACE(3 * sizeof(int))]; } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = { .iov_base = msg, .iov_len = sizeof msg };
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
                         .msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int)) };
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
    memcpy(CMSG_DATA(cm), fds, (size_t)nfds * sizeof(int));
    long w = rs_syscall(SYS_sendmsg, u, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    int r = w == (long)sizeof msg ? 0 : w < 0 ? -errno : -EIO;
    if (u != a->link_fd) rs_syscall(SYS_close, u);
    return r;
}

int rs_answer_shm(struct rs_answer *a, int fd, int wait_ms, uintptr_t out[2])
{
    uint8_t m[RS_HS_LEN];
    long n = peek_hello(fd, m, wait_ms);
    if (n == 0) return RS_STEP_PENDING;
    if (n != RS_HS_LEN || !answerable(m)) return RS_ANSWER_DEFER;
    /* A client that closed right after its HELLO gets no answer (upgrade.py Server.step). */
    struct pollfd p = { .fd = fd, .events = POLLRDHUP };
    if (rs_sys_poll(&p, 1, 0) != 0) return RS_ANSWER_DEFER;

    uint64_t hello_features = get_be(m + RS_HS_AT_FEATURES, 8);
    uint32_t features = (uint32_t)(hello_features & a->features);
    unsigned log2 = m[RS_HS_AT_RING_LOG2] < 12 ? 12 : m[RS_HS_AT_RING_LOG2];
    if (log2 > a->ring_log2) log2 = a->ring_log2;
    if (log2 > 30) log2 = 30;
    uint64_t salt;
    if (getrandom(&salt, sizeof salt, 0) != (ssize_t)sizeof salt) return RS_ANSWER_DEFER;

    size_t len;
    int fds[3] = { rs_shm_create(1u << log2, salt, &len), -1, -1 }, nfds = 1;
    if (fds[0] < 0) return RS_ANSWER_DEFER;
    struct rs_seg seg;
    rs_conn *c = NULL;
    if (rs_shm_map(fds[0], &seg, 0) == 0) c = rs_conn_attach_shm(&seg, fd, 1, a->spin_ns);
    if (!c) { rs_syscall(SYS_close, fds[0]); return RS_ANSWER_DEFER; }
    if (features & RS_HS_F_EVENT_BELL) {
        a->bells_err = (int16_t)rs_bells_create(fds + 1);
        if (!a->bells_err) nfds = 3;
        else features &= ~RS_HS_F_EVENT_BELL;
    }
    int passed = pass_fds(a, m + RS_HS_AT_NONCE, fds, nfds);
    rs_syscall(SYS_close, fds[0]);
    if (passed < 0) {
        if (nfds == 3) { rs_syscall(SYS_close, fds[1]); rs_syscall(SYS_close, fds[2]); }
        rs_conn_free(c);
        return RS_ANSWER_DEFER;
    }
    /* [ours, the client's]; refused (the process's share of descriptors is spent), the
     * socket's doorbell bytes wake us, as the client's wait holds them too (rs_bells.c) */
    if (nfds == 3 && (a->bells_err = (int16_t)rs_conn_set_bells(c, fds[1], fds[2])) < 0) {
        a->bells_kept = 1;
        rs_syscall(SYS_close, fds[1]);
        rs_syscall(SYS_close, fds[2]);
    }
    c->spill_ok = !!(features & RS_HS_F_SPILL);
    c->word_wake_ok = !!(features & RS_HS_F_FUTEX_WAKE);
    c->quiet_wake_ok = (features & RS_HS_F_QUIET_WAKE) && c->word_wake_ok;
    c->rx.pre.active = 1;                     /* the client's first bytes come as preamble frames */
    c->rx.pre.lazy = !!(hello_features & RS_HS_F_LAZY_SWITCH);

    uint8_t hello[RS_HS_LEN];
    rs_sys_recv(fd, hello, sizeof hello, MSG_DONTWAIT);      /* the HELLO we peeked */
    uint8_t reply[RS_HS_LEN] = { 0 };
    put_be(reply, 8, RS_HS_MAGIC);
    put_be(reply + RS_HS_AT_VERSION, 2, RS_HS_VERSION);
    put_be(reply + RS_HS_AT_OP, 2, RS_HS_ACCEPT);
    put_be(reply + RS_HS_AT_LEN, 4, RS_HS_LEN);
    put_be(reply + RS_HS_AT_FEATURES, 8, features);
    put_be(reply + RS_HS_AT_TRANSPORTS, 4, RS_HS_T_SHM);
    memcpy(reply + RS_HS_AT_NONCE, m + RS_HS_AT_NONCE, 16);       /* the nonce, echoed */
    reply[RS_HS_AT_RING_LOG2] = (uint8_t)log2;
    put_be(reply + RS_HS_AT_PID, 4, (uint32_t)getpid());
    put_be(reply + RS_HS_AT_SALT, 8, salt);
    rs_sys_send(fd, reply, sizeof reply, MSG_DONTWAIT | MSG_NOSIGNAL);   /* a client gone: its reads say so */
    out[0] = (uintptr_t)c;
    out[1] = 0;
    return RS_STEP_RING;
}

/* The IPv4 address (4 bytes, network order) and port of an AF_INET or IPv4-mapped
 * AF_INET6 address; 0 for anything else. */
static int v4_of(const struct sockaddr_storage *sa, uint8_t ip[4], uint16_t *port_be)
{
    if (sa->ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        memcpy(ip, &in->sin_addr, 4);
        *port_be = in->sin_port;
        return 1;
    }
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
    if (sa->ss_family != AF_INET6 || !IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) return 0;
    memcpy(ip, in6->sin6_addr.s6_addr + 12, 4);
    *port_be = in6->sin6_port;
    return 1;
}

/* 1 if what the socket holds so far could be the start of a HELLO (upgrade.py
 * _hello_waiting: an rdmasock client whose name is gone is answered all the same). */
static int hello_may_be_waiting(int fd)
{
    uint8_t m[8], magic[8];
    put_be(magic, 8, RS_HS_MAGIC);
    long n = rs_sys_recv(fd, m, sizeof m, MSG_PEEK | MSG_DONTWAIT);
    return n > 0 && !memcmp(m, magic, (size_t)n);
}

int rs_answer_plan(const struct rs_answer *tpl, int fd, struct rs_answer *a)
{
    struct sockaddr_storage l, p;
    socklen_t ll = sizeof l, pl = sizeof p;
    uint8_t lip[16] = { 0 }, pip[16] = { 0 };
    uint16_t lport, pport;
    if (rs_syscall(SYS_getsockname, fd, &l, &ll) < 0 || rs_syscall(SYS_getpeername, fd, &p, &pl) < 0 ||
        !v4_of(&l, lip, &lport) || !v4_of(&p, pip, &pport)) return RS_PLAN_ASK;
    *a = *tpl;
    a->engine_fd = a->link_fd = -1;
    char ip[INET_ADDRSTRLEN];
    if (!inet_ntop(AF_INET, pip, ip, sizeof ip) || tpl->name_len >= sizeof a->name) return RS_PLAN_ASK;
    size_t room = sizeof a->name - tpl->name_len;
    int n = snprintf(a->name + tpl->name_len, room, "%s/%u", ip, (unsigned)ntohs(pport));
    if (n < 0 || (size_t)n >= room) return RS_PLAN_ASK;
    a->name_len = (uint8_t)(tpl->name_len + n);
    int u = link_to(a);
    if (u == -ECONNREFUSED) return hello_may_be_waiting(fd) ? RS_PLAN_ASK : RS_PLAN_PLAIN;
    if (u < 0) return RS_PLAN_ASK;
    /* The name's owner (the credentials its listen() recorded) must own the TCP socket at
     * the other end: a name anybody could have bound proves nothing by itself. */
    struct ucred cr;
    socklen_t cl = sizeof cr;
    if (rs_syscall(SYS_getsockopt, u, SOL_SOCKET, SO_PEERCRED, &cr, &cl) < 0 ||
        rs_diag_tcp_owner(AF_INET, pip, ntohs(pport), lip, ntohs(lport)) != (long)cr.uid) {
        rs_syscall(SYS_close, u);
        return RS_PLAN_ASK;
    }
    a->link_fd = rs_fd_move_high(u);
    return RS_PLAN_HANDSHAKE;
}
