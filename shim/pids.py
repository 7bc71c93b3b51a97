"""Pid files, so the pod's preStop hook can SIGTERM the training processes.

Many jobs run ``bash -c "pip install ... && torchrun ..."``: bash is PID 1 and
never forwards SIGTERM, so the kubelet's signal would reach nobody. Each
process the shim activates in writes ``<run dir>/pids/<pid>.pid`` and removes
it at exit; the preStop hook the webhook adds (``/bin/sh`` builtins only)
signals every pid listed there. The file's second line names the PID namespace.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys

from .log import failed

# ``typing`` costs milliseconds at startup of every Python process in the
# container; annotations are strings here, so only the type checker needs it.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Optional

# The pid file of this process (at most one entry).
_REGISTERED: List[str] = []


def is_multiprocessing_child() -> bool:
    """A helper process of ``multiprocessing`` (DataLoader workers, resource tracker).

    Those must not be signalled by the hook: a DataLoader worker killed by
    SIGTERM makes the trainer fail before it can save. Python 3.9 has no
    ``sys.orig_argv``: there every process registers.
    """
    argv = getattr(sys, "orig_argv", None) or []
    return any(
        arg == "--multiprocessing-fork" or arg.startswith("from multiprocessing") for arg in argv
    )


def pid_namespace() -> str:
    """This process's PID namespace (``pid:[inode]``), "" where ``/proc`` cannot say.

    Written on the pid file's second line (the preStop hook reads only the
    first): a reader in another namespace knows the pid is not one of its own.
    """
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def register(pids_dir: str) -> None:
    """Write this process's pid file and remove it at exit."""
    pid = os.getpid()
    path = os.path.join(pids_dir, "%d.pid" % pid)
    try:
        os.makedirs(pids_dir, exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as handle:
            handle.write("%d\n%s\n" % (pid, pid_namespace()))
        os.replace(tmp, path)
    except OSError as exc:
        failed("pid registration in %s" % pids_dir, exc)
        return
    _REGISTERED[:] = [path]
    atexit.register(unregister, pid)
    _prune(pids_dir)


def _prune(pids_dir: str) -> None:
    """Remove files of processes that died without cleaning up (killed by a signal)."""
    try:
        names = os.listdir(pids_dir)
    except OSError:
        return
    for name in names:
        stem = name[:-4] if name.endswith(".pid") else ""
        if not stem.isdigit():
            continue
        try:
            os.kill(int(stem), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(pids_dir, name))
        except OSError:
            pass  # alive, owned by another user


def unregister(pid: Optional[int] = None) -> None:
    """Remove the pid file; called at exit, and before ``os._exit`` (no atexit there)."""
    if pid is not None and os.getpid() != pid:
        return  # a forked child runs its parent's atexit handlers: not its file
    try:
        path = _REGISTERED.pop()  # one atomic step: two threads may unregister at once
    except IndexError:
        return
    with contextlib.suppress(OSError):
        os.unlink(path)
