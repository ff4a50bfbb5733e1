"""Fallback reason codes: why a connection stayed plain TCP.

The table itself is C's (shim/rs_contract.h, RS_REASONS): each code has a number (carried
in a DECLINE handshake message, see docs/PROTOCOL.md) and a name (shown in
`.fallback_reason`, log lines and `rdmasock stat`).  This module reads it through cffi."""
from ._native import ffi, lib


def _table():
    out = {}
    for code in range(1, 256):
        name = lib.rs_reason_name(code)
        if name == ffi.NULL:
            break
        out[code] = (ffi.string(name).decode(), ffi.string(lib.rs_reason_text(code)).decode())
    return out


REASONS = _table()

# RdmaUnavailable.reason (rdmasock.devices, rdma_setup, transport_rdma) -> reason code name
RDMA_REASONS = {"no_pyverbs": "rdma_unavailable", "no_verbs_build": "rdma_unavailable",
                "no_device": "rdma_unavailable",
                "no_active_port": "rdma_unavailable", "bad_config": "rdma_unavailable",
                "memlock": "memlock", "verbs_setup_failed": "rdma_setup_failed",
                "rdma_setup_failed": "rdma_setup_failed", "bad_params": "rdma_connect_failed",
                "qp_connect_failed": "rdma_connect_failed",
                "ring_memory_limit": "ring_memory_limit"}

CODE_BY_NAME = {name: code for code, (name, _) in REASONS.items()}

# Transport numbers (RS_TRANSPORT_*, shim/rs_contract.h) -> the names users see
TRANSPORTS = {lib.RS_TRANSPORT_TCP: "tcp", lib.RS_TRANSPORT_SHM: "shm", lib.RS_TRANSPORT_RDMA: "rdma"}

# Reasons for a connection that was upgraded and later went on over TCP (rs_fallback.c):
# its log shows a transport=tcp line after the transport=shm/rdma one.
MID_STREAM = ("rdma_failed", "ring_stalled", "urgent_data", "splice", "tx_timestamps", "peer_moved", "exec")


def name(code):
    return REASONS.get(code, ("unknown_%d" % code, ""))[0]


def moved_to_tcp(conn):
    """(reason name, detail) of a connection whose ring went on over TCP mid-stream
    (shim/rs_fallback.c): rdma_failed with the failure's message, or one of MID_STREAM."""
    name_ = name(conn.fb_reason) if conn.fb_reason else "rdma_failed"
    if name_ == "rdma_failed":
        return name_, ffi.string(lib.rs_conn_errmsg(conn)).decode(errors="replace")
    return name_, REASONS[conn.fb_reason][1]


def describe(reason):
    code = CODE_BY_NAME.get(reason.split(":")[0])
    return REASONS[code][1] if code else reason
