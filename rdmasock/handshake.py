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

from ._native import lib

# The numbers are shim/rs_contract.h's (RS_HS_*): the server's shm answer is made in C too.
MAGIC = lib.RS_HS_MAGIC.to_bytes(8, "big")
VERSION = lib.RS_HS_VERSION
# The fields of the head in order, and where shim/rs_contract.h says each one starts.
_FIELDS = ("8s", "H", "H", "I", "Q", "I", "I", "16s", "B3x", "I", "Q")
_AT = (0, lib.RS_HS_AT_VERSION, lib.RS_HS_AT_OP, lib.RS_HS_AT_LEN, lib.RS_HS_AT_FEATURES, lib.RS_HS_AT_TRANSPORTS,
       lib.RS_HS_AT_REASON, lib.RS_HS_AT_NONCE, lib.RS_HS_AT_RING_LOG2, lib.RS_HS_AT_PID, lib.RS_HS_AT_SALT)
MSG = struct.Struct(">" + "".join(_FIELDS))
if any(struct.calcsize(">" + "".join(_FIELDS[:i])) != at for i, at in enumerate(_AT)):
    raise ImportError("rdmasock: the handshake layout differs from shim/rs_contract.h's")
MSG_LEN = MSG.size
MAX_LEN = lib.RS_HS_MAX_LEN
assert MSG_LEN == lib.RS_HS_LEN

OP_HELLO, OP_ACCEPT, OP_DECLINE = lib.RS_HS_HELLO, lib.RS_HS_ACCEPT, lib.RS_HS_DECLINE
T_SHM, T_RDMA = lib.RS_HS_T_SHM, lib.RS_HS_T_RDMA
TRANSPORT_BITS = {"shm": T_SHM, "rdma": T_RDMA}

F_SALTED_FOOTER = lib.RS_HS_F_SALTED_FOOTER
F_LAZY_CREDIT = lib.RS_HS_F_LAZY_CREDIT
F_INBAND_FIN = lib.RS_HS_F_INBAND_FIN
F_SPIN_SKIP = lib.RS_HS_F_SPIN_SKIP
F_PREAMBLE = lib.RS_HS_F_PREAMBLE
F_LAZY_SWITCH = lib.RS_HS_F_LAZY_SWITCH
F_SPILL = lib.RS_HS_F_SPILL
F_FUTEX_WAKE = lib.RS_HS_F_FUTEX_WAKE
F_EVENT_BELL = lib.RS_HS_F_EVENT_BELL
F_QUIET_WAKE = lib.RS_HS_F_QUIET_WAKE
REQUIRED = lib.RS_HS_REQUIRED
SUPPORTED = lib.RS_HS_SUPPORTED


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
