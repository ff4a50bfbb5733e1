"""rdmasock: TCP connections carried over RDMA or shared memory, transparently.

    import rdmasock
    s = rdmasock.create_connection(("127.0.0.1", 5000))   # like socket.create_connection
    s.transport        # "shm" when the peer runs rdmasock on this host, else "tcp"

The API is imported on first use, so the command line (`rdmasock doctor`) still runs, and
says what is wrong, when the compiled parts cannot load."""
__all__ = ["socket", "create_connection", "create_server", "fromfd", "HandshakeError"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("socket", "create_connection", "create_server", "fromfd"):
        from . import api
        return getattr(api, name)
    if name == "HandshakeError":
        from .handshake import HandshakeError
        return HandshakeError
    raise AttributeError("module 'rdmasock' has no attribute %r" % name)
