"""The lease: a shim'd process that imports torch.distributed holds one connection to the
sidecar socket until it dies, also by SIGKILL; a forked child does not keep it open."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.shim.support import PYTHON, ShimEnv, Spawn

HOLDER = """
import os, sys, time
import torch.distributed
child = os.fork() if sys.argv[1] == "fork" else None
if child == 0:
    time.sleep(60)  # the child outlives its parent
    os._exit(0)
print("ready", child, flush=True)
time.sleep(0 if sys.argv[1] == "fork" else 60)
"""


@pytest.fixture
def listener(shim_env: ShimEnv) -> Iterator[socket.socket]:
    """A real Unix socket where the sidecar's would be."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(shim_env.socket))
    server.listen()
    server.settimeout(60)
    yield server
    server.close()


def lease_line(conn: socket.socket) -> dict[str, object]:
    conn.settimeout(30)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        assert chunk, data
        data += chunk
    message: dict[str, object] = json.loads(data)
    return message


def start_time(pid: int) -> int:
    """``pid``'s start time in clock ticks after boot (``/proc/<pid>/stat`` field 22)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return int(stat.read().rsplit(b")", 1)[1].split()[22 - 3])


def test_lease_held_until_sigkill(
    shim_env: ShimEnv, spawn: Spawn, listener: socket.socket, tmp_path: Path
) -> None:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    proc = spawn([PYTHON, str(script), "hold"], shim_env.env)
    conn, _ = listener.accept()
    # The start time names the process where pids are reused (sidecar/trainers.py).
    started = start_time(proc.pid)
    assert lease_line(conn) == {"op": "lease", "pid": proc.pid, "started": started, "v": 1}
    proc.wait_for("ready")
    conn.settimeout(0.5)
    with pytest.raises(TimeoutError):
        conn.recv(1)  # held open while the process lives
    proc.signal(signal.SIGKILL)
    conn.settimeout(10)
    assert conn.recv(1) == b""  # the kernel closed it
    assert proc.wait() == -signal.SIGKILL


def test_forked_child_does_not_hold_the_parents_lease(
    shim_env: ShimEnv, spawn: Spawn, listener: socket.socket, tmp_path: Path
) -> None:
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    proc = spawn([PYTHON, str(script), "fork"], shim_env.env)
    conn, _ = listener.accept()
    assert lease_line(conn)["pid"] == proc.pid
    assert proc.wait() == 0
    child = int(proc.output().split("ready ")[1].split()[0])
    try:
        Path(f"/proc/{child}").stat()  # still sleeping
        conn.settimeout(10)
        assert conn.recv(1) == b""  # the parent is gone: its lease with it
    finally:
        os.kill(child, signal.SIGKILL)
