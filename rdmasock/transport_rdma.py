"""Set-up of the `rdma` transport (docs/RDMA.md, docs/PROTOCOL.md section 5).

Each side allocates one block of memory (shim/rs_rdma.h):

    [own counters 64 B][mirror of the peer's 64 B][READ landing 64 B] ... [rx ring][tx shadow]

and registers it in its own protection domain (one PD per connection, so a peer's rkeys
reach that connection's memory and nothing else):

    own counters   remote READ          the peer reads them when it must not miss an update
    mirror         remote WRITE         the peer pushes its counters here
    READ landing   local write
    rx ring        remote WRITE         the peer's records land here (never relaxed ordering)
    tx shadow      local only           records are built here and posted from here

The PARAMS of both sides travel in the handshake (HELLO / ACCEPT extension); the QP then
goes INIT -> RTR -> RTS and the C data path (shim/rs_rdma.c) posts the work requests."""
import errno

from . import config, rdma_setup
from ._native import ffi, lib
from .devices import RdmaUnavailable

SQ_DEPTH = 256

# Live connections' verbs objects, by C connection address: the QP and the memory regions
# must outlive every post, and be destroyed before the C side unmaps the memory.
_sides = {}


class Side:
    """One side of one rdma connection: memory, endpoint, then (attach) the C connection."""

    def __init__(self, ring_size):
        if not lib.rs_rdma_supported():
            from .doctor import NO_VERBS_BUILD
            raise RdmaUnavailable("no_verbs_build", NO_VERBS_BUILD)
        self.ring_size = ring_size
        lenp = ffi.new("size_t *")
        base = lib.rs_rdma_alloc(ring_size, lenp)
        if base == ffi.NULL:
            if ffi.errno == errno.ENOBUFS:
                raise RdmaUnavailable("ring_memory_limit", "RDMASOCK_RING_MEMORY_MAX would be exceeded (%d bytes in use)"
                                      % lib.rs_ring_memory_in_use())
            raise RdmaUnavailable("rdma_setup_failed", "cannot allocate %d bytes of ring memory" % (2 * ring_size))
        self.base, self.length, self.ep = base, lenp[0], None
        addr = int(ffi.cast("uintptr_t", base))
        try:
            ep = self.ep = rdma_setup.Endpoint(sq_depth=SQ_DEPTH)
            ep.register_words(addr + lib.RS_RDMA_OFF_OWN, 64)
            ep.register_credit(addr + lib.RS_RDMA_OFF_MIRROR, 64)
            ep.register_local("sync", addr + lib.RS_RDMA_OFF_SYNC, 64)
            ep.register_ring(addr + lib.RS_RDMA_HDR, ring_size)
            ep.register_source(addr + lib.RS_RDMA_HDR + ring_size, ring_size, name="shadow")
        except BaseException:
            self.close()
            raise

    def params(self):
        return self.ep.local_params()

    def connect(self, peer_params, fd, salt, spin_us):
        """Import the peer's PARAMS, bring the QP to RTS and build the C connection."""
        ep = self.ep
        ep.connect(peer_params)
        peer = ep.peer
        if peer.ring_len != self.ring_size or peer.credit_len < 64 or peer.words_len < 64:
            raise RdmaUnavailable("bad_params", "peer ring %d bytes (ours %d), mirror %d, words %d"
                                  % (peer.ring_len, self.ring_size, peer.credit_len, peer.words_len))
        p = ffi.new("struct rs_rdma_params *")
        ep.fill_params(p)                    # the QP and CQ rs_verbs.c made, and the inline size
        p.lkey_own = ep.region("words").lkey
        p.lkey_sync = ep.region("sync").lkey
        p.lkey_shadow = ep.region("shadow").lkey
        p.rkey_ring, p.raddr_ring = peer.ring_rkey, peer.ring_addr
        p.rkey_mirror, p.raddr_mirror = peer.credit_rkey, peer.credit_addr
        p.rkey_words, p.raddr_words = peer.words_rkey, peer.words_addr
        p.sq_depth = SQ_DEPTH
        p.sync_timeout_ms = int(config.get().rdma_timeout * 1000)
        conn = lib.rs_conn_attach_rdma(self.base, self.length, self.ring_size, salt, fd,
                                       max(0, spin_us) * 1000, p)
        if conn == ffi.NULL:
            raise RdmaUnavailable("rdma_setup_failed", "cannot attach the connection")
        self.base = None                     # the C connection owns (and unmaps) the memory now
        _sides[int(ffi.cast("uintptr_t", conn))] = self
        return ffi.gc(conn, lib.rs_conn_free)

    def close(self):
        """Destroy the verbs objects (after the C side quiesced), then free the memory if
        no C connection owns it yet."""
        if self.ep is not None:
            self.ep.close()
            self.ep = None
        if self.base is not None:
            lib.rs_rdma_unalloc(self.base, self.length)
            self.base = None


def release(conn_addr, quiesce_ms=2000):
    """The C connection at conn_addr is being freed: let its last WRITEs leave, then
    destroy its verbs objects.  Returns True if it was an rdma connection."""
    side = _sides.pop(conn_addr, None)
    if side is None:
        return False
    conn = ffi.cast("rs_conn *", conn_addr)
    lib.rs_rdma_quiesce(conn, quiesce_ms)
    lib.rs_rdma_drain(conn)            # unread doorbells would make the close send RST
    side.close()
    return True
