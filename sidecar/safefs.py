"""File operations in a directory the trainer can write, that never follow a symlink.

The trainer shares ``/mnt/jitckpt`` with the sidecar and may swap any name in
it for a symlink (or a FIFO, or another file) between two system calls. So
the sidecar never passes a path under that volume to ``open``, ``chmod`` or
``rmtree``: it opens the volume's mount point (a path the trainer cannot
change) and walks down one component at a time with ``dir_fd`` and
``O_NOFOLLOW``, checks what it opened with ``fstat``, and from then on uses
only the descriptor. A name swapped after that changes nothing the sidecar
reads or writes; a symlink met on the way is an error, never followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO the trainer planted returns at once (and fails the regular-
# file check) instead of blocking until a writer appears; O_NOCTTY: a terminal never
# becomes the sidecar's.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeError(OSError):
    """A name that is not what the sidecar may touch: a symlink, a non-regular file,
    a file on another device, a name that leaves its directory."""


class FileChanged(OSError):
    """An opened file no longer has the size it had when it was opened."""


def components(relative: str) -> list[str]:
    """The names of a relative, normalized ``/``-separated path; anything else is refused
    (callers validate names where they enter; this is the last line, not the rule)."""
    parts = relative.split("/")
    if not relative or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise UnsafeError(errno.EINVAL, f"not a relative, normalized path: {relative!r}")
    return parts


def open_root(path: Path) -> int:
    """A directory the sidecar was configured with (a mount point): the one path opened
    by name; everything below it is reached through descriptors."""
    return os.open(path, _DIR_FLAGS & ~os.O_NOFOLLOW)


def open_dir(parent: int, name: str) -> int:
    """``name`` in ``parent``, which must be a real directory (a symlink is ELOOP)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeError(exc.errno, f"{name!r} is not a directory (a symlink?)") from None
        raise


def open_dirs(root: int, relative: str) -> int:
    """The directory ``relative`` below ``root``, every component opened without following."""
    fd = os.dup(root)
    try:
        for name in components(relative):
            child = open_dir(fd, name)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_dir(parent: int, name: str, mode: int) -> int:
    """A real directory ``name`` in ``parent``, made with ``mode`` if missing, opened.

    Something else in its place (a symlink, a file: only the trainer can have put it
    there) is removed, never followed, and a fresh directory made.
    """
    for _ in range(3):
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, mode, dir_fd=parent)
        try:
            fd = open_dir(parent, name)
        except UnsafeError:
            remove(parent, name)
            continue
        except FileNotFoundError:
            continue  # removed between mkdir and open: make it again
        return fd
    raise UnsafeError(errno.EAGAIN, f"{name!r} keeps being replaced while it is made")


@dataclass
class OpenedFile:
    """A regular file opened once: every later read goes through ``fd``, and reads exactly
    the ``size`` it had when opened (a file that grows or shrinks is refused)."""

    name: str
    fd: int
    size: int
    device: int
    inode: int

    def pread(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise FileChanged(errno.EIO, f"{self.name} shrank below {self.size} bytes")
        return data

    def chunks(self, chunk: int) -> Iterator[bytes]:
        """The whole file in pieces of ``chunk`` bytes, then a check that its size held."""
        for offset in range(0, self.size, chunk):
            yield self.pread(offset, min(chunk, self.size - offset))
        self.check_size()

    def check_size(self) -> None:
        now = os.fstat(self.fd).st_size
        if now != self.size:
            raise FileChanged(errno.EIO, f"{self.name} is {now} bytes, was {self.size} when opened")

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


@dataclass
class FileRange(OpenedFile):
    """``size`` bytes of an opened file from ``start``, uploaded as an object of its own
    (a piece): read through the file's descriptor, which stays the file's to close, and
    checked against the whole file's size (``whole``)."""

    start: int = 0
    whole: int = 0

    @classmethod
    def of(cls, source: OpenedFile, start: int, size: int) -> FileRange:
        return cls(source.name, source.fd, size, source.device, source.inode, start, source.size)

    def pread(self, offset: int, length: int) -> bytes:
        return super().pread(self.start + offset, length)

    def check_size(self) -> None:
        now = os.fstat(self.fd).st_size
        if now != self.whole:
            raise FileChanged(
                errno.EIO, f"{self.name} is {now} bytes, was {self.whole} when opened"
            )

    def close(self) -> None:
        """The file's descriptor is not the range's."""


def _open_file(parent: int, name: str, shown: str) -> tuple[int, os.stat_result]:
    """``name`` in ``parent`` opened for reading, and its status: never through a symlink,
    never blocking on a FIFO; raises UnsafeError (the descriptor closed) unless it is a
    regular file. ``shown`` names it in the error."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeError(exc.errno, f"{shown} is a symlink") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeError(errno.EINVAL, f"{shown} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def open_regular(root: int, relative: str, device: int | None) -> OpenedFile:
    """Open ``relative`` below ``root`` for reading, never through a symlink, and only if
    it is a regular file on ``device`` (the staging volume) that is still linked."""
    *dirs, name = components(relative)
    parent = open_dirs(root, "/".join(dirs)) if dirs else os.dup(root)
    try:
        fd, info = _open_file(parent, name, relative)
    finally:
        os.close(parent)
    try:
        if device is not None and info.st_dev != device:
            raise UnsafeError(errno.EXDEV, f"{relative} is not on the staging volume")
        # Hard links are how the shim stages, so more than one is normal; none means the
        # name was removed while it was being opened.
        if info.st_nlink < 1:
            raise UnsafeError(errno.ENOENT, f"{relative} was removed while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return OpenedFile(relative, fd, info.st_size, info.st_dev, info.st_ino)


def open_path(path: Path) -> OpenedFile:
    """A regular file the caller names itself (not in a shared volume: a benchmark's or a
    test's own file), opened like a staged one: its last component is not followed."""
    parent = open_root(path.parent)
    try:
        return open_regular(parent, path.name, None)
    finally:
        os.close(parent)


def read_small(parent: int, name: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``name`` in ``parent``: never through a
    symlink (one to ``/dev/zero`` would never end), never blocking on a FIFO."""
    fd, _ = _open_file(parent, name, name)
    try:
        return os.pread(fd, limit, 0)
    finally:
        os.close(fd)


def walk_files(root: int, limit: int, depth: int) -> list[str]:
    """Relative paths of the regular files below ``root``, sorted; a symlink or any other
    kind of entry is refused, and so are more than ``limit`` files or ``depth`` levels."""
    found: list[str] = []

    def visit(fd: int, prefix: str, level: int) -> None:
        if level > depth:
            raise UnsafeError(errno.E2BIG, f"{prefix} is more than {depth} directories deep")
        with os.scandir(fd) as entries:
            listed = sorted(
                (e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False))
                for e in entries
            )
        for name, is_dir, is_file in listed:
            relative = f"{prefix}{name}"
            if is_dir:
                child = open_dir(fd, name)
                try:
                    visit(child, relative + "/", level + 1)
                finally:
                    os.close(child)
            elif is_file:
                found.append(relative)
                if len(found) > limit:
                    raise UnsafeError(errno.E2BIG, f"more than {limit} files")
            else:
                raise UnsafeError(errno.EINVAL, f"{relative} is not a regular file")

    visit(root, "", 1)
    return found


def create_file(parent: int, name: str, mode: int) -> int:
    """A new file ``name`` in ``parent`` for writing; fails if anything has that name."""
    fd = os.open(name, _CREATE_FLAGS, mode, dir_fd=parent)
    os.fchmod(fd, mode)  # whatever the umask
    return fd


# Directory levels ``remove`` descends: the trainer can nest directories without end,
# and each level holds a descriptor and a stack frame.
REMOVE_DEPTH = 64


def remove(parent: int, name: str, depth: int = REMOVE_DEPTH) -> None:
    """Remove ``name`` from ``parent``: a directory with everything in it, anything else
    unlinked (a symlink itself, never what it points at). Absent is fine."""
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)
        return
    if depth <= 0:
        raise UnsafeError(errno.E2BIG, f"{name!r} is nested too deep to remove")
    try:
        fd = open_dir(parent, name)
    except UnsafeError:
        remove(parent, name, depth - 1)  # swapped for something else since the stat
        return
    except FileNotFoundError:
        return
    try:
        with os.scandir(fd) as entries:
            names = [e.name for e in entries]
        for child in names:
            remove(fd, child, depth - 1)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=parent)
