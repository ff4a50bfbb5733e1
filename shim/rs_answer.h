/* rs_answer.h - the server's answer to a shm HELLO without the control plane (rs_answer.c). */
#ifndef RS_ANSWER_H
#define RS_ANSWER_H
#include <stdint.h>
#include "rs_conn.h"
#include "rs_contract.h"

#define RS_ANSWER_DEFER (-1000)    /* not answered here: the control plane steps as before */

/* Reads and answers the HELLO on fd, waiting up to wait_ms (0: not at all, -1: no limit)
 * for it.  RS_STEP_RING (out[0] the connection, out[1] 0), RS_STEP_PENDING (nothing yet)
 * or RS_ANSWER_DEFER (nothing was read, sent or kept). */
int rs_answer_shm(struct rs_answer *a, int fd, int wait_ms, uintptr_t out[2]);

#define RS_PLAN_HANDSHAKE 1    /* a HELLO follows: *a is filled (link_fd: the client's name) */
#define RS_PLAN_PLAIN     0    /* plain TCP: the client has no rendezvous name (peer_not_rdmasock) */
#define RS_PLAN_ASK     (-1)   /* the control plane decides (engine.py accept) */
/* A zeroed struct rs_answer without descriptors (NULL: no memory). */
struct rs_answer *rs_answer_new(void);
/* At accept, from a listener's template tpl: what the control plane would decide for the
 * socket fd, where C can tell. */
int rs_answer_plan(const struct rs_answer *tpl, int fd, struct rs_answer *a);
#endif
