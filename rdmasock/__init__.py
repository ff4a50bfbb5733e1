"""rdmasock: TCP connections carried over RDMA or shared memory, transparently.

    import rdmasock
    s = rdmasock.create_connection(("127.0.0.1", 5000))   # like socket.create_connection
    s.transport        # "shm" when the peer runs rdmasock on this host, else "tcp"
"""
from .api import create_connection, create_server, socket
from .handshake import HandshakeError

__all__ = ["socket", "create_connection", "create_server", "HandshakeError"]
__version__ = "0.1.0"
