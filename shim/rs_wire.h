/* rs_wire.h - the ring wire format shared by every transport (see docs/PROTOCOL.md).
 *
 * One ring per direction lives in the receiver's memory (for shm: in a segment both
 * endpoints map).  The ring is a power-of-two byte array, zeroed at creation.  It holds
 * 8-byte aligned records:
 *
 *     u32 lenword | payload[len] | zero padding | u32 footer        (total = align8(len + 8))
 *
 * lenword is the payload length (1 .. max_payload) or a control code (WRAP, FIN, ...).  The
 * footer is a non-zero 32-bit hash of (salt, record sequence number, lenword): a consumer
 * treats a record as complete only when the footer word holds exactly that value, so
 * zeroed memory, a half-written record, a stale record of an earlier lap and a record of
 * another connection are all told apart from a complete one.
 */
#ifndef RS_WIRE_H
#define RS_WIRE_H
#include <stdint.h>
#include <stddef.h>

#define RS_PROTO_VERSION   1u
#define RS_SEG_MAGIC       0x52534B31u          /* "RSK1" */
#define RS_SEG_HDR_SIZE    4096u                /* segment header page, control blocks */
#define RS_RING_MIN        4096u
#define RS_RING_MAX        (1u << 30)

#define RS_LEN_WRAP        0xFFFFFFFFu          /* skip to ring offset 0 */
#define RS_LEN_FIN         0xFFFFFFFEu          /* sender shut down its direction: EOF after this */
#define RS_LEN_RESET       0xFFFFFFFDu          /* sender closed abortively (SO_LINGER 0, or with data of
                                                 * ours unread): ECONNRESET after this, as TCP's RST */
#define RS_LEN_MOVED       0xFFFFFFFCu          /* sender's direction goes on over the TCP socket: a RESYNC
                                                 * frame resuming at exactly this point is there (PROTOCOL 6.8) */
#define RS_LEN_SPILL       0xFFFFFFFBu          /* the next u32 (count) stream bytes are on the TCP socket,
                                                 * behind a SPILL mark; then this ring again (PROTOCOL 6.9) */
#define RS_LEN_CTL_MIN     0xFFFFFF00u          /* lenwords >= this are control codes */

#define RS_BELL_DATA       0xD7u                /* doorbell byte: new records in your ring */
#define RS_BELL_CREDIT     0xC7u                /* doorbell byte: credit returned for your ring */
#define RS_BELL_RESYNC     0xE5u                /* first byte of a RESYNC frame: the rest of the stream is TCP */
#define RS_BELL_SPILL      0xE6u                /* first byte of a SPILL mark: spilled stream bytes follow */
/* rs_dir_ctl.want_bell, bits: a doorbell byte for the next record (1), for every
 * publication (2: the consumer's program takes SIGIO, which the kernel raises for each
 * arrival), a futex wake-up on data_seq for the next record (4: FUTEX_WAKE feature), the
 * consumer's eventfd raised for the next record (8: EVENT_BELL feature), the wake-up of 4
 * without a byte if the receives asleep take all that is unread (16: QUIET_WAKE, with
 * quiet_limit); with 1, the consumer sleeps in the kernel until the byte comes (32: a
 * producer does not wait for it to take the record first, PROTOCOL 6.3 step 4a) */
#define RS_WANT_NEXT       1u
#define RS_WANT_EVERY      2u
#define RS_WANT_FUTEX      4u
#define RS_WANT_EVENT      8u
#define RS_WANT_QUIET      16u
#define RS_WANT_SLEEPS     32u
/* rs_dir_ctl.tx_waiting, bits: a credit doorbell byte (1), a futex wake-up on credit_seq (2) */
#define RS_WAIT_BELL       1u
#define RS_WAIT_FUTEX      2u
/* rdma: the bit of want_seq that asks for a doorbell after every publication */
#define RS_WANT_SEQ_EVERY  (1ull << 63)
#define RS_RESYNC_LEN      16u                  /* u8 0xE5, u8 version 1, u16 0, u32 check, u64 resume offset */
#define RS_RESYNC_VERSION  1u
#define RS_RESYNC_TAG      0xE5E5E5E5u          /* lenword given to rs_footer for the frame's check */
#define RS_SPILL_MARK_LEN  8u                   /* u8 0xE6, u8 version 1, u16 0, u32 check */
#define RS_SPILL_VERSION   1u
#define RS_SPILL_TAG       0xE6E6E6E6u          /* lenword given to rs_footer for the mark's check */
#define RS_SPILL_MAX       (1u << 30)           /* largest count a SPILL record may carry */

/* Total ring bytes a record with this lenword occupies.  SPILL carries its count in the
 * word after the lenword (then a zero word, then the footer). */
static inline uint32_t rs_rec_size(uint32_t lenword)
{
    if (lenword == RS_LEN_SPILL) return 16;
    if (lenword >= RS_LEN_CTL_MIN) return 8;
    return (lenword + 8u + 7u) & ~7u;
}

/* Largest payload of one record: a quarter ring, so a record plus the worst-case wrap
 * waste always fits in the space a lazily-published credit guarantees. */
static inline uint32_t rs_max_payload(uint32_t ring_size) { return ring_size / 4u - 8u; }

/* Little-endian integers of n bytes in frames on the socket (RESYNC, SPILL mark) and in
 * record fields, whatever the host's order. */
static inline void rs_put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint64_t rs_get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* The validity footer.  Never 0 (0 is "not written yet"). */
static inline uint32_t rs_footer(uint64_t salt, uint64_t seq, uint32_t lenword)
{
    uint64_t x = salt ^ (seq * 0x9E3779B97F4A7C15ull) ^ (((uint64_t)lenword << 32) | lenword);
    x ^= x >> 33; x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33; x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    uint32_t f = (uint32_t)x ^ (uint32_t)(x >> 32);
    return f ? f : 0x5A5A5A5Au;
}

/* Control words of one direction.  In the shm transport they live in the segment header;
 * each half is written by one side only and sits on its own cache lines. */
struct rs_dir_ctl {
    /* written by the consumer (receiver of this direction) */
    uint64_t head;          /* ring bytes consumed and re-zeroed: the producer's credit */
    uint64_t spin_limit;    /* payload position a spinning consumer is sure to absorb */
    uint32_t spinning;      /* consumer busy-polls the ring: no doorbell needed up to spin_limit */
    uint32_t want_bell;     /* consumer wants a doorbell for new data: RS_WANT_* bits */
    uint64_t credit_bells;  /* doorbell bytes the consumer sent to wake a credit-blocked producer */
    uint32_t credit_seq;    /* futex word: raised with credit for a producer asleep on it */
    uint32_t rx_cpu;        /* advisory: 1 + the CPU the consumer ran on when it last
                             * published credit (0 unknown) */
    uint64_t quiet_limit;   /* with RS_WANT_QUIET: payload position (tx_bytes terms) up to which
                             * the receives asleep are sure to take what comes */
    uint32_t closing;       /* advisory (c2s): the server closes before it read the client's
                             * SWITCH; a client that has not sent it sends none */
    uint8_t  pad0[64 - 52];
    /* written by the producer (sender of this direction) */
    uint64_t tx_bytes;      /* payload bytes published into the ring, as of the last wait for credit */
    uint64_t data_bells;    /* doorbell bytes the producer sent to wake the consumer */
    uint32_t tx_waiting;    /* producer is blocked on a full ring, wants credit: RS_WAIT_* bits */
    uint32_t tx_cpu;        /* advisory: 1 + the CPU the producer last ran on (0 unknown) */
    uint32_t data_seq;      /* futex word: raised with a record for a consumer asleep on it */
    uint32_t switching;     /* advisory (c2s): the client sends its SWITCH (1) or, told that the
                             * server closes, sends none (2) */
    uint8_t  pad1[64 - 32];
};

_Static_assert(sizeof(struct rs_dir_ctl) == 128, "two cache lines, one per writer (PROTOCOL 4.4)");

/* Header page of a shm segment: [hdr page][ring 0: client->server][ring 1: server->client] */
struct rs_seg_hdr {
    uint32_t magic;
    uint32_t version;
    uint32_t ring_size;
    uint32_t hdr_size;
    uint64_t salt;
    uint8_t  pad[64 - 24];
    struct rs_dir_ctl dir[2];
};

#define RS_DIR_C2S 0
#define RS_DIR_S2C 1

#endif
