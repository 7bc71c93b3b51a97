"""The local volume's peak: the most bytes a run held on disk at once, sampled.

A product that stages checkpoints locally before uploading them needs a volume that
holds them: the pod's emptyDir or ephemeral storage is sized for its peak, and an
eviction for ephemeral storage is a preemption of its own. The peak is sampled from a
thread every ``interval`` seconds, the files under the run's roots counted by the blocks
they hold (a sparse or preallocated file as it really sits) and each inode once (a
checkpoint hard-linked into a staging directory is not two copies).
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

BLOCK = 512  # st_blocks' unit (POSIX)


def bytes_on_disk(roots: Sequence[Path]) -> int:
    """The bytes the regular files under ``roots`` hold now, each inode once; a file gone
    while it is being counted (a staging directory removed after its upload) is skipped."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root in roots:
        for directory, _, files in os.walk(root):
            for name in files:
                try:
                    found = os.lstat(os.path.join(directory, name))
                except OSError:
                    continue
                key = (found.st_dev, found.st_ino)
                if key in seen or not stat.S_ISREG(found.st_mode):  # no link followed
                    continue
                seen.add(key)
                total += found.st_blocks * BLOCK
    return total


class VolumePeak:
    """Sample ``roots`` from a thread until stopped; `peak` is the most seen at once.

    Use as a context manager around the run; one last sample is taken at the exit, so a
    run shorter than the interval is still measured."""

    def __init__(self, roots: Sequence[Path], interval: float = 0.1) -> None:
        self.roots = list(roots)
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="volume-peak", daemon=True)

    def _take(self) -> None:
        self.peak = max(self.peak, bytes_on_disk(self.roots))

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def __enter__(self) -> VolumePeak:
        self._take()
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._take()
