"""buildah with a storage of its own: vfs driver, chroot isolation, run as root.

vfs needs no kernel overlay support and chroot isolation no OCI runtime, so
this works in a CI job on a plain machine. The storage lives in the cache
directory, not in ``/var/lib/containers``: whatever else uses buildah or podman
on the machine neither sees nor prunes it.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Buildah:
    storage: Path  # graph root: images and containers
    run_root: Path  # locks and mount state, on a tmpfs

    def _argv(self, args: tuple[str, ...]) -> list[str]:
        global_options = ["--root", str(self.storage), "--runroot", str(self.run_root)]
        return ["buildah", *global_options, "--storage-driver", "vfs", *args]

    def run(self, *args: str) -> None:
        """A buildah command whose output goes to ours (the build log)."""
        subprocess.run(self._argv(args), check=True, stdin=subprocess.DEVNULL)

    def output(self, *args: str) -> str:
        """A buildah command's standard output, stripped."""
        done = subprocess.run(
            self._argv(args), check=True, stdin=subprocess.DEVNULL, capture_output=True, text=True
        )
        return done.stdout.strip()

    def has_image(self, name: str) -> bool:
        done = subprocess.run(
            self._argv(("inspect", "--type", "image", name)),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
        return done.returncode == 0
