/* rs_diag.c - finds a few abstract UNIX names in the kernel's unix_diag dump.
 *
 * The rendezvous (rdmasock/rendezvous.py) looks its peer's name up at every connect and
 * accept.  The kernel cannot filter a dump by name, so each lookup reads every listening
 * UNIX socket of the network namespace, and during a storm of connections every client's
 * name is one of them: a thousand entries per lookup, a thousand lookups.  Scanned here
 * rather than in Python, that is microseconds, not milliseconds.
 *
 * Layout (linux/netlink.h, linux/unix_diag.h): netlink messages, each a 16-byte header
 * (u32 length, u16 type, u16 flags, u32 seq, u32 pid) and a body padded to 4 bytes; a
 * socket's body is struct unix_diag_msg (16 bytes) and then attributes (u16 length, u16
 * type, value, padded to 4).  UNIX_DIAG_NAME holds the name (an abstract one with its
 * leading NUL), UNIX_DIAG_UID the owner (Linux 5.3).
 */
#include <errno.h>
#include <string.h>
#include "rs_diag.h"

#define NL_HDR 16
#define NLMSG_ERROR 2
#define NLMSG_DONE 3
#define UDIAG_MSG 16
#define UNIX_DIAG_NAME 0
#define UNIX_DIAG_UID 7

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
