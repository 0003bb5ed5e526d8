"""A TCP port for a launch's rendezvous (--master_port) that nothing on this machine listens on now."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
