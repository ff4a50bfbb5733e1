"""Configuration from the environment (read once per process; see README "Configuration")."""
import os

_TRUE = {"1", "true", "yes", "on"}


class Config:
    def __init__(self, env=None):
        env = os.environ if env is None else env
        self.disabled = env.get("RDMASOCK_DISABLE", "").lower() in _TRUE
        self.transports = [t.strip() for t in env.get("RDMASOCK_TRANSPORTS", "shm,rdma").split(",") if t.strip()]
        self.ring_size = _pow2(int(env.get("RDMASOCK_RING_SIZE", str(256 * 1024))))
        self.spin_us = int(env.get("RDMASOCK_SPIN_US", "50"))
        self.log_file = env.get("RDMASOCK_LOG_FILE") or None
        self.handshake_timeout = float(env.get("RDMASOCK_HANDSHAKE_TIMEOUT", "5"))
        self.pending_limit = int(env.get("RDMASOCK_PENDING_LIMIT", str(4 * 1024 * 1024)))
        self.exclude_ports = {int(p) for p in env.get("RDMASOCK_EXCLUDE_PORTS", "").split(",") if p.strip()}


def _pow2(n):
    n = max(4096, min(n, 1 << 30))
    return 1 << (n - 1).bit_length()


_config = None


def get():
    global _config
    if _config is None:
        _config = Config()
    return _config


def reload(env=None):
    global _config
    _config = Config(env)
    return _config
