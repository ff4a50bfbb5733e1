"""Configuration from the environment (read once per process; see README "Configuration").

Address filters (RDMASOCK_INCLUDE, RDMASOCK_EXCLUDE) are comma-separated entries, each
an address, a network, a port, or an address/network with a port:

    127.0.0.1    10.0.0.0/8    :5432    127.0.0.1:6379    [::1]:80    [fd00::/8]:443

They are matched against the server's address and port (the destination of a connect,
the local address of a listener).  An excluded endpoint stays plain TCP (reason
"excluded"); with RDMASOCK_INCLUDE set, only matching endpoints are upgraded."""
import ipaddress
import os

_keys = None


def keys():
    """key -> (environment variable, default): the table of shim/rs_contract.h
    (RS_CONFIG), keyed by the variable's name without its RDMASOCK_ prefix.  Read from
    the compiled module on first use (`rdmasock doctor` imports this file even when that
    module cannot be loaded, to say so)."""
    global _keys
    if _keys is None:
        from ._native import ffi, lib
        out = {}
        for i in range(lib.rs_config_count()):
            name = ffi.string(lib.rs_config_name(i)).decode()
            out[name[len("RDMASOCK_"):]] = (name, ffi.string(lib.rs_config_default(i)).decode())
        _keys = out
    return _keys


def env_name(key):
    """The environment variable of a configuration key, e.g. "SPIN_US"."""
    return keys()[key][0]


def value(env, key):
    """The key's value in env, its default when unset.  Set but empty is kept: for some
    keys it means off (RDMASOCK_KEEPALIVE, RDMASOCK_TRANSPORTS)."""
    name, default = keys()[key]
    return env.get(name, default)


_TRUE = {"1", "true", "yes", "on"}
LOG_LEVELS = ("off", "error", "info", "debug")


class Config:
    def __init__(self, env=None):
        env = os.environ if env is None else env
        self.disabled = value(env, "DISABLE").lower() in _TRUE
        self.transports = [t.strip() for t in value(env, "TRANSPORTS").split(",") if t.strip()]
        self.ring_size = _pow2(int(value(env, "RING_SIZE")))
        self.spill = value(env, "SPILL").lower() in _TRUE
        self.word_wake = value(env, "WORD_WAKE").lower() in _TRUE
        self.event_bell = value(env, "EVENT_BELL").lower() in _TRUE
        self.quiet_wake = value(env, "QUIET_WAKE").lower() in _TRUE
        self.spin_us = int(value(env, "SPIN_US"))
        self.log_file = value(env, "LOG_FILE") or None
        level = value(env, "LOG_LEVEL").lower()
        default_level = keys()["LOG_LEVEL"][1]
        self.log_level = LOG_LEVELS.index(level if level in LOG_LEVELS else default_level)
        self.handshake_timeout = float(value(env, "HANDSHAKE_TIMEOUT"))
        self.include = _filters(value(env, "INCLUDE"))
        self.exclude = _filters(value(env, "EXCLUDE"))
        # Older spelling, kept: a list of ports.
        self.exclude += [(None, int(p)) for p in value(env, "EXCLUDE_PORTS").split(",") if p.strip()]
        # Remote peers known to run rdmasock (no rendezvous reaches another host): a client
        # sends HELLO to a listed server, a server expects one from a listed client.
        self.peers = _filters(value(env, "PEERS"))
        self.rdma_timeout = float(value(env, "RDMA_TIMEOUT"))
        ka = [int(x) for x in value(env, "KEEPALIVE").split(",") if x.strip()]
        self.keepalive = tuple(ka) if len(ka) == 3 and ka[0] > 0 else None

    def listed_peer(self, host, port):
        """True if RDMASOCK_PEERS names this endpoint (address and, if given, port)."""
        return any(_match(f, host, port) for f in self.peers)

    def excluded(self, host, port):
        """True if the endpoint (server address, port) must stay plain TCP."""
        if any(_match(f, host, port) for f in self.exclude):
            return True
        return bool(self.include) and not any(_match(f, host, port) for f in self.include)


def _filters(text):
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        net, port = item, None
        if item.startswith("["):                       # [v6 or v6/len]:port
            net, _, rest = item[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else None
        elif item.startswith(":"):
            net, port = "", int(item[1:])
        elif item.count(":") == 1:                     # v4:port
            net, p = item.split(":")
            port = int(p)
        out.append((ipaddress.ip_network(net, strict=False) if net else None, port))
    return out


def _match(f, host, port):
    net, fport = f
    if fport is not None and fport != port:
        return False
    if net is None:
        return True
    try:
        a = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return False
    if a.version == 6 and a.ipv4_mapped and net.version == 4:
        a = a.ipv4_mapped
    return a.version == net.version and a in net


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
