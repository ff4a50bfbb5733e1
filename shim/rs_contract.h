/* rs_contract.h - what C and Python agree on, defined once: step results of the control
 * plane, roles, transports, handshake messages, fallback reasons, configuration keys and
 * the statistics record.  Python reads all of it through cffi (rdmasock/_build_native.py declares this header's names); no number
 * or layout here is written down a second time anywhere. */
#ifndef RS_CONTRACT_H
#define RS_CONTRACT_H
#include <stdint.h>

/* Results of a handshake step (rdmasock/engine.py step) */
#define RS_STEP_PENDING    0    /* still waiting for the peer */
#define RS_STEP_RING       1    /* upgraded: out[0] is the connection */
#define RS_STEP_TCP        2    /* plain TCP from now on */
#define RS_STEP_PRE_RX     3    /* declined server: out[0] unwraps the client's preamble */
#define RS_STEP_CONNECTING 4    /* client: the TCP connect has not completed */

#define RS_ROLE_CLIENT 1
#define RS_ROLE_SERVER 2

#define RS_TRANSPORT_TCP  0
#define RS_TRANSPORT_SHM  1
#define RS_TRANSPORT_RDMA 2

/* Handshake messages (docs/PROTOCOL.md 2): a fixed 64-byte big-endian head, then an
 * extension (RDMA parameters).  The server answers a shm HELLO in C (shim/rs_answer.c)
 * and everything else in Python (rdmasock/handshake.py, upgrade.py). */
#define RS_HS_MAGIC        0x8952444D534B0D0AULL   /* "\x89RDMSK\r\n", read big-endian */
#define RS_HS_VERSION      1
#define RS_HS_LEN          64      /* the head; also the whole message without an extension */
#define RS_HS_MAX_LEN      4096
/* Byte offsets of a message's fields (big-endian; docs/PROTOCOL.md 2.1).  rdmasock/
 * handshake.py checks its struct format against them. */
#define RS_HS_AT_VERSION     8
#define RS_HS_AT_OP         10
#define RS_HS_AT_LEN        12
#define RS_HS_AT_FEATURES   16
#define RS_HS_AT_TRANSPORTS 24
#define RS_HS_AT_REASON     28
#define RS_HS_AT_NONCE      32     /* 16 bytes */
#define RS_HS_AT_RING_LOG2  48     /* 1 byte, then 3 of padding */
#define RS_HS_AT_PID        52
#define RS_HS_AT_SALT       56
#define RS_HS_HELLO        1
#define RS_HS_ACCEPT       2
#define RS_HS_DECLINE      3
#define RS_HS_T_SHM        1
#define RS_HS_T_RDMA       2
#define RS_HS_F_SALTED_FOOTER (1u << 0)  /* footer = hash(salt, seq, lenword) */
#define RS_HS_F_LAZY_CREDIT   (1u << 1)  /* credit returned every quarter ring */
#define RS_HS_F_INBAND_FIN    (1u << 2)  /* half-close travels as a FIN record */
#define RS_HS_F_SPIN_SKIP     (1u << 3)  /* consumer's spin_limit lets the producer skip doorbells */
#define RS_HS_F_PREAMBLE      (1u << 4)  /* client bytes before the answer travel as TCP frames, then SWITCH */
#define RS_HS_F_LAZY_SWITCH   (1u << 5)  /* optional: SWITCH comes with the client's first records, TCP byte or read */
#define RS_HS_F_SPILL         (1u << 6)  /* optional: a full ring spills stream bytes to the socket (shm) */
#define RS_HS_F_FUTEX_WAKE    (1u << 7)  /* optional: a waiting shm receiver may be woken through a futex word */
#define RS_HS_F_EVENT_BELL    (1u << 8)  /* optional: shm receivers may be woken through an eventfd per direction */
#define RS_HS_F_QUIET_WAKE    (1u << 9)  /* optional: a shm receive that takes all that comes is woken without a byte */
#define RS_HS_REQUIRED (RS_HS_F_SALTED_FOOTER | RS_HS_F_LAZY_CREDIT | RS_HS_F_INBAND_FIN | RS_HS_F_SPIN_SKIP | \
                        RS_HS_F_PREAMBLE)
#define RS_HS_SUPPORTED (RS_HS_REQUIRED | RS_HS_F_LAZY_SWITCH | RS_HS_F_SPILL | RS_HS_F_FUTEX_WAKE | \
                         RS_HS_F_EVENT_BELL | RS_HS_F_QUIET_WAKE)

/* How a server answers a shm HELLO without the control plane (shim/rs_answer.c).  A
 * forking server (a PostgreSQL postmaster) accepts in one process and reads the HELLO in
 * a forked child; Python in either, after the fork, would write pages of the interpreter
 * they share: megabytes per connection.  A listener keeps a template that the control
 * plane filled at listen (rdmasock/engine.py listen: name = the prefix of client names),
 * from which C plans an accepted socket (rs_answer_plan); where C cannot decide, the
 * control plane plans it (engine.py accept) and fills one for it (name = the client's). */
struct rs_answer {
    int32_t  engine_fd;     /* the control plane's duplicate of the socket, -1: none (C planned) */
    int32_t  link_fd;       /* C planned: a connection to the client's name (passes the segment) */
    uint32_t features;      /* the handshake features this process offers (RS_HS_F_*) */
    uint32_t spin_ns;       /* RDMASOCK_SPIN_US */
    uint8_t  ring_log2;     /* the largest ring this process grants (RDMASOCK_RING_SIZE) */
    uint8_t  log_level;     /* RDMASOCK_LOG_LEVEL: 2 (info) logs the connection, 3 the bells */
    int16_t  bells_err;     /* answered: why it has no event bells (-errno), 0: it has them or */
    uint8_t  bells_kept;    /*   the client did not ask; kept: 0 not made, 1 made, not kept */
    uint8_t  name_len;      /* the client's rendezvous name (an abstract UNIX name without its */
    char     name[107];     /* leading NUL, rdmasock/rendezvous.py), or a listener's prefix */
};
/* The tag in front of the nonce in the rendezvous message that passes the segment. */
const char *rs_fd_tag(void);

/* Fallback reasons: code, name, meaning.  The codes travel in DECLINE messages
 * (docs/PROTOCOL.md 2.11), the names in logs, `rdmasock stat` and fallback_reason. */
#define RS_REASONS(X) \
    X(1,  DISABLED, "disabled", "rdmasock is disabled by configuration (RDMASOCK_DISABLE)") \
    X(2,  EXCLUDED, "excluded", "the address or port is excluded by configuration") \
    X(3,  PEER_NOT_RDMASOCK, "peer_not_rdmasock", "the peer does not run rdmasock (no rendezvous registered)") \
    X(4,  NOT_LOCAL, "not_local", "the peer is on another host and no RDMA transport is available") \
    X(5,  MARKER_BUSY, "marker_busy", "the client rendezvous name for this local port is taken") \
    X(6,  SHM_UNAVAILABLE, "shm_unavailable", "shared memory could not be created or mapped") \
    X(7,  FD_PASS_FAILED, "fd_pass_failed", "the shared-memory descriptor could not be passed to the peer") \
    X(8,  VERSION_MISMATCH, "version_mismatch", "no common protocol version") \
    X(9,  NO_COMMON_TRANSPORT, "no_common_transport", "the peers share no enabled transport") \
    X(10, HANDSHAKE_GARBAGE, "handshake_garbage", "the peer sent bytes that are not a valid handshake") \
    X(11, HANDSHAKE_TIMEOUT, "handshake_timeout", "the handshake did not complete in time") \
    X(12, ALREADY_CONNECTED, "already_connected", "the socket was connected before rdmasock saw it") \
    X(13, PEER_DECLINED, "peer_declined", "the peer declined the upgrade") \
    X(14, CLOSED_DURING_HANDSHAKE, "closed_during_handshake", "the peer closed the connection before the handshake finished") \
    X(15, RDMA_UNAVAILABLE, "rdma_unavailable", "no usable RDMA device, port or GID (or pyverbs is missing)") \
    X(16, MEMLOCK, "memlock", "the locked-memory limit (ulimit -l) is too low to register the rings") \
    X(17, RDMA_SETUP_FAILED, "rdma_setup_failed", "creating the RDMA queue pair or memory regions failed") \
    X(18, RDMA_CONNECT_FAILED, "rdma_connect_failed", "the peers' RDMA parameters did not fit or the queue pair did not connect") \
    X(19, RDMA_FAILED, "rdma_failed", "the RDMA transport failed mid-stream: the connection went on over TCP") \
    X(20, PEER_UNVERIFIED, "peer_unverified", "a rendezvous name exists, but its owner is not the owner of the TCP endpoint") \
    X(21, RING_MEMORY_LIMIT, "ring_memory_limit", "the process's ring memory would exceed RDMASOCK_RING_MEMORY_MAX") \
    X(22, RING_STALLED, "ring_stalled", "the peer took nothing from a full ring for 500 ms and it could not spill: the connection went on over TCP, which buffers more") \
    X(23, URGENT_DATA, "urgent_data", "the program sent urgent data (MSG_OOB), which only TCP carries: the connection went on over TCP") \
    X(24, PEER_MOVED, "peer_moved", "the peer moved its direction of the stream to TCP (its log says why): ours followed") \
    X(25, SPLICE, "splice", "the program wrote to the socket with splice(), which the kernel does on the TCP socket: the connection went on over TCP") \
    X(26, TX_TIMESTAMPS, "tx_timestamps", "the program asked for transmit timestamps (SO_TIMESTAMPING), which the kernel makes on the TCP path: the connection went on over TCP") \
    X(27, EXEC, "exec", "the program ran exec() and the new program inherits the socket: it knows only the kernel socket, so the connection went on over TCP") \
    X(28, PASSED, "passed", "the program passed the socket to another process (SCM_RIGHTS), which knows only the kernel socket: the connection went on over TCP")

/* Configuration: the environment variables and their defaults (as text; empty: unset).
 * C reads its few through rs_config_get, rdmasock/config.py all of them from this table;
 * README "Configuration" explains each. */
#define RS_CONFIG(X) \
    X(DISABLE, "RDMASOCK_DISABLE", "") \
    X(TRANSPORTS, "RDMASOCK_TRANSPORTS", "shm,rdma") \
    X(RING_SIZE, "RDMASOCK_RING_SIZE", "262144") \
    X(RING_MEMORY_MAX, "RDMASOCK_RING_MEMORY_MAX", "8589934592") \
    X(SPILL, "RDMASOCK_SPILL", "1") \
    X(WORD_WAKE, "RDMASOCK_WORD_WAKE", "1") \
    X(EVENT_BELL, "RDMASOCK_EVENT_BELL", "1") \
    X(QUIET_WAKE, "RDMASOCK_QUIET_WAKE", "1") \
    X(SPIN_US, "RDMASOCK_SPIN_US", "1000") \
    X(LOG_FILE, "RDMASOCK_LOG_FILE", "") \
    X(LOG_LEVEL, "RDMASOCK_LOG_LEVEL", "info") \
    X(HANDSHAKE_TIMEOUT, "RDMASOCK_HANDSHAKE_TIMEOUT", "5") \
    X(INCLUDE, "RDMASOCK_INCLUDE", "") \
    X(EXCLUDE, "RDMASOCK_EXCLUDE", "") \
    X(EXCLUDE_PORTS, "RDMASOCK_EXCLUDE_PORTS", "") \
    X(PEERS, "RDMASOCK_PEERS", "") \
    X(KEEPALIVE, "RDMASOCK_KEEPALIVE", "10,2,3") \
    X(RDMA_TIMEOUT, "RDMASOCK_RDMA_TIMEOUT", "5") \
    X(RDMA_DEVICE, "RDMASOCK_RDMA_DEVICE", "") \
    X(RDMA_PORT, "RDMASOCK_RDMA_PORT", "") \
    X(RDMA_GID_INDEX, "RDMASOCK_RDMA_GID_INDEX", "") \
    X(RDMA_INLINE, "RDMASOCK_RDMA_INLINE", "256")

#define RS_CONFIG_ENUM(sym, name, dflt) RS_CFG_##sym,
enum rs_config_key { RS_CONFIG(RS_CONFIG_ENUM) RS_CONFIG_COUNT };
#undef RS_CONFIG_ENUM
int         rs_config_count(void);
const char *rs_config_name(int key);      /* NULL for an unknown key */
const char *rs_config_default(int key);
const char *rs_config_get(int key);       /* the environment's value, else the default */

#define RS_REASON_ENUM(code, sym, name, text) RS_REASON_##sym = code,
enum rs_reason { RS_REASONS(RS_REASON_ENUM) RS_REASON_COUNT };
#undef RS_REASON_ENUM
const char *rs_reason_name(int code);     /* NULL for an unknown code */
const char *rs_reason_text(int code);

/* One row of `rdmasock stat` (shim/preload/rs_stats.c writes, rdmasock/stat.py reads). */
struct rs_stat_slot {
    uint32_t used;
    int32_t  fd;
    uint8_t  transport;     /* RS_TRANSPORT_* */
    uint8_t  role;          /* RS_ROLE_* */
    uint16_t reason;        /* fallback reason code, 0 = none */
    uint8_t  local[28];     /* struct sockaddr_in or sockaddr_in6 */
    uint8_t  peer[28];
    uint64_t tx_bytes, rx_bytes;
    uint64_t tx_spilled;    /* of tx_bytes, sent over the TCP socket by SPILL (PROTOCOL 6.9) */
};
#define RS_STAT_MAGIC  0x5453534Bu       /* "KSST" */
/* nslots grows (the memfd with it) as connections open; ring_bytes/ring_max are the
 * process's ring memory and its cap (RDMASOCK_RING_MEMORY_MAX) as of the last open/close. */
struct rs_stat_hdr { uint32_t magic, version, nslots, slot_size; uint32_t pid, pad0; uint64_t ring_bytes, ring_max;
                     uint32_t pad[6]; };

#endif
