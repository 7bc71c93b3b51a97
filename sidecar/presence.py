"""Whether the trainer is still there: what lets the legacy run container exit.

A legacy sidecar is a regular container, and a Job's pod completes only once
it has exited too, so it must notice that the trainer is gone: also after a
SIGKILL, and without sharing the trainer's PID namespace (a pod without
``shareProcessNamespace``). Leases tell it: every launcher and training process
holds one connection to the socket open for its whole life (``shim/lease.py``),
and the kernel closes it when the process dies. The trainer is gone once every
lease and every ``hello`` connection seen so far is closed. Only while no shim
has connected are pid files consulted, and only those written in this PID
namespace (a pid from another one names nobody, or somebody else); with none
of those either, the agent stops waiting after the start timeout.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from sidecar import safefs

PID_FILE_BYTES = 256  # "<pid> <pid namespace>": far less


def pid_namespace() -> str:
    """This process's PID namespace as the shim writes it on a pid file's second line."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def own_namespace_pids(pids_dir: Path) -> list[int]:
    """The pids of pid files written by processes of this PID namespace.

    The run volume is the trainer's too: each file is read through ``safefs`` (no
    symlink followed, no FIFO waited on, a few bytes at most)."""
    mine = pid_namespace()
    found: list[int] = []
    if not mine:
        return found
    try:
        run_dir = safefs.open_root(pids_dir.parent)
    except OSError:
        return found
    try:
        directory = safefs.open_dir(run_dir, pids_dir.name)
    except OSError:
        return found
    finally:
        os.close(run_dir)
    try:
        with os.scandir(directory) as entries:
            names = [e.name for e in entries if e.name.endswith(".pid")]
        for name in names:
            try:
                fields = safefs.read_small(directory, name, PID_FILE_BYTES).decode().split()
            except (OSError, UnicodeDecodeError):
                continue
            if len(fields) >= 2 and fields[1] == mine and fields[0].isdigit():
                found.append(int(fields[0]))
    finally:
        os.close(directory)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Presence:
    """Leases, connections and pid files of the trainer, as the run phase sees them."""

    pids_dir: Path
    start_timeout: float
    started: float = field(default_factory=time.monotonic)
    open_leases: int = 0
    connected: bool = False  # a lease or a hello arrived at least once
    pids_seen: bool = False

    def leased(self) -> None:
        self.open_leases += 1
        self.connected = True

    def released(self) -> None:
        self.open_leases -= 1

    def gone(self, connections_open: bool) -> str | None:
        """Why the trainer counts as gone, or None while it may still be there."""
        if self.connected:
            if self.open_leases == 0 and not connections_open:
                return "every lease and connection of the trainer is closed"
            return None
        pids = own_namespace_pids(self.pids_dir)
        if pids:
            self.pids_seen = True
        if self.pids_seen:
            return None if any(_alive(pid) for pid in pids) else "its processes have exited"
        if time.monotonic() - self.started > self.start_timeout:
            return f"no trainer process connected within {self.start_timeout:g}s"
        return None
