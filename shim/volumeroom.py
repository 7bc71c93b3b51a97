"""Room on the local volume for a periodic checkpoint written behind the training loop.

A checkpoint written behind the loop (``asyncsave``) takes its room on the
volume as soon as its writer starts, and is staged once it is whole. When
uploads are slower than saves, the node would then hold three checkpoints of
its share: the one uploading, the newest whole one queued behind it (kept: a
trainer killed now resumes from it, ``sidecar/backlog.py``), and the one being
written. The volume is sized for two (docs/platform/sizing.md). So the writer
first waits, its snapshot in host memory, until at most one of the node's
checkpoints is not yet committed, then removes the local copies the store has
(``localcopies``) and writes.

Meanwhile the sidecar is told (``holding``, by local rank 0, whose node it
is): it starts no upload of the checkpoint queued when the one uploading is
committed, so the one held, written then, supersedes it and the store gets the
newest state first, not a whole upload later. The hold ends with the
connection, so a trainer killed while it waits still has the queued one
uploaded.

The training loop never waits for this: the next periodic save drops a
snapshot still waiting (it is newer), a JIT save supersedes it as it does any
save in flight, and where the sidecar cannot be asked (gone, an older one)
nothing waits. At the end of training the last save waits at most
``FINISH_SECONDS``, then is written whatever the volume holds: the user's code
after ``train()`` must not wait on a store that is down.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from . import dist
from .channel import Backlog, SidecarLink
from .log import say_once

# How often the writer asks the sidecar while it waits (a status request on the socket).
POLL_SECONDS = 0.2
# The node's checkpoints not yet committed that may be on the volume beside the one written.
MAX_UNCOMMITTED = 1
# How long the last save of a run waits for room once training ended.
FINISH_SECONDS = 120.0

# ``free(step, backlog)``: remove the local copies older than ``step`` that the store has or
# that a newer one replaced, as ``backlog`` says (``LocalCopies.free``).
Free = Callable[[int, Backlog], None]


class VolumeRoom:
    """The writer's wait for room on the volume (one per training process)."""

    def __init__(self, link: SidecarLink, free: Free) -> None:
        self._link = link
        self._free = free

    def wait(self, step: int, cancel: threading.Event, finishing: threading.Event) -> bool:
        """Block the writer thread until checkpoint-``step`` may be written: the volume has
        room, ``cancel`` is set (the save was dropped or superseded), the sidecar cannot
        be asked, or ``finishing`` has been set for ``FINISH_SECONDS``. True when the
        sidecar was told that the checkpoint is held (``released`` then, should it never
        be staged)."""
        held = False
        finished_at: Optional[float] = None
        while not cancel.is_set():
            backlog = self._link.backlog()
            if backlog is None or backlog.uncommitted <= MAX_UNCOMMITTED:
                if backlog is not None:
                    self._free(step, backlog)
                return held
            if finishing.is_set():
                finished_at = time.monotonic() if finished_at is None else finished_at
                if time.monotonic() - finished_at >= FINISH_SECONDS:
                    say_once(
                        "volume-room-at-end",
                        "checkpoint-%d, the last of the run, is written although the local "
                        "volume holds %d checkpoints not yet uploaded: training ended %.0f s "
                        "ago" % (step, backlog.uncommitted, FINISH_SECONDS),
                    )
                    return held
            if not held:
                held = dist.ranks()["local_rank"] == 0 and self._link.holding(step)
                say_once(
                    "volume-room",
                    "checkpoint-%d waits in host memory before it is written: the local "
                    "volume holds %d checkpoints not yet uploaded (uploads are slower than "
                    "saves; the next save replaces a snapshot still waiting)"
                    % (step, backlog.uncommitted),
                )
            cancel.wait(POLL_SECONDS)
        return held

    def released(self, step: int) -> None:
        """Checkpoint-``step``, said to be held, will not be staged: the sidecar's uploads
        of older checkpoints go on at once."""
        self._link.holding(step, released=True)
