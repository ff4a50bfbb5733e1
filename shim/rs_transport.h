/* rs_transport.h - the transport interface: what differs between ways of carrying records.
 *
 * Every transport carries the same records in the same ring format (rs_wire.h).  They
 * differ in how a record written by the producer reaches the consumer's ring, how the
 * consumer's credit comes back, and how each side, before it sleeps, makes sure the other
 * writes it a doorbell byte on the TCP socket.  That is all this table holds.  The common
 * code (rs_produce.c, rs_consume.c, rs_doorbell.c, rs_fallback.c, rs_wait.c) calls through
 * c->ops and never asks which transport it runs on; a new transport is one file defining
 * one table, and one value of RS_TRANSPORT_* for the handshake and stat.
 *
 *   rs_shm.c   shm: both rings in one shared segment; the control words are shared too
 *   rs_rdma.c  rdma: records built in a local shadow ring and RDMA WRITTEN to the peer's
 *   rs_tcp.c   tcp: no ring at all (the server declined); the socket is the stream
 *
 * A connection whose ring transport cannot go on moves to TCP without changing its table:
 * that move is rs_fallback.c, common to all transports, and the flags below say what it
 * may rely on.
 */
#ifndef RS_TRANSPORT_H
#define RS_TRANSPORT_H
#include <stddef.h>
#include <stdint.h>

struct rs_conn;

struct rs_transport {
    const char *name;
    uint8_t id;                  /* RS_TRANSPORT_* (rs_contract.h) */

    /* Properties the common code decides by. */
    uint8_t torn_records;        /* a record may look partly written for an instant (a NIC places
                                  * a packet's bytes in any order): corrupt only if it stays so */
    uint8_t lossy_failure;       /* the transport can fail with records posted but not landed:
                                  * a move to TCP resends from the consumer's credit, and the
                                  * receiver leaves its ring at once, not at a MOVED record */
    uint8_t silent_failure;      /* it can fail while we sleep with no byte on the socket to say
                                  * so: sleeps wake in slices to look */
    uint8_t host_objects;        /* the control plane owns objects of it to release after close */
    uint16_t stall_ms;           /* a full ring whose consumer returns no credit this long moves to
                                  * TCP, which buffers far more (0: never): two programs that both
                                  * write before they read go on as over TCP instead of waiting for
                                  * each other forever (where SPILL was agreed, only once it has no
                                  * room left for SPILL records) */
    uint16_t room_recheck_ms;    /* a wait for room in a full ring looks again at least this often
                                  * (0: a credit doorbell is enough): shm to notice a stall, rdma
                                  * to probe a link that may have died under a credit WRITE */

    /* Producer side; the caller holds tx.lock. */
    void (*refresh_credit)(struct rs_conn *c);          /* learn the consumer's head */
    void (*flush)(struct rs_conn *c);                   /* records were written: make them reach the
                                                         * peer, and ring if it asked for a doorbell */
    int  (*arm_credit)(struct rs_conn *c);              /* full ring, before sleeping: ask for a
                                                         * credit doorbell; 1 if room came after all */
    int  (*unread_at_peer)(struct rs_conn *c);          /* 1 if the peer left data of ours unread */
    void (*check_peer)(struct rs_conn *c);              /* waiting for credit: did the peer move? */
    void (*silence)(struct rs_conn *c);                 /* our RESYNC frame goes out: no more bells */

    /* Consumer side; the caller holds rx.lock. */
    void (*publish_credit)(struct rs_conn *c, int force);
    int  (*go_idle)(struct rs_conn *c);                 /* ring empty, about to wait: arm the peer's
                                                         * doorbell; 1 if a record came after all */
    int  (*go_idle_event)(struct rs_conn *c);           /* the same, for a wait that our event bell
                                                         * wakes (rs_bells.c); NULL: go_idle */
    int  (*arm_word)(struct rs_conn *c, const uint32_t **word, uint32_t *seen, size_t room);
                                                        /* ring empty, a blocking receive about to
                                                         * wait: ask the peer to wake a shared word
                                                         * (rs_word_wait) instead of ringing; 1 a
                                                         * record came after all, 0 armed, 2 armed
                                                         * quietly (the receive takes up to `room`
                                                         * bytes; word_woken when it leaves), -1 the
                                                         * transport or the peer has no such word */
    int  (*word_woken)(struct rs_conn *c);              /* a receive armed quietly left its sleep:
                                                         * 1 if records came without a doorbell
                                                         * byte (take them); NULL: never quiet */
    int  (*nonblock_empty)(struct rs_conn *c);          /* a non-blocking receive found nothing */
    void (*tidy)(struct rs_conn *c);                    /* a receive emptied the ring */
    void (*drop_stale)(struct rs_conn *c);              /* the ring is empty: read off doorbells
                                                         * already sent, asking for none */
    void (*after_spill)(struct rs_conn *c);             /* a send that spilled ended (no lock held):
                                                         * no credit doorbell asked, consumed ones
                                                         * read off (rs_spill.c); NULL: no SPILL */
    void (*bell_every)(struct rs_conn *c, int on);      /* the program takes SIGIO (O_ASYNC) or not */
    uint64_t (*peer_posted)(struct rs_conn *c);         /* payload bytes the producer says it put
                                                         * into our ring (no lock; a hint for the
                                                         * holder, rs_hold.c) */

    /* The connection. */
    int  (*may_switch)(struct rs_conn *c);              /* client, before its lazy SWITCH: 0 if the
                                                         * server closes already (send none); NULL: 1 */
    int  (*closing_unswitched)(struct rs_conn *c);      /* server, closing before the client's lazy
                                                         * SWITCH: tells the client; 1 if it is being
                                                         * sent (wait for it); NULL: 0 */
    void (*quiesce)(struct rs_conn *c);                 /* before our FIN: no doorbell asked, none unread */
    void (*closed)(struct rs_conn *c);                  /* after our FIN: read what the peer still rang */
    void (*after_fork_child)(struct rs_conn *c);
    int  (*describe)(struct rs_conn *c, char *buf, size_t n);   /* "; " and the transport's own state
                                                         * (rs_conn_describe); NULL: none */
    void (*free)(struct rs_conn *c);
};

extern const struct rs_transport rs_transport_shm, rs_transport_rdma, rs_transport_tcp;
#endif
