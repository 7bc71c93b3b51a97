"""The machine the pods run on: where their files go, their IPs, images, Secrets.

A ``Node`` plays the part of the kubelet's host: it owns a state directory
(one subdirectory per pod, one per claim), the Secrets and ConfigMaps the
pods may reference, the mapping from a container image to the local
interpreter that stands in for it (or to the image itself, unpacked: see
``image.py``), and the pod IPs (each pod gets its own
loopback address, so two pods can both listen on port 8471 as they would on
two pod IPs).
"""

from __future__ import annotations

import fnmatch
import random
import socket
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from local.podrunner.image import ImageRoot
from local.podrunner.spec import ObjectStore

# Random draws of a pod address before giving up (each one a bind test of its ports).
ALLOCATION_TRIES = 64
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _default_images() -> dict[str, Path]:
    """Every image runs with this interpreter's environment (its bin dir first on PATH)."""
    return {"*": Path(sys.executable).parent}


def _bindable(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True


class NoAddress(RuntimeError):
    """No pod address has the pod's ports free: with no network namespace per pod, a
    process of another pod listening on all addresses (a terminating trainer's
    rendezvous port) holds them until it exits."""


@dataclass
class Node:
    """Host-side state shared by the pods this runner starts."""

    root: Path
    objects: ObjectStore = field(default_factory=ObjectStore)
    images: Mapping[str, Path] = field(default_factory=_default_images)
    image_env: Mapping[str, str] = field(default_factory=dict)
    # Images unpacked here (image pattern -> its root): their containers run from
    # that root as the image's user, not from this interpreter (see image.py).
    image_roots: Mapping[str, ImageRoot] = field(default_factory=dict)
    stream: IO[str] | None = None
    _ips: set[str] = field(default_factory=set, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def claims_dir(self) -> Path:
        return self.root / "claims"

    def claim_path(self, claim: str) -> Path:
        """The directory that stands for a PersistentVolumeClaim on this node."""
        path = self.claims_dir / claim
        path.mkdir(parents=True, exist_ok=True)
        return path

    def pod_dir(self, namespace: str, name: str, uid: str) -> Path:
        """Per pod *instance*: a re-created pod of the same name starts with nothing."""
        return self.root / "pods" / f"{namespace}_{name}_{uid}"

    def base_env(self, image: str) -> dict[str, str]:
        """What the image's own ENV would give: PATH with the image's interpreter first."""
        bin_dir = next(
            (path for pattern, path in self.images.items() if fnmatch.fnmatch(image, pattern)),
            None,
        )
        env = {"PATH": f"{bin_dir}:{SYSTEM_PATH}" if bin_dir else SYSTEM_PATH, "HOME": "/root"}
        env.update(self.image_env)
        return env

    def image_root(self, image: str) -> ImageRoot | None:
        """The unpacked image a container of ``image`` runs from, if the node has one."""
        return next(
            (root for pattern, root in self.image_roots.items() if fnmatch.fnmatch(image, pattern)),
            None,
        )

    def allocate_ip(self, ports: set[int]) -> str:
        """A loopback address of its own for a pod, with the pod's ports free on it.

        Drawn at random from all of 127.0.0.0/8 (Linux answers on every address of
        it): another runner on this machine (a second demo, a parallel test) checks
        only its own pods, so two runners must almost never draw the same address
        before either pod has bound its ports. Among 16 million the chance is nil;
        among the 253 of one /24 it was not."""
        with self._lock:
            for _ in range(ALLOCATION_TRIES):
                b, c, d = random.randrange(1, 255), random.randrange(256), random.randrange(1, 255)
                ip = f"127.{b}.{c}.{d}"
                if ip not in self._ips and all(_bindable(ip, p) for p in ports):
                    self._ips.add(ip)
                    return ip
        raise NoAddress(f"no loopback address with ports {sorted(ports)} free for another pod")

    def release_ip(self, ip: str) -> None:
        with self._lock:
            self._ips.discard(ip)
