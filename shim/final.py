"""The trained model: what the program's own code saved once training ended normally.

A framework integration tells this module which files the user's code wrote
as its final output (``record``); nothing is sent while the program runs.
When the process ends normally, its ``atexit`` handler hands them to the
sidecar, which uploads them to ``<job root>/final/``. Only then, because:

- only the exit status tells a finished run from one that fails after
  saving (a crash after ``save_model()``, an evaluation that raises), and
  that status is known only at exit (``exitstatus``);
- a JIT stop leaves through ``os._exit(143)`` and death by a signal runs no
  ``atexit`` at all, so a cut run never reaches this point.

Only global rank 0 hands over (the one writer of a final model in every
framework). The files are hard-linked into staging like a checkpoint (copied
when the output directory is on another filesystem), sent as ``staged`` with
kind ``final``, and the process waits until the sidecar owns them, as after a
JIT save. Setting ``upload-final`` to false turns all of it off.
"""

from __future__ import annotations

import atexit
import os
import stat

from . import dist
from .channel import SidecarLink
from .config import ShimConfig
from .exitstatus import STATUS
from .layout import step_of
from .log import failed, say, say_once
from .protocol import KIND_FINAL
from .staging import stage

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Sequence, Tuple

    Snapshot = Dict[str, Tuple[int, int, int]]


def snapshot(directory: str) -> Snapshot:
    """Every regular file under ``directory``: relative path -> (inode, size, mtime_ns).

    ``checkpoint-<step>`` directories are left out (they are checkpoints, not
    the model), and so are symlinks (never staged).
    """
    found: Snapshot = {}
    for here, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if step_of(d) is None)
        for name in names:
            path = os.path.join(here, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue  # removed while we looked
            if stat.S_ISREG(info.st_mode):
                relative = os.path.relpath(path, directory).replace(os.sep, "/")
                found[relative] = (info.st_ino, info.st_size, info.st_mtime_ns)
    return found


def written(before: Snapshot, after: Snapshot) -> List[str]:
    """The files of ``after`` that are new or changed since ``before``, sorted."""
    return sorted(name for name, seen in after.items() if before.get(name) != seen)


class FinalOutput:
    """The final output recorded in this process, handed over at a normal exit."""

    def __init__(self, config: ShimConfig, link: SidecarLink) -> None:
        self.config = config
        self.link = link
        self.directory: Optional[str] = None
        self.files: List[str] = []
        self.step = 0
        self._pid = os.getpid()
        self._registered = False

    def record(self, directory: str, files: Sequence[str], step: int) -> None:
        """The program wrote ``files`` (relative to ``directory``) as its final output.

        More files in the same directory add to what is recorded; a save to
        another directory replaces it (the last save is the model).
        """
        directory = os.path.abspath(directory)
        if directory != self.directory:
            self.directory, self.files = directory, []
        self.files += [name for name in files if name not in self.files]
        self.step = step
        if not self._registered:
            # After the session's own handler, so this one runs first (LIFO): before ``bye``.
            atexit.register(self._at_exit)
            self._registered = True

    def forget(self) -> None:
        """Training starts again: what was saved before is not the final model."""
        self.directory, self.files = None, []

    def _at_exit(self) -> None:
        if os.getpid() != self._pid or self.directory is None or not self.files:
            return
        try:
            code = STATUS.code()
            if code != 0:
                say("exiting with status %d: the final model is not uploaded" % code)
                return
            self.hand_over()
        except Exception as exc:
            failed("handing the final model to the sidecar", exc)

    def hand_over(self) -> Optional[str]:
        """Stage the recorded files as kind ``final``; the staged id once the sidecar owns them."""
        directory = self.directory
        if directory is None or dist.ranks()["rank"] != 0 or not self.link.present():
            return None
        present = [f for f in self.files if os.path.isfile(os.path.join(directory, f))]
        if not present:
            say("the final model's files are gone from %s: nothing to upload" % directory)
            return None
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in present)
        staged = stage(directory, self.config.staging_dir, self.step, KIND_FINAL, only=present)
        staged_id = self.link.stage(staged)
        if staged_id is not None:
            say(
                "final model handed to the sidecar: %d files, %d bytes from %s"
                % (len(present), size, directory)
            )
        return staged_id


_OUTPUTS: Dict[int, FinalOutput] = {}


def enabled(config: ShimConfig) -> bool:
    """Whether ``upload-final`` is on (said once when it is not)."""
    if not config.upload_final:
        say_once(
            "upload-final-off",
            "jitckpt.io/upload-final is false: the final model stays where the program saved it",
        )
    return config.upload_final


def get(config: ShimConfig, link: SidecarLink) -> Optional[FinalOutput]:
    """This process's final output (None when ``upload-final`` is off)."""
    if not enabled(config):
        return None
    pid = os.getpid()
    if pid not in _OUTPUTS:
        _OUTPUTS[pid] = FinalOutput(config, link)
    return _OUTPUTS[pid]
