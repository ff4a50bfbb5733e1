/* rs_api.h - the Python API's entry points into the socket object (rs_api.c). */
#ifndef RS_API_H
#define RS_API_H
#include "rs_sock.h"

enum { RS_API_PLAIN = -0x40000000 };   /* the socket is plain TCP: make the kernel's call */

void rs_api_install(void);
struct rs_sock *rs_api_new(int fd, int state, int handle, int role);
int     rs_api_hold(struct rs_sock *s, uint32_t gen, int fd);
ssize_t rs_api_recv(struct rs_sock *s, uint32_t gen, void *buf, size_t n, int flags, int timeout_ms);
ssize_t rs_api_send(struct rs_sock *s, uint32_t gen, const void *buf, size_t n, int flags, int timeout_ms);
int     rs_api_step(struct rs_sock *s, uint32_t gen, int wait_ms);
int     rs_api_shutdown(struct rs_sock *s, uint32_t gen, int how, int nonblock);
int     rs_api_move_tx(struct rs_sock *s, uint32_t gen, int reason, int flags);
#endif
