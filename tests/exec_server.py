"""A server that runs another program on each accepted socket, as inetd, git daemon or sshd
do (tests/test_exec.py).  Prints its port, accepts one connection, then:

  inetd          runs `python3 exec_server.py echo` on it at once (stdin and stdout are the
                 socket), before the client's first byte is read
  after-request  reads one line first, then runs `sh -c 'printf world'` on it
  echo           (the program run by inetd) copies stdin to stdout until end of stream
  subprocess     reads one line, runs `sh -c 'printf world'` with the socket as its stdout
                 through Python's subprocess (a vfork child that dup2s it onto 1 and closes
                 the rest), then writes "!" itself and prints its own stdin
"""
import os
import socket
import sys


def echo():
    while True:
        b = os.read(0, 65536)
        if not b:
            return
        while b:
            b = b[os.write(1, b):]


def main():
    mode = sys.argv[1]
    if mode == "echo":
        return echo()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    print(lsock.getsockname()[1], flush=True)
    conn, _ = lsock.accept()
    if mode in ("after-request", "subprocess"):
        line = b""
        while not line.endswith(b"\n"):
            got = conn.recv(100)
            if not got:
                return 1
            line += got
    if mode == "subprocess":
        import subprocess
        subprocess.run(["/bin/sh", "-c", "printf world"], stdout=conn.fileno(), check=True, timeout=30)
        conn.sendall(b"!")
        conn.close()
        print(sys.stdin.read(), end="", flush=True)
        return 0
    os.dup2(conn.fileno(), 0)
    os.dup2(conn.fileno(), 1)
    if mode == "inetd":
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "echo"])
    os.execv("/bin/sh", ["sh", "-c", "printf world"])


if __name__ == "__main__":
    sys.exit(main())
