"""Stream integrity, property-based: random write sizes 1 B..4 MiB, random read sizes,
both directions at once, checksums on both sides.

The RDMA tests run this same test in the Soft-RoCE VM with RDMASOCK_TRANSPORTS=rdma and
RDMASOCK_TEST_TRANSPORT=rdma (the expected transport), fewer examples
(RDMASOCK_TEST_EXAMPLES) and smaller writes (RDMASOCK_TEST_MAX_WRITE): emulated RDMA moves
about 10 MB/s."""
import hashlib
import os
import random
import threading

from hypothesis import HealthCheck, given, settings, strategies as st

import rdmasock

EXPECT = os.environ.get("RDMASOCK_TEST_TRANSPORT", "shm")
EXAMPLES = int(os.environ.get("RDMASOCK_TEST_EXAMPLES", "25"))
MAX_WRITE = int(os.environ.get("RDMASOCK_TEST_MAX_WRITE", str(4 << 20)))

sizes = st.lists(st.one_of(st.integers(1, 512), st.integers(1, 70000), st.integers(1, MAX_WRITE)),
                 min_size=1, max_size=12)


def pump(sock, writes, seed, out):
    rnd = random.Random(seed)
    h = hashlib.sha256()
    for n in writes:
        blob = rnd.randbytes(n)
        h.update(blob)
        sock.sendall(blob)
    sock.shutdown(2 - 1)                          # SHUT_WR
    out["sent"] = h.hexdigest()


def drain(sock, read_sizes, out):
    h, total, i = hashlib.sha256(), 0, 0
    while True:
        d = sock.recv(read_sizes[i % len(read_sizes)])
        i += 1
        if not d:
            break
        h.update(d)
        total += len(d)
    out["got"], out["n"] = h.hexdigest(), total


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a_writes=sizes, b_writes=sizes, a_reads=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=8),
       b_reads=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=8), seed=st.integers(0, 1 << 30))
def test_duplex_stream_integrity(a_writes, b_writes, a_reads, b_reads, seed):
    with rdmasock.create_server(("127.0.0.1", 0)) as srv:
        a = rdmasock.create_connection(srv.getsockname(), timeout=60)
        b, _ = srv.accept()
        b.settimeout(60)
        res = {k: {} for k in ("aw", "ar", "bw", "br")}
        ts = [threading.Thread(target=pump, args=(a, a_writes, seed, res["aw"])),
              threading.Thread(target=drain, args=(b, b_reads, res["br"])),
              threading.Thread(target=pump, args=(b, b_writes, seed + 1, res["bw"])),
              threading.Thread(target=drain, args=(a, a_reads, res["ar"]))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts), "stream stalled"
        assert a.transport == b.transport == EXPECT, (a.fallback_reason, b.fallback_reason)
        assert res["br"]["n"] == sum(a_writes) and res["br"]["got"] == res["aw"]["sent"]
        assert res["ar"]["n"] == sum(b_writes) and res["ar"]["got"] == res["bw"]["sent"]
        a.close()
        b.close()
