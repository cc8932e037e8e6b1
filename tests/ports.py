"""A free TCP port on the loopback interface, for the servers and process groups tests start."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20_000  # below: ports services take by default (Ray's workers 10002-19999)


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out on its own (to ``bind(0)`` and outgoing connections)."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_port() -> int:
    """A port nothing listens on right now, bound to 127.0.0.1 only, and outside the kernel's ephemeral
    range: a server binds it a moment after it is chosen, and in between the gloo groups of tests running
    beside it make hundreds of sockets whose ports the kernel picks from that range (a port the kernel
    itself picked free was taken so in CI). Another test choosing the same port is the one race left."""
    low, high = ephemeral_range()
    candidates = [*range(LOWEST, low), *range(high + 1, 65536)]
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every one tried is taken: the kernel's choice, as before
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
