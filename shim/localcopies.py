"""The local copies of checkpoints the store has committed: freed as the next periodic save begins.

A framework's own rotation (HF's ``save_total_limit``, the Lightning
integration's) keeps the newest few checkpoints on the pod's local volume, as
it would on a disk of the user's. Under jitckpt those checkpoints live in
``$JITCKPT_DIR/checkpoints``, an emptyDir that counts against the node's
ephemeral storage, and each of them is in the sidecar's hands as soon as it
is staged (the hard links in staging keep its data until it is uploaded and
committed). Keeping several such copies only takes the volume's room; with
a checkpoint of hundreds of GB it is what gets the pod evicted, or a JIT save
refused for want of space.

So a copy handed to the sidecar (or restored from the store) is removed as
the next periodic save begins, once the sidecar says it committed that step
or a newer one (one status request a periodic save; none before a JIT save,
whose grace period has no time for it). Between saves the newest copy
stays (a trainer restarted in the same pod resumes from it without a
download), and while a save is written the volume holds that save, plus what
is still being uploaded. A directory never handed over (no sidecar, a staging
that failed), or one the sidecar has not committed (it is gone, or the store
is down), may be the only copy there is: it stays to the framework's
rotation, as a copy the framework still reads does (HF's best model
checkpoint, named in ``keep``).
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

from . import dist
from .channel import Backlog
from .log import failed, say

# What a copy is renamed to before it is removed: no framework reads it as a checkpoint.
FREED_PREFIX = ".freed-checkpoint-"


class LocalCopies:
    """The checkpoint directories under ``checkpoints_dir`` that the store has or will have."""

    def __init__(self, checkpoints_dir: str) -> None:
        self.root = os.path.realpath(checkpoints_dir)
        self._held: Dict[str, int] = {}  # real path -> step
        self._keep: Set[str] = set()  # what the last ``free`` was told to keep
        # ``free`` runs in the writer thread too, once the volume has room (``volumeroom``).
        self._lock = threading.Lock()

    def _inside(self, directory: str) -> Optional[str]:
        """``directory``'s real path when it is a checkpoint of this run's own dir, else None
        (a script's own directory elsewhere is never touched)."""
        path = os.path.realpath(directory)
        return path if os.path.dirname(path) == self.root else None

    def handed(self, directory: str, step: int) -> None:
        """The sidecar owns ``directory``'s files now (staged), or restored it from the store."""
        path = self._inside(directory)
        if path is not None:
            with self._lock:
                self._held[path] = step

    def free(
        self,
        before: int,
        committed: Callable[[], Optional[Backlog]],
        keep: Optional[Iterable[Optional[str]]] = (),
    ) -> None:
        """Remove the copies older than step ``before`` that the store has committed (the
        sidecar's newest commit, from ``committed``, is that step or a newer one) or that
        the sidecar dropped for a newer one it was handed (``Backlog.superseded``: one
        queued behind the upload, which the next one handed replaces), but for ``keep``
        (None: what the last call kept).

        Called as a periodic save of ``before`` begins, and again once its writer has room
        (``volumeroom``). On local rank 0 only (the volume is the node's); never raises:
        what cannot be removed stays for the framework's rotation, as does everything
        while the sidecar cannot say what it committed.
        """
        try:
            if dist.ranks()["local_rank"] != 0:
                return
            with self._lock:
                if keep is not None:
                    self._keep = {os.path.realpath(path) for path in keep if path}
                kept = self._keep
                older = [(p, s) for p, s in self._held.items() if s < before and p not in kept]
                backlog = committed() if older else None
                if backlog is not None:
                    self._free([(p, s, backlog.why(s)) for p, s in older if backlog.has(s)])
        except Exception as exc:
            failed("removing the local copies of older checkpoints", exc)

    def _free(self, copies: List[Tuple[str, int, str]]) -> None:
        """Rename each copy out of the checkpoints' names at once (no resume can pick a half
        removed one), then remove it behind the loop: removing a large file takes the
        file system a while, and a periodic save must not stall the step."""
        doomed = [os.path.join(self.root, name) for name in _leftovers(self.root)]
        for path, step, why in copies:
            self._held.pop(path)
            if not os.path.isdir(path) or os.path.islink(path):
                continue
            hidden = os.path.join(self.root, "%s%d-%d" % (FREED_PREFIX, step, os.getpid()))
            try:
                os.rename(path, hidden)
            except OSError:
                continue  # gone already, or not ours to move: the framework's rotation decides
            doomed.append(hidden)
            say("removed the local copy of checkpoint-%d (%s)" % (step, why))
        if doomed:
            threading.Thread(target=_remove_all, args=(doomed,), daemon=True).start()


def _leftovers(root: str) -> List[str]:
    """Copies renamed for removal by a process that ended before it removed them."""
    try:
        return [name for name in os.listdir(root) if name.startswith(FREED_PREFIX)]
    except OSError:
        return []


def _remove_all(paths: List[str]) -> None:
    for path in paths:
        if not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
