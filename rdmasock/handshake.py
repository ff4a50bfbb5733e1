"""The upgrade handshake carried over the connection's own TCP stream (docs/PROTOCOL.md).

Fixed 64-byte big-endian messages, versioned, with feature bits negotiated the way the
Valkey/Redis RDMA protocol does it (the server answers with the subset it supports):

    0  magic     8  "\\x89RDMSK\\r\\n"
    8  version   2
   10  opcode    2  1 HELLO (client), 2 ACCEPT (server), 3 DECLINE (server)
   12  length    4  total message length (64 in version 1; at most 4096)
   16  features  8
   24  transports 4 HELLO: offered bits; ACCEPT: the chosen bit
   28  reason    4  DECLINE: reason code (rdmasock.reasons)
   32  nonce    16  HELLO: random; ACCEPT/DECLINE: echoed
   48  ring_log2 1  HELLO: requested ring size; ACCEPT: granted
   49  pad       3
   52  pid       4  sender's pid (diagnostics only)
   56  salt      8  ACCEPT: footer salt of the segment
   64  extension    (length - 64 bytes) HELLO offering rdma / ACCEPT of rdma: the sender's
                    RDMA PARAMS (rdmasock.rdma_setup, 88 bytes)
"""
import struct

MAGIC = b"\x89RDMSK\r\n"
VERSION = 1
MSG = struct.Struct(">8sHHIQII16sB3xIQ")
MSG_LEN = MSG.size
MAX_LEN = 4096
assert MSG_LEN == 64

OP_HELLO, OP_ACCEPT, OP_DECLINE = 1, 2, 3
T_SHM, T_RDMA = 1, 2
TRANSPORT_BITS = {"shm": T_SHM, "rdma": T_RDMA}

F_SALTED_FOOTER = 1 << 0   # footer = hash(salt, seq, lenword)
F_LAZY_CREDIT = 1 << 1     # credit returned every quarter ring
F_INBAND_FIN = 1 << 2      # half-close travels as a FIN record
F_SPIN_SKIP = 1 << 3       # consumer's spin_limit lets the producer skip doorbells
F_PREAMBLE = 1 << 4        # client bytes before the answer travel as TCP frames, then SWITCH
F_LAZY_SWITCH = 1 << 5     # optional: the client's SWITCH comes with its first records, TCP byte or read
F_SPILL = 1 << 6           # optional: a full ring spills stream bytes to the socket (SPILL records, shm)
F_FUTEX_WAKE = 1 << 7      # optional: a waiting shm receiver may be woken through a futex word
F_EVENT_BELL = 1 << 8      # optional: shm receivers may be woken through an eventfd per direction
F_QUIET_WAKE = 1 << 9      # optional: a shm receive that takes all that comes is woken without a byte
REQUIRED = F_SALTED_FOOTER | F_LAZY_CREDIT | F_INBAND_FIN | F_SPIN_SKIP | F_PREAMBLE
SUPPORTED = REQUIRED | F_LAZY_SWITCH | F_SPILL | F_FUTEX_WAKE | F_EVENT_BELL | F_QUIET_WAKE


class HandshakeError(ConnectionError):
    """The peer sent bytes that are not a valid rdmasock handshake."""

    def __init__(self, reason, message):
        import errno
        super().__init__(errno.EPROTO, message)
        self.reason = reason


class Message:
    __slots__ = ("version", "op", "length", "features", "transports", "reason", "nonce", "ring_log2", "pid", "salt",
                 "ext")

    def __init__(self, op, features=0, transports=0, reason=0, nonce=b"\0" * 16, ring_log2=0, pid=0, salt=0,
                 version=VERSION, length=MSG_LEN, ext=b""):
        self.version, self.op, self.length = version, op, length
        self.features, self.transports, self.reason = features, transports, reason
        self.nonce, self.ring_log2, self.pid, self.salt = nonce, ring_log2, pid, salt
        self.ext = ext

    def pack(self):
        return MSG.pack(MAGIC, self.version, self.op, MSG_LEN + len(self.ext), self.features, self.transports,
                        self.reason, self.nonce, self.ring_log2, self.pid, self.salt) + bytes(self.ext)


def classify(prefix):
    """'more' if prefix could still become a handshake message, 'no' if it cannot be one."""
    n = min(len(prefix), len(MAGIC))
    return "more" if prefix[:n] == MAGIC[:n] else "no"


def parse(buf, expect_ops):
    """Parses one message from buf (at least 64 bytes).  Raises HandshakeError."""
    if buf[:8] != MAGIC:
        raise HandshakeError("handshake_garbage", "rdmasock: handshake: bad magic %r" % bytes(buf[:8]))
    (_, version, op, length, features, transports, reason, nonce, ring_log2, pid, salt) = MSG.unpack_from(buf)
    if length < MSG_LEN or length > MAX_LEN:
        raise HandshakeError("handshake_garbage", "rdmasock: handshake: bogus message length %d" % length)
    if op not in expect_ops:
        raise HandshakeError("handshake_garbage", "rdmasock: handshake: unexpected opcode %d" % op)
    if version == 0:
        raise HandshakeError("handshake_garbage", "rdmasock: handshake: version 0")
    return Message(op, features, transports, reason, nonce, ring_log2, pid, salt, version, length,
                   bytes(buf[MSG_LEN:length]))


def declared_length(buf):
    """The length field of a message whose first 16 bytes are in buf."""
    return struct.unpack_from(">I", buf, 12)[0]
