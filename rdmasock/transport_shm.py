"""Set-up of the `shm` transport: the server creates the segment, the client maps the
descriptor it received over the rendezvous socket; both attach the C connection.

Mapped segments count against the process's ring memory budget (RDMASOCK_RING_MEMORY_MAX,
shim/rs_shm.c): a client reserves its share before it offers shm, so that the mapping
after the server's ACCEPT cannot fail for it."""
import errno
import os

from ._native import ffi, lib


class RingMemoryLimit(OSError):
    """The process's ring memory budget is spent: the connection stays TCP."""

    def __init__(self):
        super().__init__(errno.ENOBUFS, "rdmasock: the ring memory budget (RDMASOCK_RING_MEMORY_MAX) is spent")


def segment_bytes(ring_size):
    return lib.RS_SEG_HDR_SIZE + 2 * ring_size


def reserve(ring_size):
    """Reserves the memory of a segment of this ring size; returns the bytes, or None."""
    n = segment_bytes(ring_size)
    return n if lib.rs_ring_memory_reserve(n) == 0 else None


def unreserve(n):
    if n:
        lib.rs_ring_memory_release(n)


def create_segment(ring_size, salt):
    """Returns the memfd of a new segment (the server's side)."""
    lenp = ffi.new("size_t *")
    fd = lib.rs_shm_create(ring_size, salt, lenp)
    if fd < 0:
        raise OSError(-fd, "rdmasock: cannot create shared memory: %s" % os.strerror(-fd))
    return fd


def attach(memfd, tcp_fd, is_server, spin_us, reserved=0):
    """Maps the segment and returns the C connection (freed with release()).  `reserved`:
    bytes of the budget the caller already holds for it (used up, or returned, here)."""
    seg = ffi.new("struct rs_seg *")
    r = lib.rs_shm_map(memfd, seg, reserved)
    if r == -errno.ENOBUFS:
        raise RingMemoryLimit()
    if r < 0:
        raise OSError(-r, "rdmasock: cannot map shared memory: %s" % os.strerror(-r))
    conn = lib.rs_conn_attach_shm(seg, tcp_fd, 1 if is_server else 0, max(0, spin_us) * 1000)
    if conn == ffi.NULL:
        raise MemoryError("rdmasock: out of memory")
    return ffi.gc(conn, lib.rs_conn_free)


def release(conn):
    ffi.release(conn)
