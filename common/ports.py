"""A TCP port for a launch's rendezvous (--master_port) that nothing on this machine listens on now."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # above the registered services most machines run


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(low: int = LOWEST, high: int | None = None) -> int:
    """A port of [low, high) that nothing listens on, at random below the ephemeral range by default. A port
    the kernel handed out (bind to port 0) is one it may hand out again, to another job's choice or to the
    listeners and connections gloo opens by the hundred, before the rank binds it: two jobs then met on one
    port and hung (seen under pytest -n 2)."""
    high = ephemeral_start() if high is None else high
    if high - low < 100:  # no room below an unusual ephemeral range: the kernel's choice
        low, high = 0, 0
    for _ in range(100):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", random.randrange(low, high) if high else 0))
            except OSError:  # in use
                continue
            return probe.getsockname()[1]
    raise OSError(f"no free TCP port among {low}-{high - 1} after 100 tries")
