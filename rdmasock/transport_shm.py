"""Set-up of the `shm` transport: the server creates the segment, the client maps the
descriptor it received over the rendezvous socket; both attach the C connection."""
import errno
import os

from ._native import ffi, lib


def create_segment(ring_size, salt):
    """Returns (memfd, conn) for the server side of a new segment."""
    lenp = ffi.new("size_t *")
    fd = lib.rs_shm_create(ring_size, salt, lenp)
    if fd < 0:
        raise OSError(-fd, "rdmasock: cannot create shared memory: %s" % os.strerror(-fd))
    return fd


def attach(memfd, tcp_fd, is_server, spin_us):
    """Maps the segment and returns the C connection (freed with release())."""
    lenp, errp = ffi.new("size_t *"), ffi.new("int *")
    base = lib.rs_shm_map(memfd, lenp, errp)
    if base == ffi.NULL:
        e = errp[0] or errno.EINVAL
        raise OSError(e, "rdmasock: cannot map shared memory: %s" % os.strerror(e))
    conn = lib.rs_conn_attach_shm(base, lenp[0], tcp_fd, 1 if is_server else 0, max(0, spin_us) * 1000)
    if conn == ffi.NULL:
        raise MemoryError("rdmasock: out of memory")
    return ffi.gc(conn, lib.rs_conn_free)


def release(conn):
    ffi.release(conn)
