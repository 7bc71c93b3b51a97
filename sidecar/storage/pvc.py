"""The ``pvc://`` backend: the same layout on a mounted claim (or any directory).

Writes go to a temporary file in the target directory, are fsynced, renamed
into place and the directory fsynced, so a reader (another node's restore,
``jitckpt ls``) sees either nothing or the whole file, even after a crash; a
directory made on the way is fsynced into its parent too, or a crash could
lose the directory entry of a file already called durable.
The filesystem keeps no checksum: validity checks sizes here, and every
restore still verifies the manifest's CRC32C.

The claim is a store like a bucket: not trusted (DESIGN 7). Whoever else
mounts it may plant a symlink, a FIFO or a device where an object should be.
Only regular files are objects: a listing skips anything else, and reads
walk down from the job root with ``safefs`` (no symlink followed, a regular
file or nothing), so a planted link is a missing object, never a read
outside the job root.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import uuid
from pathlib import Path

import google_crc32c

from sidecar import checksum, safefs, settle
from sidecar.safefs import OpenedFile
from sidecar.storage.base import (
    ObjectInfo,
    ObjectTooLarge,
    PartGate,
    PutResult,
    Store,
    StoreError,
    VerificationError,
    WrongObject,
    check_sent,
)

TMP_MARK = ".jitckpt-tmp-"  # temporary files carry this; listings skip them
COPY_CHUNK = 8 * 1024 * 1024


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


CLAIM_DIR_MODE = 0o775  # every node's sidecar runs as the image's uid; group for fsGroup


def _makedirs(path: Path) -> None:
    """Directories the other nodes' sidecars (same uid, or the pod's fsGroup) write into;
    each one made here is fsynced into its parent."""
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=CLAIM_DIR_MODE)
        except FileExistsError:
            continue  # another node made it (and fsynced it)
        os.chmod(directory, CLAIM_DIR_MODE)
        _fsync_dir(directory.parent)


def atomic_write(target: Path, source: OpenedFile | None, data: bytes | None) -> str:
    """Write ``source``'s bytes (or ``data``) to ``target`` atomically; return the CRC32C."""
    _makedirs(target.parent)
    tmp = target.with_name(f"{TMP_MARK}{target.name}.{uuid.uuid4().hex}")
    crc = 0
    try:
        with tmp.open("xb") as out:
            if data is not None:
                out.write(data)
                crc = google_crc32c.value(data)
            elif source is not None:
                for chunk in source.chunks(COPY_CHUNK):
                    out.write(chunk)
                    crc = google_crc32c.extend(crc, chunk)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return checksum.encode(crc)


class DirectoryStore(Store):
    """A job root that is a directory (a ``pvc://`` claim mounted in the sidecar)."""

    keeps_checksums = False

    def __init__(self, root: Path, uri: str) -> None:
        self.root = root
        self._uri = uri

    @property
    def uri(self) -> str:
        return self._uri

    async def close(self) -> None:
        """A directory holds no connections."""

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"key {key!r} leaves the job root")
        return path

    def _list(self, prefix: str) -> list[ObjectInfo]:
        if not self.root.is_dir():
            return []
        found: list[ObjectInfo] = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(TMP_MARK):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    info = full.lstat()
                    if stat.S_ISREG(info.st_mode):  # a symlink or a FIFO is no object
                        found.append(ObjectInfo(key=key, size=info.st_size, mtime=info.st_mtime))
        return found

    async def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        return await asyncio.to_thread(self._list, prefix)

    def _dirs(self, prefix: str) -> list[str]:
        """Directories right below ``prefix`` ("" or a directory's key ending in ``/``)
        that hold an object, as S3's delimiter listing shows only prefixes of keys (an
        empty directory left behind is no checkpoint), never through a symlink."""
        base = self.root / prefix if prefix else self.root
        try:
            with os.scandir(base) as entries:
                return [
                    e.name + "/"
                    for e in entries
                    if e.is_dir(follow_symlinks=False) and _holds_object(Path(e.path))
                ]
        except (FileNotFoundError, NotADirectoryError):
            return []

    async def list_dirs(self, prefix: str = "") -> list[str]:
        return await asyncio.to_thread(self._dirs, prefix)

    def _head(self, key: str) -> ObjectInfo | None:
        try:
            source = self._open(key)
        except (FileNotFoundError, safefs.UnsafeError):
            return None  # what the listing would not show either
        try:
            info = os.fstat(source.fd)
        finally:
            source.close()
        return ObjectInfo(key=key, size=info.st_size, mtime=info.st_mtime)

    async def head(self, key: str) -> ObjectInfo | None:
        return await asyncio.to_thread(self._head, key)

    async def put_file(
        self,
        key: str,
        source: OpenedFile,
        crc32c: str | None = None,
        gate: PartGate | None = None,
    ) -> PutResult:
        if gate is not None:
            await gate.wait()
        written = await asyncio.to_thread(atomic_write, self._path(key), source, None)
        check_sent(source.name, crc32c, written)
        return PutResult(size=source.size, parts=1, retries=0, crc32c=written)

    def _open(self, key: str) -> OpenedFile:
        """The object ``key``: a regular file reached from the job root without following
        a symlink (anything else raises OSError)."""
        root = safefs.open_root(self.root)
        try:
            return safefs.open_regular(root, key, None)
        finally:
            os.close(root)

    def _get(self, key: str, fd: int, size: int, crc32c: str, base: int) -> None:
        crc = 0
        written = 0
        source = self._open(key)
        try:
            if source.size != size:
                raise WrongObject(f"{key} is {source.size} bytes, the manifest says {size}")
            while written <= size and (chunk := os.pread(source.fd, COPY_CHUNK, written)):
                os.pwrite(fd, chunk, base + written)
                written += len(chunk)
                crc = google_crc32c.extend(crc, chunk)
        finally:
            source.close()
        if written != size:
            raise VerificationError(f"{key}: {written} bytes read, the manifest says {size}")
        if checksum.encode(crc) != crc32c:
            raise VerificationError(f"{key}: CRC32C does not match the manifest")

    async def get_file(
        self, key: str, fd: int, size: int, crc32c: str, offset: int | None = None
    ) -> None:
        try:
            await settle.in_thread(self._get, key, fd, size, crc32c, offset or 0)
        except FileNotFoundError as exc:
            raise WrongObject(f"missing object {key}") from exc
        except safefs.UnsafeError as exc:
            raise WrongObject(f"{key}: {exc.strerror}") from exc

    async def put_bytes(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(atomic_write, self._path(key), None, data)

    def _read_small(self, key: str, max_size: int) -> bytes:
        source = self._open(key)
        try:
            if source.size > max_size:
                raise ObjectTooLarge(f"{key} is {source.size} bytes, more than {max_size}")
            data = os.pread(source.fd, max_size + 1, 0)  # never more, even if it grew meanwhile
        finally:
            source.close()
        if len(data) > max_size:
            raise ObjectTooLarge(f"{key} is more than {max_size} bytes")
        return data

    async def get_bytes(self, key: str, max_size: int) -> bytes:
        try:
            return await asyncio.to_thread(self._read_small, key, max_size)
        except OSError as exc:
            raise StoreError(f"cannot read {key}: {exc}") from exc

    def _delete(self, keys: list[str]) -> None:
        parents: set[Path] = set()
        for key in keys:
            path = self._path(key)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            parents.add(path.parent)
        root = self.root.resolve()
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            current = parent
            while current != root and current.is_relative_to(root):
                try:
                    current.rmdir()
                except OSError:
                    break
                current = current.parent

    async def delete(self, keys: list[str]) -> None:
        await asyncio.to_thread(self._delete, keys)


def _holds_object(directory: Path) -> bool:
    """Whether a regular file (an object) lies anywhere below ``directory``."""
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            if name.startswith(TMP_MARK):
                continue
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG((Path(dirpath) / name).lstat().st_mode):
                    return True
    return False
