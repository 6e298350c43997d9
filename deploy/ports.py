"""Free TCP ports for the servers Baton starts on this machine (HAProxy's side ports, and the
benchmarks' and tests' servers)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# A port from `bind(0)` is one of the kernel's ephemeral ports, which every outgoing
# connection of Ray's processes also takes: between choosing one and the server binding it,
# a connection may take it (seen: a test's HAProxy failed to start its listeners). Ports are
# chosen above Ray's worker ports (10002-19999) and below the ephemeral range instead.
_LOWEST_QUIET_PORT = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A TCP port nothing listens on now, on any interface, outside the ports the kernel
    and Ray's workers hand out (`bind(0)`'s where there is no such room)."""
    try:
        highest = int(_EPHEMERAL_RANGE.read_text().split()[0]) - 1
    except (OSError, ValueError, IndexError):
        highest = 32767  # Linux's default range starts at 32768
    for _ in range(64 if highest > _LOWEST_QUIET_PORT else 0):
        port = random.randint(_LOWEST_QUIET_PORT, highest)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
