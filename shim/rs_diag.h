/* rs_diag.h - the kernel's sock_diag answers a rendezvous needs (rs_diag.c). */
#ifndef RS_DIAG_H
#define RS_DIAG_H
#include <stddef.h>
#include <stdint.h>

#define RS_DIAG_NO_UID (-2)
int rs_diag_unix_scan(const uint8_t *buf, size_t len, const uint8_t *names, const uint32_t *lens, int n,
                      int64_t *uids);
/* The uid of the TCP socket of `family` (AF_INET: the first 4 bytes of each address; an
 * AF_INET6 socket with the IPv4-mapped addresses counts too) whose local end is (src,
 * sport) and remote end (dst, dport), ports in host order: one exact lookup (two for
 * AF_INET), each bounded by a one-second receive timeout.  -ENOENT if there is none,
 * another -errno if the kernel would not say. */
int rs_diag_tcp_owner(int family, const uint8_t src[16], uint16_t sport, const uint8_t dst[16], uint16_t dport);
#endif
