"""Fallback reason codes: why a connection stayed plain TCP.

Each code has a number (carried in a DECLINE handshake message, see docs/PROTOCOL.md) and
a name (shown in `.fallback_reason`, log lines and `rdmasock stat`)."""

REASONS = {
    1: ("disabled", "rdmasock is disabled by configuration (RDMASOCK_DISABLE)"),
    2: ("excluded", "the address or port is excluded by configuration"),
    3: ("peer_not_rdmasock", "the peer does not run rdmasock (no rendezvous registered)"),
    4: ("not_local", "the peer is on another host and no RDMA transport is available"),
    5: ("marker_busy", "the client rendezvous name for this local port is taken"),
    6: ("shm_unavailable", "shared memory could not be created or mapped"),
    7: ("fd_pass_failed", "the shared-memory descriptor could not be passed to the peer"),
    8: ("version_mismatch", "no common protocol version"),
    9: ("no_common_transport", "the peers share no enabled transport"),
    10: ("handshake_garbage", "the peer sent bytes that are not a valid handshake"),
    11: ("handshake_timeout", "the handshake did not complete in time"),
    12: ("already_connected", "the socket was connected before rdmasock saw it"),
    13: ("peer_declined", "the peer declined the upgrade"),
    14: ("closed_during_handshake", "the peer closed the connection before the handshake finished"),
    15: ("rdma_unavailable", "no usable RDMA device, port or GID (or pyverbs is missing)"),
    16: ("memlock", "the locked-memory limit (ulimit -l) is too low to register the rings"),
    17: ("rdma_setup_failed", "creating the RDMA queue pair or memory regions failed"),
    18: ("rdma_connect_failed", "the peers' RDMA parameters did not fit or the queue pair did not connect"),
    19: ("rdma_failed", "the RDMA transport failed mid-stream: the connection went on over TCP"),
    20: ("peer_unverified", "a rendezvous name exists, but its owner is not the owner of the TCP endpoint"),
}

# RdmaUnavailable.reason (rdmasock.devices, rdma_setup, transport_rdma) -> reason code name
RDMA_REASONS = {"no_pyverbs": "rdma_unavailable", "no_verbs_build": "rdma_unavailable", "no_device": "rdma_unavailable",
                "no_active_port": "rdma_unavailable", "bad_config": "rdma_unavailable",
                "memlock": "memlock", "verbs_setup_failed": "rdma_setup_failed",
                "rdma_setup_failed": "rdma_setup_failed", "bad_params": "rdma_connect_failed",
                "qp_connect_failed": "rdma_connect_failed"}

CODE_BY_NAME = {name: code for code, (name, _) in REASONS.items()}


def name(code):
    return REASONS.get(code, ("unknown_%d" % code, ""))[0]


def describe(reason):
    code = CODE_BY_NAME.get(reason.split(":")[0])
    return REASONS[code][1] if code else reason
