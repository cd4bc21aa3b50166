"""Whether the HTTP client of the current request is still connected.

A non-streaming online request writes nothing until its answer is ready, so a client that gave
up is noticed only by looking at its socket: gunicorn puts the connection in the WSGI environ
(``gunicorn.socket``), and a peek that reads end-of-file means the peer closed it. Servers that do
not expose the socket (the Flask test client) count as connected.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from typing import Any


def _always_connected() -> bool:
    return False


def peer_gone(environ: Mapping[str, Any]) -> Callable[[], bool]:
    """A check that is true once the request's client has closed its connection."""
    sock = environ.get("gunicorn.socket")
    if not isinstance(sock, socket.socket):
        return _always_connected

    def gone() -> bool:
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False  # open, nothing sent: still waiting for its answer
        except OSError:
            return True  # reset or closed

    return gone
