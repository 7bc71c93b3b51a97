"""Restore at start: the newest valid checkpoint into ``$JITCKPT_DIR/checkpoints/``.

Checkpoints are tried newest first; a torn one is never used, and each one
skipped is reported once with its reason (status, log, metrics). Anything
that stops one checkpoint from being restored skips it and the next older
one is tried: bytes that do not match the manifest, an object the store
refuses after its retries (one in an archive storage class), a checkpoint
larger than the local volume, a local write that fails. A restore ends with
a valid checkpoint in place or with nothing restored, never half way.
A store that cannot be read at all is an error, not "no checkpoint":
starting fresh would silently throw the job's progress away. So after any
skip the store itself caused, it is asked again for that checkpoint's
listing; if that fails too, the store is unreachable and restore stops
(``Unreachable``) instead of skipping every checkpoint one by one.
The download is the union of every node's files, so each node's trainer
finds what it needs (its own RNG states, the shared model and optimizer),
except on the layout that wrote the checkpoint: there a node reads its own
manifest and those with shared files, and downloads its own files and the
shared ones only (``nodefiles``). What a node reads is checked as it is
read (each manifest against the commit record, every file against its
manifest); what is missing or different is the checkpoint's fault, not this
node's: the node leaves a ``torn`` mark (``marks``), so every later restore
of every node passes over it, and skips it itself.

``checkpoints/`` is in the volume the trainer writes (DESIGN 7, "Trust"), and
a restarted sidecar restores while the trainer runs. So nothing there is
reached by name: ``checkpoints`` itself is opened without following a symlink
(one planted in its place is removed), the download goes into a fresh
directory of an unpredictable name made by the sidecar, every directory and
file in it is created relative to a directory descriptor with ``O_EXCL`` and
``O_NOFOLLOW``, and only then is it renamed into place. Paths come from
manifests that ``manifest.decode`` validated: relative and normalized, so
nothing is written outside the target.

The trainer may run during the download (overlapped restore, DESIGN 5 and 7):
``restore`` says which checkpoint it is about to fetch (``chosen``, with whether
the shim loads it itself) before the first byte, so the agent can let the trainer
start; the trainer reads the checkpoint only once the agent said it is in place.
A copy already in place that matches the manifests is used as it is, with no
download (``downloaded`` 0): a trainer restarted in the same pod resumes from the
checkpoint its pod just committed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import google_crc32c

from sidecar import checksum, marks, safefs, settle, validity
from sidecar import manifest as mf
from sidecar.commit import FILES_IN_FLIGHT
from sidecar.nodefiles import NodeLayout, manifests_needed, needed
from sidecar.setaside import scan
from sidecar.staging import SHARED_DIR_MODE, shared_dir
from sidecar.storage.base import Store, StoreError, VerificationError
from sidecar.validity import CheckpointState, Torn

RECORD_NAME = "restored.json"  # in the state directory: what was restored, for the run phase
FILE_MODE = 0o644
PARTIAL_PREFIX = ".restore-"
PRIVATE_DIR_MODE = 0o700  # while downloading; shared (0777) once complete
RENAME_TRIES = 3

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
    downloaded: int = 0  # bytes fetched from the store (0: the local copy was used)

    def skip(self, step: int, reason: str) -> None:
        """``step`` will not be restored: said once, in the log and in the status."""
        log.warning("skipping checkpoint-%d: %s", step, reason)
        self.skipped.append(Skipped(step, reason))

    def answer(self) -> dict[str, object] | None:
        """The ``restored`` field of ``/status``: the ``hello`` answer's, and its bytes."""
        if self.step is None:
            return None
        return {
            "step": self.step,
            "path": self.path,
            "size": self.size,
            "downloaded": self.downloaded,
        }

    def save(self, state_dir: Path | None) -> None:
        """For the legacy run phase, in the sidecar's own state directory (the trainer can
        write ``$JITCKPT_DIR``, and would choose what it is told was restored)."""
        if state_dir is None:
            return
        target = state_dir / RECORD_NAME
        tmp = target.with_name(target.name + ".tmp")
        try:
            tmp.write_text(json.dumps(asdict(self)))
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("cannot record what was restored in %s: %s", state_dir, exc)

    @classmethod
    def load(cls, state_dir: Path | None) -> RestoreResult | None:
        if state_dir is None:
            return None
        try:
            raw = json.loads((state_dir / RECORD_NAME).read_text())
        except FileNotFoundError:
            return None
        raw["skipped"] = [Skipped(**s) for s in raw.get("skipped", [])]
        return cls(**raw)


def _matches(directory: int, files: dict[str, mf.FileEntry]) -> bool:
    """Whether ``directory`` holds every file with its manifest's size and CRC32C, read
    through descriptors (what the trainer left there may be anything)."""
    device = os.fstat(directory).st_dev
    for path, entry in files.items():
        try:
            opened = safefs.open_regular(directory, path, device)
        except OSError:
            return False
        try:
            if opened.size != entry.size:
                return False
            crc = 0
            for chunk in opened.chunks(checksum.CHUNK):
                crc = google_crc32c.extend(crc, chunk)
            if checksum.encode(crc) != entry.crc32c:
                return False
        except OSError:
            return False
        finally:
            opened.close()
    return True


def _already_here(checkpoints: int, name: str, files: dict[str, mf.FileEntry]) -> bool:
    try:
        directory = safefs.open_dir(checkpoints, name)
    except OSError:
        return False
    try:
        return _matches(directory, files)
    finally:
        os.close(directory)


def _create(root: int, relative: str) -> int:
    """A new file at ``relative`` below ``root``, its directories made on the way; every
    step relative to a descriptor, without following a symlink, never reusing a file."""
    *dirs, name = safefs.components(relative)
    parent = os.dup(root)
    try:
        for part in dirs:
            child = safefs.ensure_dir(parent, part, PRIVATE_DIR_MODE)
            os.close(parent)
            parent = child
        return safefs.create_file(parent, name, FILE_MODE)
    finally:
        os.close(parent)


def _share_dirs(root: int, files: dict[str, mf.FileEntry]) -> None:
    """Make every directory of the download 0777: the trainer (another uid) may rotate
    checkpoints away. Files were made 0644 when created."""
    os.fchmod(root, SHARED_DIR_MODE)
    parents = {"/".join(p.split("/")[: i + 1]) for p in files for i in range(p.count("/"))}
    for relative in sorted(parents):
        fd = safefs.open_dirs(root, relative)
        try:
            os.fchmod(fd, SHARED_DIR_MODE)
        finally:
            os.close(fd)


def _fresh_dir(checkpoints: int, name: str) -> tuple[str, int]:
    """A new private directory for the download, named so the trainer cannot guess it."""
    while True:
        partial = f"{PARTIAL_PREFIX}{name}-{uuid.uuid4().hex[:12]}"
        try:
            os.mkdir(partial, PRIVATE_DIR_MODE, dir_fd=checkpoints)
        except FileExistsError:
            continue
        return partial, safefs.open_dir(checkpoints, partial)


def _put_in_place(checkpoints: int, partial: str, name: str) -> None:
    """Replace whatever is at ``name`` (an older copy, a symlink the trainer planted:
    removed, never followed) with the finished download."""
    for attempt in range(1, RENAME_TRIES + 1):
        safefs.remove(checkpoints, name)
        try:
            os.rename(partial, name, src_dir_fd=checkpoints, dst_dir_fd=checkpoints)
            return
        except OSError:
            if attempt == RENAME_TRIES:
                raise  # something keeps re-creating it


def _clear_partials(checkpoints: int) -> None:
    """Downloads a killed sidecar left behind (or names the trainer planted)."""
    with os.scandir(checkpoints) as entries:
        names = [e.name for e in entries if e.name.startswith(PARTIAL_PREFIX)]
    for name in names:
        safefs.remove(checkpoints, name)


async def download(
    store: Store, state: CheckpointState, checkpoints_dir: Path, files: dict[str, mf.FileEntry]
) -> tuple[Path, int]:
    """Fetch ``files`` of ``state`` into ``checkpoint-<step>/``, verified: its path, and
    the bytes fetched (0 when a copy in place matches the manifests already)."""
    name = mf.checkpoint_dir(state.step)
    checkpoints_dir.parent.mkdir(parents=True, exist_ok=True)  # the volume's mount point
    root = safefs.open_root(checkpoints_dir.parent)
    try:
        checkpoints = shared_dir(root, checkpoints_dir.name)
    finally:
        os.close(root)
    try:
        if await asyncio.to_thread(_already_here, checkpoints, name, files):
            log.info("checkpoint-%d is already here and matches its manifests", state.step)
            return checkpoints_dir / name, 0
        await asyncio.to_thread(_clear_partials, checkpoints)
        partial, target = _fresh_dir(checkpoints, name)
        try:
            await _fetch_all(store, state.step, files, target)
            await asyncio.to_thread(_share_dirs, target, files)
        except BaseException:
            safefs.remove(checkpoints, partial)
            raise
        finally:
            os.close(target)
        await asyncio.to_thread(_put_in_place, checkpoints, partial, name)
    finally:
        os.close(checkpoints)
    return checkpoints_dir / name, sum(e.size for e in files.values())


async def _fetch_all(store: Store, step: int, files: dict[str, mf.FileEntry], target: int) -> None:
    slots = asyncio.Semaphore(FILES_IN_FLIGHT)

    async def fetch(relative: str, entry: mf.FileEntry) -> None:
        async with slots:
            fd = await settle.in_thread(_create, target, relative)
            try:
                if entry.pieces:
                    await _fetch_pieces(store, step, entry, fd)
                else:
                    key = mf.file_key(step, relative)
                    await store.get_file(key, fd, entry.size, entry.crc32c)
            finally:
                os.close(fd)

    # Every fetch has ended before the directory is removed or its descriptor closed.
    await settle.all_or_none(fetch(p, e) for p, e in files.items())


async def _fetch_pieces(store: Store, step: int, entry: mf.FileEntry, fd: int) -> None:
    """A file stored in pieces (``pieces``): each from the node's key its manifest names,
    written at its place and checked against its CRC32C; together they are the file's
    (the manifest was refused otherwise)."""
    os.ftruncate(fd, entry.size)
    await settle.all_or_none(
        store.get_file(
            mf.piece_key(step, entry.path, index, piece.node), fd, piece.size, piece.crc32c, start
        )
        for index, (piece, start) in enumerate(zip(entry.pieces, entry.offsets(), strict=True))
    )


class Unreachable(StoreError):
    """The store stopped answering during restore; the message says since when."""


def _fits(checkpoints_dir: Path, files: dict[str, mf.FileEntry]) -> str:
    """Why ``files`` cannot fit the local volume (their size is larger than the volume), or
    ""; what is merely short of free space fails on its write and is skipped then."""
    size = sum(e.size for e in files.values())
    checkpoints_dir.parent.mkdir(parents=True, exist_ok=True)  # the volume's mount point
    volume = os.statvfs(checkpoints_dir.parent)
    capacity = volume.f_blocks * volume.f_frsize
    if size > capacity:
        return f"its {size} bytes are more than the local volume's {capacity}"
    return ""


async def _still_reachable(store: Store, step: int, why: str) -> None:
    """After a failure the store may have caused: a listing of that checkpoint's
    ``.jitckpt/`` must still come back, or the store is unreachable (raised, fatal)."""
    try:
        await store.list_objects(mf.meta_dir(step))
    except (StoreError, OSError) as exc:
        raise Unreachable(f"the store stopped answering ({why}; then: {exc})") from exc


async def _attempt(
    store: Store,
    state: CheckpointState,
    checkpoints_dir: Path,
    node: NodeLayout | None,
    pod: str,
    *,
    chosen: Chosen | None,
) -> tuple[Path, dict[str, mf.FileEntry], int] | str:
    """Restore what ``node`` needs of ``state``: its path, files and the bytes fetched, or
    why it was skipped (the store being reachable). What the store holds of it that is not
    what its record and manifests say is marked torn for every node (``marks``), by this
    node. ``chosen`` hears of it before its download starts."""
    try:
        await validity.load(store, state, manifests_needed(state, node))
        files = needed(state, node)
        too_large = await asyncio.to_thread(_fits, checkpoints_dir, files)
        if too_large:
            return too_large
        if chosen is not None:
            chosen(state.step, all(m.shim_loads for m in state.manifests.values()))
        path, fetched = await download(store, state, checkpoints_dir, files)
        return path, files, fetched
    except (Torn, VerificationError) as exc:
        why = str(exc) if isinstance(exc, Torn) else f"download failed verification: {exc}"
        if node is not None:
            await marks.put(store, state.step, marks.TORN, node.node_rank, why=why, pod=pod)
        return why
    except StoreError as exc:
        why = f"download failed: {exc}"
        await _still_reachable(store, state.step, why)
        return why
    except Exception as exc:  # the checkpoint's: a refused file, a full disk
        return f"could not be written here: {type(exc).__name__}: {exc}"


# Told the step about to be fetched, and whether the shim loads that checkpoint itself
# (every manifest read says ``shim_loads``).
Chosen = Callable[[int, bool], None]


async def restore(
    store: Store,
    checkpoints_dir: Path,
    node: NodeLayout | None = None,
    pod: str = "",
    chosen: Chosen | None = None,
) -> RestoreResult:
    """Find and download the newest valid checkpoint: what ``node`` (in pod ``pod``) needs
    of it (``nodefiles``; None: every node's files). ``chosen``: see ``Chosen``."""
    started = time.monotonic()
    result = RestoreResult()
    async for state in scan(store):
        if not state.valid:
            if state.store_error:
                await _still_reachable(store, state.step, state.reason)
            result.skip(state.step, state.reason)
            continue
        outcome = await _attempt(store, state, checkpoints_dir, node, pod, chosen=chosen)
        if isinstance(outcome, str):
            result.skip(state.step, outcome)
            continue
        path, files, result.downloaded = outcome
        result.step = state.step
        result.path = str(path)
        result.size = sum(e.size for e in files.values())
        assert state.record is not None
        whole = state.record.file_bytes
        if result.size < whole:
            log.info(
                "checkpoint-%d was written on this layout: this node's files and the shared "
                "ones only (%d of its %d bytes)",
                state.step,
                result.size,
                whole,
            )
        break
    else:
        result.reason = (
            "no valid checkpoint in the store" if result.skipped else "no checkpoint in the store"
        )
    result.seconds = time.monotonic() - started
    if result.step is not None:
        log.info(
            "restored checkpoint-%d (%d bytes) in %.2fs to %s, %d bytes downloaded",
            result.step,
            result.size,
            result.seconds,
            result.path,
            result.downloaded,
        )
    else:
        log.info("nothing restored: %s", result.reason)
    return result
