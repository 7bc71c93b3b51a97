"""Staging for plain PyTorch loops that write their own ``checkpoint-<step>`` directories.

Such a loop keeps its own checkpoint code; the shim only notices new
``checkpoint-<step>`` directories under ``$JITCKPT_DIR`` (or its
``checkpoints/``) and hands each to the sidecar once it is complete: when a
newer one appears, or when the process ends. A daemon thread polls a couple
of directory listings every few seconds (local rank 0 only); it stops for
good as soon as a HF Trainer takes over, whose callback stages checkpoints
itself. Directories present when the watcher starts (a restore) are ignored.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Dict, List, Set, Tuple

from .channel import SidecarLink
from .checkpoints import list_checkpoints
from .config import ShimConfig
from .log import failed
from .protocol import KIND_PERIODIC
from .trainrun import hand_over

POLL_SECONDS = 5.0


class CheckpointWatcher:
    """Finds finished checkpoint directories of a plain loop and stages them."""

    def __init__(self, config: ShimConfig, poll_seconds: float = POLL_SECONDS) -> None:
        self.config = config
        self.poll_seconds = poll_seconds
        self.link = SidecarLink(config.socket_path)
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._done: Set[str] = {path for _, path in self._scan()}

    def _scan(self) -> List[Tuple[int, str]]:
        found: Dict[str, Tuple[int, str]] = {}
        for directory in (self.config.local_dir, self.config.checkpoints_dir):
            for step, path in list_checkpoints(directory):
                found[path] = (step, path)
        return sorted(found.values())

    def poll(self, final: bool) -> None:
        """Stage every new checkpoint but the newest (all of them when ``final``)."""
        with self._lock:
            if self.stopped.is_set():
                return
            fresh = [(step, path) for step, path in self._scan() if path not in self._done]
            ready = fresh if final else fresh[:-1]
            for step, path in ready:
                self._done.add(path)
                self._stage(step, path)

    def _stage(self, step: int, path: str) -> None:
        hand_over(self.link, path, self.config.staging_dir, step, KIND_PERIODIC)

    def close(self) -> None:
        """Stop for good (waits for a poll in progress)."""
        with self._lock:
            self.stopped.set()

    def run(self) -> None:
        while not self.stopped.wait(self.poll_seconds):
            try:
                self.poll(final=False)
            except Exception as exc:
                failed("checkpoint watcher", exc)
                return

    def at_exit(self, pid: int) -> None:
        if os.getpid() != pid:
            return
        try:
            self.poll(final=True)
        except Exception as exc:
            failed("checkpoint watcher at exit", exc)
        self.stopped.set()


_WATCHERS: List[CheckpointWatcher] = []


_DISABLED: List[bool] = []  # set once a HF Trainer or torchrun's launcher shows up


def _is_multiprocessing_child() -> bool:
    """DataLoader workers and other ``multiprocessing`` children save nothing of their own.

    A spawned child imports the main module (and torch) before its parent link is
    set up, but its process name is already set by then.
    """
    from multiprocessing import process

    return process.current_process().name != "MainProcess" or process.parent_process() is not None


def start(config: ShimConfig) -> None:
    """Watch for plain-loop checkpoints in this process (local rank 0 only)."""
    if _WATCHERS or _DISABLED or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    if _is_multiprocessing_child():
        return
    watcher = CheckpointWatcher(config)
    _WATCHERS.append(watcher)
    threading.Thread(target=watcher.run, name="jitckpt-watcher", daemon=True).start()
    atexit.register(watcher.at_exit, os.getpid())


def stop() -> None:
    """A HF Trainer stages its own checkpoints, a launcher has none: step aside for good."""
    _DISABLED.append(True)
    for watcher in _WATCHERS:
        watcher.close()
