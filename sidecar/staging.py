"""Staged checkpoints the sidecar owns: acceptance, its own records, recovery after a restart.

The shim hard-links a checkpoint into ``staging/<id>/`` and sends ``staged``.
The trainer can change anything in that volume at any time (DESIGN 7,
"Trust"), so acceptance opens every file once through ``safefs`` (no
symlink followed on the way, a regular file on the staging volume) and the
job keeps the descriptors: the upload reads those and nothing else, so a
name swapped for a symlink after the answer changes nothing. File names go
through ``manifest.check_path``: none leaves the directory, none lands in
``.jitckpt/`` where it could pass for another node's manifest.

The sidecar's records of what it accepted live where the trainer cannot
write: in memory, and in the state directory (on the shim volume, which the
trainer mounts read-only), so a sidecar killed and started again still
uploads what it acknowledged. Recovery opens each recorded job the same safe
way and takes it only if every file is still the inode it accepted (device,
inode, size); anything else is dropped with an error, never retried.
Directories without a record were never acknowledged and are left alone.

A JIT checkpoint may come in parts (``staging``) while it is being written:
each part's files are opened the same way and added to one job, owned by
the connection that sent it (one open job per connection); the ``staged`` of
the same directory on that connection completes it, adding what is not held
yet (a name held already must still be the inode accepted). Only a complete
job is recorded, so a sidecar restart never uploads a partial one, and the
agent drops a partial job whose connection goes away.

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
import resource
import stat
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from shim import layout, protocol
from sidecar import manifest as mf
from sidecar import safefs
from sidecar.arrivals import Arrivals
from sidecar.safefs import OpenedFile

RECORD_SUFFIX = ".job.json"
RECORDS_SUBDIR = "staged"  # in the state directory
SHARED_DIR_MODE = 0o777  # dirs both the trainer and the sidecar create entries in
MAX_JOBS = 256  # staged checkpoints owned at once; each keeps its files open
# Descriptors kept free of staged files: sockets (connections and leases), the store's
# connection pool, restore and the status server.
FD_RESERVE = 1024

log = logging.getLogger(__name__)


class StagingError(ValueError):
    """A ``staged`` request the sidecar cannot accept; the text goes back to the shim."""


@dataclass
class StagedJob:
    """One node's checkpoint waiting to be uploaded: its files, opened at acceptance."""

    id: str
    step: int
    kind: str
    files: list[OpenedFile]
    staged_at: float  # wall clock, seconds since the epoch
    # While parts still come (``staging``): the connection sending them, and the files as
    # they arrive; both None for a job accepted whole.
    owner: object | None = None
    arrivals: Arrivals | None = None
    # Files only this node's ranks read on a resume on the same layout (``Staged.local``).
    local: frozenset[str] = frozenset()
    shim_loads: bool = False  # ``Staged.shim_loads``: into the manifest
    # Every node wrote it (``Staged.copies``, said by its first part when streamed) and
    # which of its files every node wrote alike (``Staged.replicas``): uploaded in pieces.
    copies: bool = False
    replicas: frozenset[str] = frozenset()
    # Of a copies checkpoint streamed, the names its ``staged`` lists (None: every file):
    # a copy streamed as it was written that another node hands over is not this node's.
    handed: frozenset[str] | None = None

    @property
    def complete(self) -> bool:
        return self.owner is None

    @property
    def urgent(self) -> bool:
        return self.kind in (protocol.KIND_JIT, protocol.KIND_FINAL)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def close(self) -> None:
        for opened in self.files:
            opened.close()

    def record(self) -> dict[str, object]:
        """What recovery needs to find these very files again."""
        return {
            "id": self.id,
            "step": self.step,
            "kind": self.kind,
            "staged_at": self.staged_at,
            "files": [
                {"path": f.name, "size": f.size, "device": f.device, "inode": f.inode}
                for f in self.files
            ],
            "local": sorted(self.local),
            "shim_loads": self.shim_loads,
            "copies": self.copies,
            "replicas": sorted(self.replicas),
            "handed": None if self.handed is None else sorted(self.handed),
        }


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
    """What a process of ``uid``/``gids`` could not do: read every file, remove every entry.
    Modes only (``lstat``), for messages: it follows no symlink and opens nothing."""
    problems: list[str] = []
    for here, _dirs, files in os.walk(directory):
        here_path = Path(here)
        if not _allowed(here_path.lstat(), uid, gids, 7):
            problems.append(f"{here_path} is not writable by uid {uid}: cannot remove its entries")
        for name in files:
            info = (here_path / name).lstat()
            if not stat.S_ISREG(info.st_mode):
                problems.append(f"{here_path / name} is not a regular file")
            elif not _allowed(info, uid, gids, 4):
                problems.append(f"{here_path / name} is not readable by uid {uid}")
    return problems


def shared_dir(parent: int, name: str) -> int:
    """The real directory ``name`` in ``parent`` (made if missing; a symlink or file in its
    place is removed, never followed), mode 0777 for the trainer's user; opened."""
    fd = safefs.ensure_dir(parent, name, SHARED_DIR_MODE)
    try:
        os.fchmod(fd, SHARED_DIR_MODE)
    except PermissionError:
        # Made by another user (a trainer that started first): fine if it is shared already.
        if stat.S_IMODE(os.fstat(fd).st_mode) & SHARED_DIR_MODE != SHARED_DIR_MODE:
            log.warning("%s belongs to another user and is not mode 0777", name)
    return fd


def _file_budget() -> int:
    """Staged files the sidecar may hold open: its descriptor limit (raised to the hard
    limit) less a reserve for everything else."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft - min(FD_RESERVE, soft // 2)


class StagingArea:
    """``$JITCKPT_DIR/staging`` and the jobs the sidecar owns from it."""

    def __init__(self, local_dir: Path, state_dir: Path | None) -> None:
        self.local_dir = local_dir  # the volume's mount point: the one path used by name
        self.dir = local_dir / layout.STAGING_SUBDIR
        self._records = state_dir / RECORDS_SUBDIR if state_dir is not None else None
        self._owned: dict[str, StagedJob] = {}  # accept and release run in worker threads
        self._lock = threading.Lock()
        self._budget = _file_budget()

    @property
    def files_held(self) -> int:
        with self._lock:
            return sum(len(job.files) for job in self._owned.values())

    def prepare(self) -> None:
        """The shared directories (``checkpoints/``, ``staging/``) and the record directory."""
        self.local_dir.mkdir(parents=True, exist_ok=True)  # a mount point in a pod
        root = safefs.open_root(self.local_dir)
        try:
            for name in (layout.CHECKPOINTS_SUBDIR, layout.STAGING_SUBDIR):
                os.close(shared_dir(root, name))
        finally:
            os.close(root)
        if self._records is not None:
            try:
                self._records.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                log.warning(
                    "no state directory (%s): accepted checkpoints are remembered in memory "
                    "only, and a restarted sidecar will not upload what it had not yet",
                    exc,
                )
                self._records = None

    def _open_staging(self) -> int:
        root = safefs.open_root(self.local_dir)
        try:
            return safefs.open_dir(root, layout.STAGING_SUBDIR)
        except OSError as exc:
            raise StagingError(f"{self.dir} cannot be used: {exc.strerror or exc}") from None
        finally:
            os.close(root)

    def _job_id(self, raw: str) -> str:
        """The staged directory's name: ``raw`` names one directly in ``staging/``."""
        path = PurePosixPath(raw)
        if path.is_absolute() and str(path.parent) != str(self.dir):
            raise StagingError(f"{raw} is not a directory directly under {self.dir}")
        name = path.name if path.is_absolute() else raw
        if name in ("", ".", "..") or "/" in name or "\0" in name or len(name) > 255:
            raise StagingError(f"{raw} is not a directory directly under {self.dir}")
        return name

    def accept(self, request: protocol.Staged, now: float, owner: object = None) -> StagedJob:
        """Open the request's files and record the job before answering (DESIGN 6: ``ok``
        means the sidecar owns the files). A partial job of ``owner`` in the same directory
        is completed instead: its files are kept, the rest added."""
        job_id = self._job_id(request.dir)
        with self._lock:
            held = self._owned.get(job_id)
            partial = held is not None and owner is not None and held.owner is owner
            if not partial:
                self._reserve(job_id, request, now)
        if held is not None and partial:
            return self._complete(held, request)
        try:
            return self._take(job_id, request, now)
        except BaseException:
            with self._lock:
                self._owned.pop(job_id, None)
            raise

    def _reserve(self, job_id: str, request: protocol.Staged, now: float) -> None:
        """Claim ``job_id`` for a job being accepted (called with the lock held)."""
        if job_id in self._owned:
            raise StagingError(f"{job_id} is staged already and not yet uploaded")
        if len(self._owned) >= MAX_JOBS:
            raise StagingError(f"{MAX_JOBS} staged checkpoints are waiting to be uploaded")
        self._owned[job_id] = StagedJob(job_id, request.step, request.kind, [], now)

    def accept_part(self, request: protocol.Staging, now: float, owner: object) -> StagedJob:
        """Open a part's files and add them to ``owner``'s partial job in that directory
        (started by the first part; nothing is recorded until it is complete)."""
        job_id = self._job_id(request.dir)
        names = _checked_names(request.files)
        with self._lock:
            job = self._owned.get(job_id)
            if job is None:
                if any(j.owner is owner for j in self._owned.values()):
                    raise StagingError("this connection is streaming another checkpoint already")
                if len(self._owned) >= MAX_JOBS:
                    raise StagingError(f"{MAX_JOBS} staged checkpoints are waiting to be uploaded")
                files: list[OpenedFile] = []
                job = StagedJob(
                    job_id, request.step, request.kind, files, now, owner, Arrivals(files)
                )
                job.copies = request.copies
                self._owned[job_id] = job
                started = True
            elif job.owner is not owner:
                raise StagingError(f"{job_id} is staged already and not yet uploaded")
            else:
                started = False
        try:
            if (job.step, job.kind) != (request.step, request.kind):
                raise StagingError(f"{job_id} is checkpoint-{job.step} ({job.kind})")
            self._add(job, names)
            self._check_owned(job)
        except BaseException:
            if started:
                with self._lock:
                    self._owned.pop(job_id, None)
            raise
        return job

    def _check_owned(self, job: StagedJob) -> None:
        """``job`` was not dropped (released) while files were being added to it; if it
        was, what was added is closed too."""
        with self._lock:
            owned = self._owned.get(job.id) is job
        if not owned:
            job.close()
            raise StagingError(f"{job.id} was dropped while files were being added to it")

    def partial_of(self, owner: object) -> StagedJob | None:
        """The job ``owner`` is still streaming, if any."""
        with self._lock:
            return next((j for j in self._owned.values() if j.owner is owner), None)

    def _complete(self, job: StagedJob, request: protocol.Staged) -> StagedJob:
        """The ``staged`` of a partial job: what it does not hold yet is added, then the
        job is recorded and complete (still partial when refused: the agent drops it)."""
        if (job.step, job.kind) != (request.step, request.kind):
            raise StagingError(f"{job.id} is checkpoint-{job.step} ({job.kind})")
        self._add(job, _checked_names(request.files))  # none listed: every file there
        self._check_owned(job)
        job.local = frozenset(request.local)
        job.shim_loads = request.shim_loads
        job.copies = job.copies or request.copies
        job.replicas = frozenset(request.replicas) if job.copies else frozenset()
        if job.copies and request.files:
            job.handed = frozenset(request.files)
        try:
            self._write_record(job)
        except OSError as exc:
            raise StagingError(f"cannot record the staged checkpoint: {exc}") from None
        with self._lock:
            job.owner = None
        return job

    def _add(self, job: StagedJob, names: list[str]) -> None:
        """Open ``names`` (none: every file of the job's directory) into ``job``: a name it
        holds already must still be the same inode, and is not added twice."""
        held = {f.name: f for f in job.files}
        opened = self._open_files(job.id, names)
        fresh = [f for f in opened if f.name not in held]
        again = [f for f in opened if f.name in held]
        try:
            if len(job.files) + len(fresh) > mf.MAX_FILES:
                raise StagingError(f"a checkpoint may have at most {mf.MAX_FILES} files")
            for now in again:
                before = held[now.name]
                if (now.device, now.inode, now.size) != (before.device, before.inode, before.size):
                    raise StagingError(f"file {now.name!r} is no longer the file accepted")
        except BaseException:
            for done in opened:
                done.close()
            raise
        for now in again:
            now.close()
        job.files.extend(fresh)

    def _take(self, job_id: str, request: protocol.Staged, now: float) -> StagedJob:
        names = _checked_names(request.files)
        files = self._open_files(job_id, names)
        job = StagedJob(
            id=job_id,
            step=request.step,
            kind=request.kind,
            files=files,
            staged_at=now,
            local=frozenset(request.local),
            shim_loads=request.shim_loads,
            copies=request.copies,
            replicas=frozenset(request.replicas),
        )
        try:
            self._write_record(job)
        except OSError as exc:
            job.close()
            raise StagingError(f"cannot record the staged checkpoint: {exc}") from None
        with self._lock:
            self._owned[job_id] = job
        return job

    def _open_files(self, job_id: str, names: list[str]) -> list[OpenedFile]:
        staging = self._open_staging()
        try:
            device = os.fstat(staging).st_dev
            try:
                directory = safefs.open_dir(staging, job_id)
            except FileNotFoundError:
                raise StagingError(f"{self.dir / job_id} does not exist") from None
            except safefs.UnsafeError as exc:
                raise StagingError(f"{self.dir / job_id}: {exc.strerror}") from None
            try:
                return self._open_in(directory, device, job_id, names)
            finally:
                os.close(directory)
        finally:
            os.close(staging)

    def _open_in(
        self, directory: int, device: int, job_id: str, names: list[str]
    ) -> list[OpenedFile]:
        if not names:
            try:
                names = safefs.walk_files(directory, mf.MAX_FILES, mf.MAX_DEPTH)
                for name in names:
                    mf.check_path(name)
            except (OSError, mf.PathError) as exc:
                raise StagingError(f"{job_id}: {_reason(exc)}") from None
        if self.files_held + len(names) > self._budget:
            raise StagingError(
                f"{len(names)} more files would exceed the {self._budget} the sidecar may "
                "hold open; wait for the uploads in flight"
            )
        opened: list[OpenedFile] = []
        try:
            for name in names:
                try:
                    opened.append(safefs.open_regular(directory, name, device))
                except FileNotFoundError:
                    raise StagingError(f"file {name!r} is missing from {job_id}") from None
                except PermissionError:
                    raise StagingError(
                        f"file {name!r} in {job_id} is not readable by uid {os.geteuid()}"
                    ) from None
                except OSError as exc:
                    raise StagingError(f"file {name!r} in {job_id}: {_reason(exc)}") from None
            _check_fits(directory, opened)
        except BaseException:
            for done in opened:
                done.close()
            raise
        return opened

    def _write_record(self, job: StagedJob) -> None:
        if self._records is None:
            return
        target = self._records / f"{job.id}{RECORD_SUFFIX}"
        tmp = target.with_name(f".{target.name}.tmp")
        with tmp.open("w") as handle:
            json.dump(job.record(), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)

    def _forget(self, job_id: str) -> None:
        with self._lock:
            self._owned.pop(job_id, None)
        if self._records is not None:
            with contextlib.suppress(FileNotFoundError):
                (self._records / f"{job_id}{RECORD_SUFFIX}").unlink()

    def release(self, job: StagedJob) -> None:
        """The job is done (committed, or dropped): close its files, remove its links
        (never through a symlink: only entries of ``staging/<id>`` go), then its record."""
        job.close()
        try:
            staging = self._open_staging()
            try:
                safefs.remove(staging, job.id)
            finally:
                os.close(staging)
        except (OSError, StagingError) as exc:
            log.warning(
                "could not remove %s: %s %s",
                self.dir / job.id,
                _reason(exc),
                access_problems(self.dir / job.id, os.geteuid(), set(os.getgroups())),
            )
        self._forget(job.id)

    def recover(self) -> tuple[list[StagedJob], list[str]]:
        """Jobs a previous run of the sidecar accepted but did not finish, re-opened; and
        a reason for each one that had to be dropped instead."""
        jobs: list[StagedJob] = []
        dropped: list[str] = []
        if self._records is None or not self._records.is_dir():
            return jobs, dropped
        for path in sorted(self._records.glob(f"*{RECORD_SUFFIX}")):
            try:
                record = _Record.parse(json.loads(path.read_text()))
                self._job_id(record.id)
            except (OSError, ValueError) as exc:  # StagingError is a ValueError
                log.warning("ignoring an invalid staging record %s: %s", path.name, exc)
                path.unlink()
                continue
            try:
                job = self._reopen(record)
            except (OSError, StagingError) as exc:
                reason = (
                    f"checkpoint-{record.step} ({record.kind}) accepted before the sidecar "
                    f"restarted was dropped: {_reason(exc)}"
                )
                log.error("%s", reason)
                dropped.append(reason)
                self.release(record.job([]))
                continue
            with self._lock:
                self._owned[job.id] = job
            jobs.append(job)
        return jobs, dropped

    def _reopen(self, record: _Record) -> StagedJob:
        files = self._open_files(record.id, [f[0] for f in record.files])
        for opened, (_, *expected) in zip(files, record.files, strict=True):
            if [opened.device, opened.inode, opened.size] != expected:
                for done in files:
                    done.close()
                raise StagingError(f"{opened.name} is no longer the file it accepted")
        return record.job(files)


@dataclass(frozen=True)
class _Record:
    """A job record as the state directory holds it (see ``StagedJob.record``).

    The records are the sidecar's own, but a pod spec may once have let another
    container write them (DESIGN 7: the webhook refuses such pods now), and a
    record read back is a promise the sidecar is about to act on with the store's
    credentials. So it is held to the rules of the ``staged`` request it stands
    for: a kind of the protocol, a step in range, names ``manifest.check_path``
    allows (never under ``.jitckpt/``, where a file would pass for a manifest),
    each once, and real integers; anything else is refused (ValueError)."""

    id: str
    step: int
    kind: str
    staged_at: float
    files: list[tuple[str, int, int, int]]  # path, device, inode, size
    local: frozenset[str] = frozenset()
    shim_loads: bool = False
    copies: bool = False
    replicas: frozenset[str] = frozenset()
    handed: frozenset[str] | None = None

    @classmethod
    def parse(cls, raw: object) -> _Record:
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        entries = raw.get("files")
        if not isinstance(entries, list) or not 0 < len(entries) <= mf.MAX_FILES:
            raise ValueError(f"files is not a list of 1 to {mf.MAX_FILES} entries")
        kind = raw.get("kind")
        if kind not in protocol.KINDS:
            raise ValueError(f"kind {str(kind)[:32]!r} is not one of {', '.join(protocol.KINDS)}")
        staged_at = raw.get("staged_at")
        if isinstance(staged_at, bool) or not isinstance(staged_at, int | float):
            raise ValueError("staged_at is not a number")
        job_id = raw.get("id")
        if not isinstance(job_id, str):
            raise ValueError("id is not a string")
        files = []
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
                raise ValueError("a files entry has no path")
            numbers = [_record_int(entry, key) for key in ("device", "inode", "size")]
            files.append((entry["path"], *numbers))
        names = _checked_names(tuple(path for path, *_ in files))
        flags = [raw.get(key, False) for key in ("shim_loads", "copies")]
        if any(type(flag) is not bool for flag in flags):
            raise ValueError("shim_loads or copies is not true or false")
        return cls(
            id=job_id,
            step=_record_int(raw, "step", protocol.MAX_STEP),
            kind=str(kind),
            staged_at=float(staged_at),
            files=files,
            local=_record_names(raw, "local", names),
            shim_loads=flags[0],
            copies=flags[1],
            replicas=_record_names(raw, "replicas", names),
            handed=None if raw.get("handed") is None else _record_names(raw, "handed", names),
        )

    def job(self, files: list[OpenedFile]) -> StagedJob:
        return StagedJob(
            id=self.id,
            step=self.step,
            kind=self.kind,
            files=files,
            staged_at=self.staged_at,
            local=self.local,
            shim_loads=self.shim_loads,
            copies=self.copies,
            replicas=self.replicas,
            handed=self.handed,
        )


def _record_names(raw: dict[str, object], key: str, names: list[str]) -> frozenset[str]:
    """The names under ``key`` of a record (absent: none), each one of its files."""
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{key} is not a list of names")
    if not set(value) <= set(names):
        raise ValueError(f"{key} is not a list of the record's files")
    return frozenset(value)


def _record_int(raw: dict[str, object], key: str, high: int = 2**64 - 1) -> int:
    value = raw.get(key)
    if type(value) is not int or not 0 <= value <= high:
        raise ValueError(f"{key} is not an integer from 0 to {high}")
    return value


def _check_fits(directory: int, opened: list[OpenedFile]) -> None:
    """Staged files are on the staging volume, so together they fit in it: a larger size
    (a sparse file claiming terabytes it does not hold) is refused before any work is
    made for it."""
    volume = os.fstatvfs(directory)
    capacity = volume.f_blocks * volume.f_frsize
    sizes = {(f.device, f.inode): f.size for f in opened}
    for f in opened:
        if f.size > capacity:
            raise StagingError(
                f"file {f.name!r} claims {f.size} bytes, more than the staging volume's "
                f"{capacity} (a sparse file?)"
            )
    if sum(sizes.values()) > capacity:
        raise StagingError(
            f"the files claim {sum(sizes.values())} bytes together, more than the staging "
            f"volume's {capacity}"
        )


def _checked_names(files: tuple[str, ...]) -> list[str]:
    """Staged names as ``manifest.check_path`` allows them, each once."""
    names = list(files)
    for name in names:
        try:
            mf.check_path(name)
        except mf.PathError as exc:
            raise StagingError(f"file {exc}") from None
    if len(set(names)) != len(names):
        raise StagingError("a file is listed twice")
    return names


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)
