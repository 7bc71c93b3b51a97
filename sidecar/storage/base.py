"""The store interface every backend implements, keyed relative to a job root.

The uploader, restore, validity check, retention and ``jitckpt ls`` speak only
this interface, so the ``pvc://`` backend passes the same tests as S3.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass

from sidecar.safefs import OpenedFile

# Set while an upload may send its next part; cleared, it pauses the upload at the next
# part boundary (the uploader clears it for periodic uploads while a JIT one runs).
PartGate = asyncio.Event


class StoreError(RuntimeError):
    """The store refused or kept failing; the message says what and where."""


class VerificationError(StoreError):
    """Downloaded bytes do not match the manifest (size or CRC32C)."""


class WrongObject(VerificationError):
    """The object is not the one the manifest names: missing, or of another size. Asking
    again changes nothing, so it is never retried."""


def check_sent(name: str, expected: str | None, sent: str) -> None:
    """What ``put_file`` sent of ``name`` (CRC32C ``sent``) is what the caller expected,
    when it said: the file changed in between otherwise (a VerificationError)."""
    if expected is not None and expected != sent:
        raise VerificationError(
            f"{name} changed while being uploaded (CRC32C {sent}, not {expected})"
        )


class ObjectTooLarge(StoreError):
    """A small object (a manifest) is larger than its reader accepts; it was not read."""


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object. ``crc32c`` is set only where the store keeps a whole-object one."""

    key: str
    size: int
    mtime: float
    crc32c: str | None = None


@dataclass(frozen=True)
class PutResult:
    """What one upload took (for metrics and the grace estimate) and the CRC32C of the
    bytes it sent, for the manifest."""

    size: int
    parts: int
    retries: int
    crc32c: str


class Store(abc.ABC):
    """An async checkpoint store rooted at one job root."""

    #: The store reports a whole-object CRC32C for single-part objects (S3 does).
    keeps_checksums: bool = False

    @property
    @abc.abstractmethod
    def uri(self) -> str:
        """The job root, as the user wrote it."""

    @abc.abstractmethod
    async def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (checksums not filled in)."""

    @abc.abstractmethod
    async def list_dirs(self, prefix: str = "") -> list[str]:
        """The names of the "directories" right below ``prefix`` (each ending in ``/``):
        a request per 1,000, however many objects each holds."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo | None:
        """One object with its checksum where kept, or None when absent."""

    @abc.abstractmethod
    async def put_file(
        self,
        key: str,
        source: OpenedFile,
        crc32c: str | None = None,
        gate: PartGate | None = None,
    ) -> PutResult:
        """Upload exactly ``source.size`` bytes read from ``source``'s descriptor (never
        its name: the name may have been swapped since it was opened) and return the
        CRC32C of what was sent, computed from the bytes as they are read. A file that
        changed size raises safefs.FileChanged. A ``crc32c`` the caller already has is
        checked against what was sent: a mismatch is a VerificationError."""

    @abc.abstractmethod
    async def get_file(
        self, key: str, fd: int, size: int, crc32c: str, offset: int | None = None
    ) -> None:
        """Download into the open, empty file ``fd`` (the caller made it, without
        following any symlink, and closes it); raises VerificationError unless size and
        CRC32C match. ``offset``: the object is a piece of the file, written from there
        (the caller sized the file; other pieces may be written into it meanwhile).
        Not forced to disk: the trainer reads it from the page cache, and
        a restore checks the CRC32C of every file it finds in place before trusting it,
        so what a crash left half written is fetched again (an fsync here cost a restore
        nearly as much CPU as the rest of the download, in writeback charged to the
        sidecar, and the rename into place that follows was never synced either)."""

    @abc.abstractmethod
    async def put_bytes(self, key: str, data: bytes) -> None:
        """A small object (manifests, probes), written whole."""

    @abc.abstractmethod
    async def get_bytes(self, key: str, max_size: int) -> bytes:
        """A small object, read whole if it has at most ``max_size`` bytes; a larger one
        is not read (ObjectTooLarge): the store is not trusted to keep manifests small."""

    @abc.abstractmethod
    async def delete(self, keys: list[str]) -> None:
        """Remove objects; absent ones are not an error."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections."""

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
