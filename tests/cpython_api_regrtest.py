"""CPython's regression-test runner with socket.socket replaced by rdmasock.socket, as a
program that patches the socket module would do it (tests/test_cpython_suites.py).
Arguments as for `python -m test`."""
import socket

import rdmasock

socket.socket = rdmasock.socket

from test.libregrtest import main  # noqa: E402  (after the patch: the tests import socket)

main()
