"""Copy the shim into the shared volume the trainer's PYTHONPATH points at.

The sidecar image carries the shim as the ``shim`` package; the trainer's
image does not, so at start the sidecar copies the package's ``.py`` files
(never its own bytecode files: the trainer's Python may be another version)
into the ``jitckpt-shim`` volume. Files are world-readable because the trainer
may run as another user; the copy is made beside the target and renamed into
place so a trainer never imports a half-copied shim.

The volume is read-only in the trainer, so its Python cannot cache what it
compiles: every trainer process compiled every shim module it imported, about
0.1 s of CPU at each process start. Once the trainer may start, the sidecar
compiles the copy (``compile_bytecode``) into ``__pycache__`` under its own
interpreter's tag: a trainer on the same Python version loads that, one on
another version looks for its own tag and compiles, as before.
"""

from __future__ import annotations

import importlib.util
import os
import py_compile
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


def _import_order(target: Path, path: Path) -> tuple[int, bool, Path]:
    """Roughly the order a trainer imports the shim in: ``sitecustomize`` at its start,
    the package's own modules at activation, the framework modules when the program
    imports torch or its framework, seconds later."""
    relative = path.relative_to(target)
    return len(relative.parts), relative.name != "sitecustomize.py", relative


def compile_bytecode(target: Path) -> int:
    """Write the bytecode of the shim copied to ``target`` for this interpreter; returns
    how many modules. Each file is written whole beside its place and renamed into it
    (importlib's own writer), so a trainer importing meanwhile finds a module's bytecode
    complete or not at all, and compiles it itself then. Raises ``OSError`` (or
    ``py_compile.PyCompileError``) when a file cannot be written."""
    count = 0
    for path in sorted(target.rglob("*.py"), key=lambda path: _import_order(target, path)):
        if "__pycache__" in path.relative_to(target).parts:
            continue
        written = Path(importlib.util.cache_from_source(str(path)))
        py_compile.compile(str(path), cfile=str(written), doraise=True)
        os.chmod(written.parent, DIR_MODE)
        os.chmod(written, FILE_MODE)
        count += 1
    return count
