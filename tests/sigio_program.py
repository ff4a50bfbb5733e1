"""A program that takes SIGIO (O_ASYNC set with fcntl on the socket's descriptor, which
the rdmasock.socket object does not see) and counts one signal per arrival while it reads
nothing.  argv[1]: "plain" (socket) or "api" (rdmasock.socket).  Prints: signals,
the bytes read afterwards, the transport.  Used by tests/test_api.py and, over rdma, by
the Soft-RoCE VM (tests/rdma/run_inner.py api_sigio)."""
import fcntl
import os
import signal
import socket
import sys
import time

import rdmasock

mod = rdmasock if sys.argv[1] == "api" else socket
srv = mod.create_server(("127.0.0.1", 0))
c = mod.create_connection(srv.getsockname())
s, _ = srv.accept()
c.sendall(b"hi")
assert s.recv(2) == b"hi"
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGIO})
fcntl.fcntl(s.fileno(), fcntl.F_SETOWN, os.getpid())
fcntl.fcntl(s.fileno(), fcntl.F_SETFL, fcntl.fcntl(s.fileno(), fcntl.F_GETFL) | os.O_ASYNC | os.O_NONBLOCK)
try:
    s.recv(16)                                   # nothing there: the program goes idle
except BlockingIOError:
    pass
while signal.sigtimedwait({signal.SIGIO}, 0):
    pass
counts = []
for i in range(3):                               # three arrivals, none read in between
    c.sendall(b"m%d" % i)
    counts.append(signal.sigtimedwait({signal.SIGIO}, 2) is not None)
data = b""
end = time.monotonic() + 5
while len(data) < 6 and time.monotonic() < end:
    try:
        data += s.recv(16)
    except BlockingIOError:
        time.sleep(0.01)
print(sum(counts), data.decode(), getattr(s, "transport", "tcp"))
