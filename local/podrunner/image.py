"""A container image unpacked on this machine, so a container can run from its root.

Given to a ``Node`` as ``image_roots``, an image's containers run as a
container runtime runs them: chrooted into the image's root directory (an
overlay, so the image itself is never written), with the image's ENV, its
ENTRYPOINT and CMD where the spec gives no command, its USER unless the
securityContext names one, and the root read-only when the securityContext
says ``readOnlyRootFilesystem``. The image is an export with ``rootfs/`` (the
unpacked root) and ``oci/`` (an OCI image layout, where its config is read);
``python -m tools.images`` writes both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from local.podrunner.spec import SpecError


@dataclass(frozen=True)
class ImageConfig:
    """The run-time part of an OCI image config (``config`` in the config blob)."""

    env: dict[str, str]
    entrypoint: list[str]
    cmd: list[str]
    user: str
    working_dir: str
    exposed_ports: list[str]
    labels: dict[str, str]

    @classmethod
    def from_oci(cls, doc: Mapping[str, Any]) -> ImageConfig:
        config = doc.get("config") or {}
        env = dict(item.partition("=")[::2] for item in config.get("Env") or [])
        return cls(
            env=env,
            entrypoint=list(config.get("Entrypoint") or []),
            cmd=list(config.get("Cmd") or []),
            user=str(config.get("User") or ""),
            working_dir=str(config.get("WorkingDir") or "/"),
            exposed_ports=sorted(config.get("ExposedPorts") or {}),
            labels=dict(config.get("Labels") or {}),
        )


def _blob(layout: Path, descriptor: Mapping[str, Any]) -> dict[str, Any]:
    algorithm, _, digest = str(descriptor["digest"]).partition(":")
    doc: dict[str, Any] = json.loads((layout / "blobs" / algorithm / digest).read_text())
    return doc


@dataclass(frozen=True)
class ImageRoot:
    rootfs: Path
    config: ImageConfig

    @classmethod
    def load(cls, export: Path) -> ImageRoot:
        """The export's root and the config of the one image in its OCI layout."""
        layout = export / "oci"
        (manifest,) = json.loads((layout / "index.json").read_text())["manifests"]
        config = _blob(layout, _blob(layout, manifest)["config"])
        return cls(export / "rootfs", ImageConfig.from_oci(config))

    def user(self, container: Mapping[str, Any], pod_spec: Mapping[str, Any]) -> tuple[int, int]:
        """``(uid, gid)`` as the kubelet resolves them: securityContext first, then the image.

        Only numeric users: a name would need the image's /etc/passwd, and a
        ``runAsNonRoot`` kubelet refuses a named user for the same reason."""
        pod = pod_spec.get("securityContext") or {}
        own = container.get("securityContext") or {}
        image_uid, _, image_gid = self.config.user.partition(":")
        uid = own.get("runAsUser", pod.get("runAsUser", image_uid or 0))
        gid = own.get("runAsGroup", pod.get("runAsGroup", image_gid or 0))
        if not (str(uid).isdigit() and str(gid).isdigit()):
            raise SpecError(f"container {container.get('name')!r}: user {uid}:{gid} is not numeric")
        if int(uid) == 0 and own.get("runAsNonRoot", pod.get("runAsNonRoot", False)):
            raise SpecError(
                f"container {container.get('name')!r} has runAsNonRoot and its image runs as root"
            )
        return int(uid), int(gid)


@dataclass(frozen=True)
class RootSpec:
    """What the launcher needs to start one container from an image root."""

    image: Path
    scratch: Path  # the overlay's upper and work directories, per container
    read_only: bool
    uid: int
    gid: int
    no_new_privileges: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "image": str(self.image),
            "scratch": str(self.scratch),
            "readOnly": self.read_only,
            "uid": self.uid,
            "gid": self.gid,
            "noNewPrivileges": self.no_new_privileges,
        }
