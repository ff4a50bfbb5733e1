/* rs_diag.h - reading the kernel's list of listening UNIX sockets (rs_diag.c). */
#ifndef RS_DIAG_H
#define RS_DIAG_H
#include <stddef.h>
#include <stdint.h>

#define RS_DIAG_NO_UID (-2)
int rs_diag_unix_scan(const uint8_t *buf, size_t len, const uint8_t *names, const uint32_t *lens, int n,
                      int64_t *uids);
#endif
