"""Same-host peer detection without sending a byte a plain program would receive.

An rdmasock listener registers an abstract UNIX datagram socket named after its network
namespace, address and port; an rdmasock client registers one named after its own local
address and port *before* it connects.  So at connect time the client knows the server
runs rdmasock, and at accept time the server knows the client does and will send a HELLO.
Abstract names vanish with the last descriptor: nothing is left behind after a crash.
The server passes the shared-memory descriptor to the client's name with SCM_RIGHTS."""
import array
import errno
import ipaddress
import os
import socket as _socket

FD_TAG = b"RSKFD1"


def _netns():
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


NETNS = _netns()


def norm_ip(ip):
    """Canonical text of an address; '*' for the unspecified address."""
    try:
        a = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return ip
    if a.version == 6 and a.ipv4_mapped:
        a = a.ipv4_mapped
    return "*" if a.is_unspecified else str(a)


def _name(kind, ip, port):
    return "\0rdmasock/%s/%d/%s/%d" % (kind, NETNS, ip, port)


def _register(name):
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
    try:
        s.bind(name)
    except OSError:
        s.close()
        return None
    return s


def _exists(name):
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
    try:
        s.connect(name)
        return True
    except OSError:
        return False
    finally:
        s.close()


def register_listener(sock):
    """Returns the marker socket (keep it open while listening) or None if taken.
    A wildcard listener registers by family: "*4" (0.0.0.0), "*6" (:: v6-only) or "*46"
    (:: dual-stack), so a client only trusts a listener that can really accept it."""
    sockname = sock.getsockname()
    ip = norm_ip(sockname[0])
    if ip == "*":
        if sock.family == _socket.AF_INET:
            ip = "*4"
        else:
            v6only = _socket.socket.getsockopt(sock, _socket.IPPROTO_IPV6, _socket.IPV6_V6ONLY)
            ip = "*6" if v6only else "*46"
    return _register(_name("l", ip, sockname[1]))


def listener_exists(ip, port):
    ip = norm_ip(ip)
    if ip == "*":
        return False
    wild = ("*4", "*46") if ":" not in ip else ("*6", "*46")
    return any(_exists(_name("l", n, port)) for n in (ip,) + wild)


def register_client(ip, port):
    return _register(_name("c", norm_ip(ip), port))


def client_exists(ip, port):
    return _exists(_name("c", norm_ip(ip), port))


def send_fd(client_ip, client_port, nonce, fd):
    """Server side: hands the segment descriptor to the client's rendezvous name."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM)
    try:
        rights = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", [fd]))]
        s.sendmsg([FD_TAG + nonce], rights, _socket.MSG_DONTWAIT, _name("c", norm_ip(client_ip), client_port))
    finally:
        s.close()


def recv_fd(marker, nonce):
    """Client side: the descriptor sent with our nonce, or None.  Datagrams that do not
    carry our nonce (another local process writing to our name) are discarded."""
    for _ in range(64):
        try:
            data, anc, flags, _ = marker.recvmsg(64, _socket.CMSG_SPACE(4 * 4), _socket.MSG_DONTWAIT | _socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            return None
        fds = array.array("i")
        for level, kind, payload in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        good = data == FD_TAG + nonce and len(fds) == 1 and not flags & _socket.MSG_CTRUNC
        if good:
            return fds[0]
        for fd in fds:
            os.close(fd)
    return None


def is_local_bind_error(exc):
    return exc.errno in (errno.EADDRNOTAVAIL, errno.EINVAL)
