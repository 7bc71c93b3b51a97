"""Restore at start: the newest valid checkpoint into ``$JITCKPT_DIR/checkpoints/``.

Checkpoints are tried newest first; a torn one is never used, and each one
skipped is reported with its reason (status, log, metrics). A valid one whose
bytes do not match its manifest on download is treated as torn too and the
next older one is tried. A store that cannot be read at all is an error, not
"no checkpoint": starting fresh would silently throw the job's progress away.
The download is the union of every node's files, so each node's trainer
finds what it needs (its own RNG states, the shared model and optimizer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sidecar import checksum
from sidecar import manifest as mf
from sidecar.commit import FILES_IN_FLIGHT
from sidecar.staging import SHARED_DIR_MODE, make_shared_dir
from sidecar.storage.base import Store, VerificationError
from sidecar.validity import CheckpointState, scan

RECORD_NAME = ".restored.json"  # in $JITCKPT_DIR: what was restored, for the run phase
FILE_MODE = 0o644

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Skipped:
    step: int
    reason: str


@dataclass
class RestoreResult:
    step: int | None = None
    path: str | None = None
    size: int = 0
    seconds: float = 0.0
    skipped: list[Skipped] = field(default_factory=list)
    reason: str = ""  # why nothing was restored

    def answer(self) -> dict[str, object] | None:
        """The ``restored`` field of the ``hello`` answer."""
        if self.step is None:
            return None
        return {"step": self.step, "path": self.path}

    def save(self, local_dir: Path) -> None:
        target = local_dir / RECORD_NAME
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, target)

    @classmethod
    def load(cls, local_dir: Path) -> RestoreResult | None:
        try:
            raw = json.loads((local_dir / RECORD_NAME).read_text())
        except FileNotFoundError:
            return None
        raw["skipped"] = [Skipped(**s) for s in raw.get("skipped", [])]
        return cls(**raw)


def _matches(path: Path, entry: mf.FileEntry) -> bool:
    try:
        return path.stat().st_size == entry.size and checksum.of_file(path) == entry.crc32c
    except FileNotFoundError:
        return False


def _share_tree(root: Path) -> None:
    """Dirs the trainer (another uid) may rotate away; files it must read."""
    for here, _dirs, files in os.walk(root):
        os.chmod(here, SHARED_DIR_MODE)
        for name in files:
            os.chmod(Path(here) / name, FILE_MODE)


async def download(store: Store, state: CheckpointState, checkpoints_dir: Path) -> Path:
    """Fetch every node's files of ``state`` into ``checkpoint-<step>/``, verified."""
    target = checkpoints_dir / mf.checkpoint_dir(state.step)
    files = state.files()
    if target.is_dir():
        checks = await asyncio.gather(
            *(asyncio.to_thread(_matches, target / p, e) for p, e in files.items())
        )
        if all(checks):
            log.info("checkpoint-%d is already here and matches its manifests", state.step)
            return target
    partial = checkpoints_dir / f".restore-{mf.checkpoint_dir(state.step)}"
    shutil.rmtree(partial, ignore_errors=True)
    make_shared_dir(partial)
    slots = asyncio.Semaphore(FILES_IN_FLIGHT)

    async def fetch(relative: str, entry: mf.FileEntry) -> None:
        async with slots:
            key = mf.file_key(state.step, relative)
            await store.get_file(key, partial / relative, entry.size, entry.crc32c)

    try:
        await asyncio.gather(*(fetch(p, e) for p, e in files.items()))
        await asyncio.to_thread(_share_tree, partial)
        if target.exists():
            shutil.rmtree(target)
        os.replace(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


async def restore(store: Store, checkpoints_dir: Path) -> RestoreResult:
    """Find and download the newest valid checkpoint."""
    started = time.monotonic()
    make_shared_dir(checkpoints_dir)
    result = RestoreResult()
    async for state in scan(store):
        if not state.valid:
            log.warning("skipping checkpoint-%d: %s", state.step, state.reason)
            result.skipped.append(Skipped(state.step, state.reason))
            continue
        try:
            path = await download(store, state, checkpoints_dir)
        except VerificationError as exc:
            reason = f"download failed verification: {exc}"
            log.warning("skipping checkpoint-%d: %s", state.step, reason)
            result.skipped.append(Skipped(state.step, reason))
            continue
        result.step = state.step
        result.path = str(path)
        result.size = sum(e.size for e in state.files().values())
        break
    else:
        result.reason = (
            "no valid checkpoint in the store" if result.skipped else "no checkpoint in the store"
        )
    result.seconds = time.monotonic() - started
    if result.step is not None:
        log.info(
            "restored checkpoint-%d (%d bytes) in %.2fs to %s",
            result.step,
            result.size,
            result.seconds,
            result.path,
        )
    else:
        log.info("nothing restored: %s", result.reason)
    return result
