"""The files of a staged checkpoint as they are accepted, for an upload that starts early.

A JIT checkpoint is handed over file by file while it is still being written
(the ``staging`` op), so its upload overlaps the save. The upload walks the
job's files as they arrive and ends once the ``staged`` that completes the
checkpoint has closed the arrivals; the manifest is written only after that
(``commit.commit_node``). Files are appended by the acceptance (a worker
thread) before the event loop is woken; ``close`` runs on the event loop, so
a walk never misses a file accepted before the close.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sidecar.safefs import OpenedFile


class Arrivals:
    """A growing list of accepted files (the job's own list), closed when complete."""

    def __init__(self, files: list[OpenedFile]) -> None:
        self.files = files
        self.closed = False
        self._changed = asyncio.Event()

    def wake(self) -> None:
        """More files were accepted (call on the event loop)."""
        self._changed.set()

    def close(self) -> None:
        """Every file is accepted (call on the event loop)."""
        self.closed = True
        self._changed.set()

    async def each(self) -> AsyncIterator[OpenedFile]:
        """Every file, those accepted so far first, then each as it arrives, until closed."""
        seen = 0
        while True:
            while seen < len(self.files):
                yield self.files[seen]
                seen += 1
            if self.closed:
                return
            self._changed.clear()
            await self._changed.wait()
