"""Connection outcome log (RDMASOCK_LOG_FILE).  Never writes to stdout/stderr; a log file
that cannot be written is ignored so the program runs on."""
import os
import time

from . import config


def connection(role, local, peer, transport, reason=None):
    """One line per connection outcome (RDMASOCK_LOG_LEVEL info and above)."""
    text = "role=%s local=%s peer=%s transport=%s" % (role, _fmt(local), _fmt(peer), transport)
    line(text + (" reason=%s" % reason if reason else ""), level=2)


def line(text, level=1):
    """Appends one line (level 1 error, 2 info, 3 debug) to the log file, if one is
    configured and RDMASOCK_LOG_LEVEL lets it through."""
    cfg = config.get()
    path = cfg.log_file
    if not path or cfg.log_level < level:
        return
    try:
        # O_NOFOLLOW: a symlink planted at the path must not redirect our writes; 0600:
        # connection lines name addresses and ports that are nobody else's business.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY, 0o600)
        try:
            os.write(fd, ("%s pid=%d %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), os.getpid(), text)).encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def _fmt(addr):
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = addr[0]
        return "[%s]:%d" % (host, addr[1]) if ":" in host else "%s:%d" % (host, addr[1])
    return str(addr)
