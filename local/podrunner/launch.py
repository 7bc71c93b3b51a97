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
  the container mean the container's own processes;
* with a ``root`` (an image unpacked on this machine, see ``image.py``): an
  overlay on it as the container's root, read-only if the spec says so, with
  a ``/dev`` of its own and the mounts under it, entered by ``chroot`` as the
  container's user.

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
PR_SET_NO_NEW_PRIVS = 38
MAX_SYMLINKS = 40
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
EXEC_FAILED = 127

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def _die_with_parent() -> None:
    """Be killed when the parent goes, so a crashed runner leaves no container behind."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")


def _in_root(top: str, path: str) -> str:
    """``path`` as the container sees it, resolved under ``top``: a symlink in the image
    (Debian's /var/run -> /run) is followed inside the image, never out to this machine."""
    parts = [part for part in path.split("/") if part not in ("", ".")]
    resolved, links = top, 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = os.path.dirname(resolved) if resolved != top else top
            continue
        candidate = os.path.join(resolved, part)
        if os.path.islink(candidate):
            links += 1
            if links > MAX_SYMLINKS:
                raise OSError(f"too many symbolic links under {top}: {path}")
            link = os.readlink(candidate)
            resolved = top if link.startswith("/") else resolved
            parts = [p for p in link.split("/") if p not in ("", ".")] + parts
            continue
        resolved = candidate
    return resolved


def _mount_point(target: str, like: str) -> None:
    """An empty mount point of the same kind as ``like``, made inside an image root."""
    if os.path.lexists(target):
        return
    if os.path.isdir(like):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()


def _image_root(root: dict[str, Any]) -> str:
    """The container's root: an overlay on the image (which stays untouched) with a
    fresh /dev; returns where it is mounted."""
    scratch = str(root["scratch"])
    upper, work, merged = (os.path.join(scratch, d) for d in ("upper", "work", "merged"))
    for directory in (upper, work, merged):
        os.makedirs(directory, exist_ok=True)
    layers = f"lowerdir={root['image']},upperdir={upper},workdir={work}"
    _mount("overlay", merged, "overlay", 0, layers)
    _mount(merged, merged, None, MS_BIND)  # its own mount, so it can be made read-only
    dev = os.path.join(merged, "dev")
    os.makedirs(dev, exist_ok=True)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=755")
    for node in DEVICES:
        _mount_point(os.path.join(dev, node), f"/dev/{node}")
        _mount(f"/dev/{node}", os.path.join(dev, node), None, MS_BIND)
    os.makedirs(os.path.join(dev, "shm"))
    _mount("tmpfs", os.path.join(dev, "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{number}", os.path.join(dev, name))
    os.symlink("/proc/self/fd", os.path.join(dev, "fd"))
    return merged


def _setup_mounts(mounts: list[dict[str, Any]], root: dict[str, Any] | None) -> str:
    """The spec's mounts, under the image root if there is one; returns the root."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    top = _image_root(root) if root else "/"
    for mount in mounts:
        source, target = str(mount["source"]), str(mount["target"])
        if root:
            target = _in_root(top, target)
            _mount_point(target, source)
        _mount(source, target, None, MS_BIND | MS_REC)
        if mount.get("readOnly"):
            _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)
    if root and root.get("readOnly"):
        _mount(None, top, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    return top


def _enter(top: str, root: dict[str, Any]) -> None:
    """Into the image root as the container's user (no capabilities are left after)."""
    os.chroot(top)
    if root.get("noNewPrivileges"):
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl")
    os.setgroups([])
    os.setgid(int(root["gid"]))
    os.setuid(int(root["uid"]))


def _child(spec: dict[str, Any], top: str) -> None:
    """PID 1 of the container: never returns."""
    try:
        _die_with_parent()
        proc = os.path.join(top, "proc")
        os.makedirs(proc, exist_ok=True)
        _mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if spec.get("root"):
            _enter(top, spec["root"])
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
    top = _setup_mounts(spec["mounts"], spec.get("root"))
    pid = os.fork()
    if pid == 0:
        _child(spec, top)
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
