"""Free TCP ports for the servers the demo, the tests and the benchmarks start on 127.0.0.1.

A port learned by binding port 0 comes from the kernel's ephemeral range, the
same range every outgoing connection's source port and every other bind to
port 0 draws from; on a busy machine another process takes it between the
probe and the server's own bind (a rendezvous store failing with
``EADDRINUSE``). A port below that range is handed out by nobody but a caller
choosing it, so a random free one stays free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # above the well-known and most registered service ports


def _chosen_by_nobody() -> range:
    """The ports the kernel never picks: below its ephemeral range, else above it."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    if low - LOWEST >= 4096:
        return range(LOWEST, low)
    return range(high + 1, 65536)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, and that the kernel gives nobody else."""
    ports = _chosen_by_nobody()
    pick = random.SystemRandom()
    for _ in range(64):
        port = pick.choice(ports)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        fallback: int = sock.getsockname()[1]
        return fallback
