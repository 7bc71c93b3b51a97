"""Hard-link a finished checkpoint into ``staging/<id>/`` for the sidecar.

HF's ``save_total_limit`` rotation deletes old ``checkpoint-*`` directories
while the sidecar may still be uploading them; a hard link keeps the data
alive without copying a byte, and the sidecar deletes the links once
committed. Directories are made world-writable because the sidecar may run as
another user and must be able to remove them, and every staged file is made
readable by others: the sidecar runs as its own non-root user, and some
writers create files only their owner can read (safetensors writes 0600).
The wider mode reaches the checkpoint's own file too (a hard link shares its
inode); it stays inside the pod's local volume.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time
from typing import Callable, List, Optional, Sequence

from .log import say_once
from .protocol import Staged

DIR_MODE = 0o777
# Read for group and others, added to whatever mode a staged file has.
READABLE_BY_SIDECAR = 0o044


def _make_dir(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    os.chmod(path, DIR_MODE)  # not subject to the umask of the user's process


def _link(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        say_once(
            "staging-copy",
            "cannot hard-link into staging (%s): copying checkpoints instead" % exc.strerror,
        )
        shutil.copy2(source, target)
    _let_sidecar_read(target)


def _let_sidecar_read(path: str) -> None:
    """Make a staged file readable by the sidecar's user (only when this process owns it)."""
    status = os.lstat(path)
    wanted = status.st_mode | READABLE_BY_SIDECAR
    if not stat.S_ISREG(status.st_mode) or wanted == status.st_mode:
        return
    if status.st_uid != os.geteuid():
        return
    try:
        os.chmod(path, stat.S_IMODE(wanted))
    except OSError as exc:
        say_once("staging-mode", "cannot make staged files readable by the sidecar: %s" % exc)


def new_target(checkpoint_dir: str, staging_root: str, kind: str) -> str:
    """A fresh ``staging_root/<id>/`` for ``checkpoint_dir``, made (the id is its name)."""
    name = os.path.basename(os.path.normpath(checkpoint_dir))
    if not os.path.isdir(staging_root):
        _make_dir(staging_root)
    target_root = os.path.join(
        staging_root, "%s-%s-%d-%d" % (name, kind, os.getpid(), time.time_ns())
    )
    _make_dir(target_root)
    return target_root


def link_file(checkpoint_dir: str, target_root: str, relative: str) -> None:
    """Link one file (relative, ``/``-separated) of ``checkpoint_dir`` into ``target_root``."""
    parts = relative.split("/")
    for depth in range(1, len(parts)):  # each level made 0777, not just the leaf
        _make_dir(os.path.join(target_root, *parts[:depth]))
    _link(os.path.join(checkpoint_dir, *parts), os.path.join(target_root, *parts))


def stage(
    checkpoint_dir: str,
    staging_root: str,
    step: int,
    kind: str,
    *,
    only: Optional[Sequence[str]] = None,
    target_root: Optional[str] = None,
    linked: Sequence[str] = (),
    local: Optional[Callable[[str], bool]] = None,
    shim_loads: bool = False,
    copies: bool = False,
    replicas: Sequence[str] = (),
) -> Staged:
    """Link every file of ``checkpoint_dir`` (or ``only`` these, relative and ``/``-separated)
    into a fresh ``staging_root/<id>/``, or into ``target_root`` where the files ``linked``
    are already (a checkpoint streamed while it was written: ``streaming``).

    What it returns is the ``staged`` request that hands the links to the sidecar;
    ``local`` says which files only this node's ranks read on the same layout (none
    without it: every node then downloads every file); ``shim_loads``, ``copies`` and
    ``replicas`` (those among the files): the request's.
    """
    if target_root is None:
        target_root = new_target(checkpoint_dir, staging_root, kind)
    if only is not None:
        for relative in only:
            if relative not in linked:
                link_file(checkpoint_dir, target_root, relative)
        return _request(
            step,
            kind,
            target_root,
            only,
            local,
            shim_loads=shim_loads,
            copies=copies,
            replicas=replicas,
        )
    done = set(linked)
    files: List[str] = []
    for here, dirs, names in os.walk(checkpoint_dir):
        dirs.sort()
        relative_dir = os.path.relpath(here, checkpoint_dir)
        target_dir = target_root if relative_dir == "." else os.path.join(target_root, relative_dir)
        if target_dir != target_root:
            _make_dir(target_dir)
        for file_name in sorted(names):
            relative = file_name if relative_dir == "." else os.path.join(relative_dir, file_name)
            relative = relative.replace(os.sep, "/")
            if relative not in done:
                _link(os.path.join(here, file_name), os.path.join(target_dir, file_name))
            files.append(relative)
    return _request(
        step,
        kind,
        target_root,
        files,
        local,
        shim_loads=shim_loads,
        copies=copies,
        replicas=replicas,
    )


def _request(
    step: int,
    kind: str,
    target_root: str,
    files: Sequence[str],
    local: Optional[Callable[[str], bool]],
    *,
    shim_loads: bool,
    copies: bool,
    replicas: Sequence[str],
) -> Staged:
    marked = tuple(name for name in files if local is not None and local(name))
    shared = set(replicas) if copies else set()
    return Staged(
        step=step,
        kind=kind,
        dir=target_root,
        files=tuple(files),
        local=marked,
        shim_loads=shim_loads,
        copies=copies,
        replicas=tuple(name for name in files if name in shared),
    )
