"""A connection to the sidecar held open for as long as this process lives.

The legacy sidecar (a regular container) must exit once the trainer is gone,
and pids cannot tell it so: pid files name pids of the trainer container's PID
namespace, which mean nothing, or another process, in the sidecar's, and a
SIGKILLed process leaves its file behind. An open Unix socket connection needs
no shared namespace: the kernel closes it when the process dies, however it
dies. The lease is taken when ``torch.distributed`` is imported (launchers and
training processes), not at start-up, so that a ``pip install`` before
``torchrun`` in the same shell does not look like a trainer that came and went.
A forked child closes its copy: the lease stays the process's own.
"""

from __future__ import annotations

import os

from . import protocol, starttime
from .channel import Client
from .log import say_once

_HELD: list[Client] = []


def take(socket_path: str) -> None:
    """Open the lease once per process; without a sidecar socket there is nobody to tell."""
    if _HELD or not os.path.exists(socket_path):
        return
    client = Client(socket_path, timeout=2.0)
    try:
        client.send(protocol.Lease(pid=os.getpid(), started=starttime.started()))
    except OSError as exc:
        say_once("lease", "could not open a lease with the sidecar: %s" % exc)
        return
    _HELD.append(client)
    os.register_at_fork(after_in_child=_forget)


def _forget() -> None:
    """In a forked child: close this copy (the parent's connection stays open)."""
    for client in _HELD:
        client.close()
    del _HELD[:]
