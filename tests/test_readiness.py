"""select, selectors and asyncio see correct readiness on fileno()."""
import asyncio
import select
import selectors
import socket
import threading
import time

import pytest

import rdmasock
from conftest import recv_exact


def test_select_wakes_for_ring_data_and_partial_reads(pair):
    c, s = pair()
    c.sendall(b"warm")
    recv_exact(s, 4)
    assert select.select([s], [], [], 0.05)[0] == []          # idle: not readable
    threading.Timer(0.05, c.sendall, args=(b"x" * 5000,)).start()
    assert select.select([s], [], [], 5)[0] == [s]
    s.setblocking(False)
    got = b""
    while len(got) < 5000:                  # small reads, select between them: never stuck
        assert select.select([s], [], [], 5)[0] == [s], "readable data but select says no"
        try:
            got += s.recv(700)
        except BlockingIOError:
            pass
    assert got == b"x" * 5000


def test_first_write_wakes_a_nonblocking_reader_with_data():
    """The server's socket becomes readable through the client's first write (which also
    ends the client's handshake): the read after select finds that data, never EAGAIN
    (CPython test_socket NonBlockingTCPTests.testRecv)."""
    srv = rdmasock.create_server(("127.0.0.1", 0))
    try:
        for i in range(40):
            cli = rdmasock.socket()
            go = threading.Event()

            def client():
                cli.connect(srv.getsockname())
                go.wait(5)
                cli.sendall(b"first bytes %d" % i)

            t = threading.Thread(target=client)
            t.start()
            conn, _ = srv.accept()
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):
                conn.recv(100)
            go.set()
            assert select.select([conn], [], [], 5)[0] == [conn]
            assert conn.recv(100) == b"first bytes %d" % i
            assert conn.transport == "shm"
            t.join(5)
            conn.close()
            cli.close()
    finally:
        srv.close()


def test_peek_does_not_hide_readiness(pair):
    c, s = pair()
    s.settimeout(0.5)
    threading.Timer(0.05, c.sendall, args=(b"peekaboo",)).start()
    assert s.recv(4, socket.MSG_PEEK) == b"peek"
    assert select.select([s], [], [], 2)[0] == [s]
    assert s.recv(100) == b"peekaboo"


def test_selectors_nonblocking_echo():
    sel = selectors.DefaultSelector()
    srv = rdmasock.create_server(("127.0.0.1", 0))
    srv.setblocking(False)
    sel.register(srv, selectors.EVENT_READ, "accept")
    clients = [rdmasock.create_connection(srv.getsockname(), timeout=10) for _ in range(5)]
    conns = []
    deadline = time.monotonic() + 20
    echoed = 0
    sent = False
    while echoed < 5 and time.monotonic() < deadline:
        if len(conns) == 5 and not sent:    # (writes before accept+idle: known gap, test_api)
            for i, c in enumerate(clients):
                c.sendall(b"msg%d" % i)
            sent = True
        for key, ev in sel.select(1):
            if key.data == "accept":
                conn, _ = srv.accept()
                conn.setblocking(False)
                conns.append(conn)
                sel.register(conn, selectors.EVENT_READ, "conn")
            else:
                try:
                    d = key.fileobj.recv(100)
                except BlockingIOError:
                    continue
                key.fileobj.sendall(d)
                echoed += 1
    for i, c in enumerate(clients):
        assert recv_exact(c, len(b"msg%d" % i)) == b"msg%d" % i
        assert c.transport == "shm"
    assert echoed == 5 and all(x.transport == "shm" for x in conns)
    for x in clients + conns + [srv]:
        x.close()
    sel.close()


def test_asyncio_sock_api():
    async def main():
        loop = asyncio.get_running_loop()
        srv = rdmasock.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.setblocking(False)

        async def server():
            conn, _ = await loop.sock_accept(srv)
            total = b""
            while True:
                d = await loop.sock_recv(conn, 65536)
                if not d:
                    break
                total += d
            await loop.sock_sendall(conn, total[::-1])
            conn.close()
            return conn.transport

        task = asyncio.create_task(server())
        c = rdmasock.socket()
        c.setblocking(False)
        await loop.sock_connect(c, srv.getsockname())
        payload = bytes(range(256)) * 3000
        await loop.sock_sendall(c, payload)
        c.shutdown(socket.SHUT_WR)
        got = b""
        while len(got) < len(payload):
            d = await loop.sock_recv(c, 100000)
            if not d:
                break
            got += d
        assert got == payload[::-1]
        assert await asyncio.wait_for(task, 20) == "shm"
        assert c.transport == "shm"
        c.close()
        srv.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_asyncio_streams_on_rdmasock_sockets(pair):
    c, s = pair()
    c.setblocking(False)
    s.setblocking(False)

    async def main():
        cr, cw = await asyncio.open_connection(sock=c)
        sr, sw = await asyncio.open_connection(sock=s)
        cw.write(b"line\n" * 1000)
        await cw.drain()
        for _ in range(1000):
            assert await sr.readline() == b"line\n"
        sw.write(b"done\n")
        await sw.drain()
        assert await cr.readline() == b"done\n"

    asyncio.run(asyncio.wait_for(main(), 30))
    assert c.transport == "shm"
