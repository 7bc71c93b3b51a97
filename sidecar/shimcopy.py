"""Copy the shim into the shared volume the trainer's PYTHONPATH points at.

The sidecar image carries the shim as the ``shim`` package; the trainer's
image does not, so at start the sidecar copies the package's ``.py`` files
(never bytecode: the trainer's Python may be another version) into the
``jitckpt-shim`` volume. Files are world-readable because the trainer may
run as another user; the copy is made beside the target and renamed into
place so a trainer never imports a half-copied shim.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import shim

FILE_MODE = 0o644
DIR_MODE = 0o755


def source_dir() -> Path:
    return Path(shim.__file__).resolve().parent


def _copy_tree(source: Path, target: Path) -> int:
    count = 0
    target.mkdir(parents=True, exist_ok=True)
    os.chmod(target, DIR_MODE)
    for path in sorted(source.rglob("*.py")):
        relative = path.relative_to(source)
        if "__pycache__" in relative.parts:
            continue
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(destination.parent, DIR_MODE)
        shutil.copyfile(path, destination)
        os.chmod(destination, FILE_MODE)
        count += 1
    return count


def install(target: Path) -> int:
    """Copy the shim's ``.py`` files to ``target``; returns how many."""
    source = source_dir()
    if target.resolve() == source:
        return 0
    if os.path.ismount(target):
        return _copy_tree(source, target)  # cannot rename over a mount point
    target.parent.mkdir(parents=True, exist_ok=True)
    fresh = target.with_name(f".{target.name}.new-{os.getpid()}")
    shutil.rmtree(fresh, ignore_errors=True)
    count = _copy_tree(source, fresh)
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(fresh, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(fresh, target)
    return count
