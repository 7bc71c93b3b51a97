"""Start one container: private mount and PID namespaces, the spec's mounts, then exec.

Run by path (``python -I -S launch.py SPEC.json``), standard library only. It
does what a container runtime does for the parts that matter to jitckpt:

* a private mount namespace in which every volume mount of the spec is a bind
  mount at the spec's exact path, so ``/mnt/jitckpt`` of one pod is not that of
  another pod on the same machine;
* a PID namespace whose PID 1 is the container's command: a SIGTERM reaches only
  PID 1 (a shell there ignores it, as in a real pod), and when PID 1 dies the
  kernel kills everything else in the container, however it was daemonized;
* a fresh ``/proc`` for that namespace, so pid files and ``kill`` inside
  the container mean the container's own processes.

The launcher stays as the parent of PID 1, writes PID 1's host pid to the spec's
``pidFile`` and exits with the container's exit code in Kubernetes' convention
(128 + signal when it was killed by one).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
EXEC_FAILED = 127

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int) -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            None,
        ),
        f"mount {source} on {target}",
    )


def _die_with_parent() -> None:
    """Be killed when the parent goes, so a crashed runner leaves no container behind."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")


def _setup_mounts(mounts: list[dict[str, Any]]) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for mount in mounts:
        source, target = str(mount["source"]), str(mount["target"])
        _mount(source, target, None, MS_BIND | MS_REC)
        if mount.get("readOnly"):
            _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)


def _child(spec: dict[str, Any]) -> None:
    """PID 1 of the container: never returns."""
    try:
        _die_with_parent()
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        os.chdir(str(spec.get("workingDir") or "/"))
        argv = [str(part) for part in spec["argv"]]
        env = {str(k): str(v) for k, v in spec["env"].items()}
        os.execvpe(argv[0], argv, env)
    except Exception as exc:
        sys.stderr.write(f"container start failed: {exc}\n")
        sys.stderr.flush()
    os._exit(EXEC_FAILED)


def main() -> int:
    with open(sys.argv[1]) as handle:
        spec = json.load(handle)
    # The runner signals PID 1 directly; the launcher itself only waits.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    _die_with_parent()
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare")
    _setup_mounts(spec["mounts"])
    pid = os.fork()
    if pid == 0:
        _child(spec)
    tmp = spec["pidFile"] + ".tmp"
    with open(tmp, "w") as handle:
        handle.write(str(pid))
    os.rename(tmp, spec["pidFile"])
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main())
