"""Staged checkpoints the sidecar owns: job records, recovery after a restart, file modes.

The shim hard-links a checkpoint into ``staging/<id>/`` and sends ``staged``.
Before answering, the sidecar writes ``staging/<id>.job.json`` (atomically):
from then on it owns the directory, and a sidecar that is killed and started
again re-queues every directory that still has a record. Directories without
a record were never acknowledged and are left alone (the shim may still be
linking into them).

The trainer may run as another user. The sidecar only needs to read the
files and to unlink entries in the directories, so the shim makes staging
directories mode 0777 (files keep HF's 0644); ``access_problems`` checks
exactly that from the modes, for whatever uid the sidecar runs as.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from shim import protocol

RECORD_SUFFIX = ".job.json"
SHARED_DIR_MODE = 0o777  # dirs both the trainer and the sidecar create entries in

log = logging.getLogger(__name__)


class StagingError(ValueError):
    """A ``staged`` request the sidecar cannot accept; the text goes back to the shim."""


@dataclass
class StagedJob:
    """One node's checkpoint waiting to be uploaded."""

    id: str
    step: int
    kind: str
    dir: str
    files: list[str]
    staged_at: float  # wall clock, seconds since the epoch

    @property
    def urgent(self) -> bool:
        return self.kind in (protocol.KIND_JIT, protocol.KIND_FINAL)

    @property
    def path(self) -> Path:
        return Path(self.dir)


def make_shared_dir(path: Path) -> None:
    """Create ``path`` (and parents) writable by the trainer's and the sidecar's users."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(path, SHARED_DIR_MODE)
    except PermissionError:
        # Made by another user (a trainer that started first): fine if it is shared already.
        if stat.S_IMODE(path.stat().st_mode) & SHARED_DIR_MODE != SHARED_DIR_MODE:
            log.warning("%s belongs to another user and is not mode 0777", path)


def _allowed(info: os.stat_result, uid: int, gids: set[int], bits: int) -> bool:
    if uid == 0:
        return True
    if info.st_uid == uid:
        mode = (info.st_mode >> 6) & 7
    elif info.st_gid in gids:
        mode = (info.st_mode >> 3) & 7
    else:
        mode = info.st_mode & 7
    return mode & bits == bits


def access_problems(directory: Path, uid: int, gids: set[int]) -> list[str]:
    """What a process of ``uid``/``gids`` could not do: read every file, remove every entry."""
    problems: list[str] = []
    for here, _dirs, files in os.walk(directory):
        here_path = Path(here)
        if not _allowed(here_path.stat(), uid, gids, 7):
            problems.append(f"{here_path} is not writable by uid {uid}: cannot remove its entries")
        for name in files:
            info = (here_path / name).stat()
            if not stat.S_ISREG(info.st_mode):
                problems.append(f"{here_path / name} is not a regular file")
            elif not _allowed(info, uid, gids, 4):
                problems.append(f"{here_path / name} is not readable by uid {uid}")
    return problems


def accept(staging_root: Path, request: protocol.Staged, now: float) -> StagedJob:
    """Take ownership of a ``staged`` request's files (the record) before answering.

    The request's types, ranges and sizes were checked where it entered
    (``protocol.decode_request``); what is checked here is the file system.
    """
    step, kind, raw_dir = request.step, request.kind, Path(request.dir)
    root = staging_root.resolve()
    directory = (root / raw_dir).resolve()
    if directory.parent != root:
        raise StagingError(f"{raw_dir} is not a directory directly under {staging_root}")
    if not directory.is_dir():
        raise StagingError(f"{directory} does not exist")
    files: Iterable[str] = request.files
    if not files:
        files = sorted(
            p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()
        )
    clean: list[str] = []
    for name in files:
        target = (directory / str(name)).resolve()
        if not target.is_relative_to(directory) or target == directory:
            raise StagingError(f"file {name!r} is outside {directory}")
        if not target.is_file():
            raise StagingError(f"file {name!r} is missing from {directory}")
        clean.append(target.relative_to(directory).as_posix())
    unreadable = [
        p for p in access_problems(directory, os.geteuid(), set(os.getgroups())) if "readable" in p
    ]
    if unreadable:
        raise StagingError("; ".join(unreadable))
    job = StagedJob(
        id=directory.name, step=step, kind=kind, dir=str(directory), files=clean, staged_at=now
    )
    write_record(root, job)
    return job


def record_path(staging_root: Path, job_id: str) -> Path:
    return staging_root / f"{job_id}{RECORD_SUFFIX}"


def write_record(staging_root: Path, job: StagedJob) -> None:
    target = record_path(staging_root, job.id)
    tmp = target.with_name(f".{target.name}.tmp")
    with tmp.open("w") as handle:
        json.dump(asdict(job), handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, target)


def release(staging_root: Path, job: StagedJob) -> None:
    """The upload is committed: remove the links, then the record."""
    shutil.rmtree(job.path, ignore_errors=True)
    if job.path.exists():
        log.warning(
            "could not remove %s: %s",
            job.path,
            access_problems(job.path, os.geteuid(), set(os.getgroups())),
        )
    with contextlib.suppress(FileNotFoundError):
        record_path(staging_root, job.id).unlink()


def recover(staging_root: Path) -> list[StagedJob]:
    """Jobs a previous run of the sidecar accepted but did not finish."""
    jobs: list[StagedJob] = []
    if not staging_root.is_dir():
        return jobs
    for record in sorted(staging_root.glob(f"*{RECORD_SUFFIX}")):
        try:
            job = StagedJob(**json.loads(record.read_text()))
        except (ValueError, TypeError) as exc:
            log.warning("ignoring unreadable staging record %s: %s", record, exc)
            continue
        if not job.path.is_dir():
            log.warning("staging record %s has no directory left; dropping it", record)
            record.unlink()
            continue
        jobs.append(job)
    return jobs
