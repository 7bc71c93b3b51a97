"""Which ``hello`` begins a new trainer in the pod: the in-place restart (DESIGN 7).

When the trainer container fails, the kubelet restarts it in the same pod
while the native sidecar runs on; the new trainer must resume from the newest
valid checkpoint, so the agent restores again at its ``hello``. Telling that
restart by the timing of connections ("no other process that said ``hello``
is still connected") misreads a process that merely opened another
connection: the shim's client says its ``hello`` again on every fresh
connection, and a save that cannot be streamed file by file (DeepSpeed
ZeRO-3 writes a file twice) resets its connection and hands the checkpoint
over whole on a new one. The restore that misreading started held the JIT
checkpoint out, and the job lost the steps since the last periodic save.

So the restart is recognized by what it is: a ``hello`` from a process that
is none of the trainer's processes known so far, once every one of those is
gone. A process is its pid and its start time (``shim/starttime.py``): a
container restarted without a shared PID namespace numbers its processes
afresh, so the new trainer often has the old one's pid. A process is gone
once it said ``bye``, or once none of its connections and leases is open
(the kernel closes them when it dies, even on SIGKILL). So a process that
reconnects is never a restart, and neither is a new process (a child, the
pod's other ranks) while a known one lives. The trainer's processes are those
that said ``hello``; a launcher only leases: when torchrun starts its workers
again, the new workers resume as a restarted container's would, from the
newest checkpoint.

The pids and start times are what the trainer says, and the trainer is
untrusted: all it can gain by lying is a restore of its own job's newest valid
checkpoint, or none, which restarting itself gets it too. What is remembered
is bounded (``limit``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Process(NamedTuple):
    """One process as it introduced itself: its pid, and its start time (clock ticks after
    boot) when it said one."""

    pid: int
    started: int | None

    def same(self, other: Process) -> bool:
        """Whether both name one process; by pid alone where either said no start time
        (an older shim)."""
        if self.pid != other.pid:
            return False
        return self.started is None or other.started is None or self.started == other.started


class Trainer:
    """The processes of the trainer now in the pod, as their ``hello`` made them known."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._known: dict[Process, bool] = {}  # each process: whether it said ``bye``

    def hello(self, process: Process, live: Iterable[tuple[int, int | None]]) -> bool:
        """Note ``process``'s ``hello``; whether it begins a new trainer in the pod.

        ``live``: the processes, as (pid, start time), holding a connection or a
        lease open now."""
        for known in self._known:
            if known.same(process):
                self._known[known] = False  # back: whatever it said before, it is here
                return False
        alive = self._alive(live)
        new = bool(self._known) and not alive
        if new:
            self._known.clear()
        else:
            self._make_room(alive)
        self._known[process] = False
        return new

    def bye(self, process: Process) -> None:
        """``process`` said ``bye``: it is leaving, whatever it still holds open."""
        for known in self._known:
            if known.same(process):
                self._known[known] = True

    def _alive(self, live: Iterable[tuple[int, int | None]]) -> list[Process]:
        """The known processes that have not said ``bye`` and hold something open."""
        held: dict[int, list[Process]] = {}
        for pid, started in live:
            held.setdefault(pid, []).append(Process(pid, started))
        return [
            known
            for known, left in self._known.items()
            if not left and any(known.same(other) for other in held.get(known.pid, ()))
        ]

    def _make_room(self, alive: list[Process]) -> None:
        """Below ``limit`` for one more: the gone processes go first, then the oldest (a
        trainer this large is forged; what it loses is its own restart being noticed)."""
        if len(self._known) < self.limit:
            return
        living = set(alive)
        for known in [k for k in self._known if k not in living]:
            del self._known[known]
        while len(self._known) >= self.limit:
            del self._known[next(iter(self._known))]
