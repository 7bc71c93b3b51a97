"""Whether the trainer of a pod could reach what the webhook injects (DESIGN 3 and 7).

The sidecar holds the store's credentials and keeps its own records (accepted
checkpoints, what it restored) on a volume the trainer mounts read-only. The
trainer is untrusted code. A pod is injected only if nothing in its own spec
lets the trainer, or any other container of the pod, reach the sidecar's
processes, its volumes or its records. ``exposure`` names the first way it
could, or None:

- host namespaces: ``hostPID`` (the sidecar's ``/proc/<pid>/environ`` seen from
  the node's PID namespace), ``hostIPC`` (the node's shared memory and the
  Pod Security "baseline" forbids it for the same reason), ``hostNetwork``
  and ``shareProcessNamespace`` (decided in ``mutate``, with their own reasons);
- a container running ``privileged``: it can mount the node's disks, where
  every volume of the pod lives;
- a ``hostPath`` volume at or above the node's pod, runtime or process
  directories (``/``, ``/var``, ``/var/lib/kubelet/...``, ``/proc``, the
  container runtime's state and socket): the sidecar's emptyDirs, its process
  and an exec into it are all reachable from there;
- a volume of the pod named like one the webhook adds, or a volume mount or
  device of any container naming one (the API server resolves a mount by
  volume name once the webhook added the volume, so a trainer listing
  ``jitckpt-shim`` would get the sidecar's record volume, writable).
"""

from __future__ import annotations

import posixpath
from typing import Any

from webhook.status import OUR_VOLUMES

# Node paths whose contents reach another container of the pod: kubelet's pod
# directories (every emptyDir), the host's processes, the container runtimes.
NODE_PATHS = (
    "/proc",
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/containers",
    "/run/containerd",
    "/var/run/containerd",
    "/run/crio",
    "/var/run/crio",
    "/run/docker.sock",
    "/var/run/docker.sock",
    "/run/k3s",
)
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _reaches_node(path: str) -> bool:
    """A hostPath at ``path`` contains, or is inside, a node directory of NODE_PATHS."""
    normal = posixpath.normpath("/" + path.strip())
    normal = "/" + normal.lstrip("/")  # normpath keeps a leading "//"
    return any(_within(top, normal) or _within(normal, top) for top in NODE_PATHS)


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for key in CONTAINER_LISTS:
        items = spec.get(key)
        if isinstance(items, list):
            found += [c for c in items if isinstance(c, dict)]
    return found


def _named(items: Any) -> list[dict[str, Any]]:
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def exposure(pod: dict[str, Any]) -> str | None:
    """How the pod's own spec would let its containers reach the injected sidecar, or None."""
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return None
    if spec.get("hostPID") is True:
        return (
            "the pod uses hostPID: the sidecar's environment (the store's credentials) "
            "would be readable through /proc from the node's PID namespace"
        )
    if spec.get("hostIPC") is True:
        return (
            "the pod uses hostIPC: it would share the node's IPC namespace (Pod Security "
            "baseline forbids it)"
        )
    for volume in _named(spec.get("volumes")):
        name = volume.get("name")
        if name in OUR_VOLUMES:
            return f"the pod already has a volume {name!r} named like jitckpt's own"
        host = volume.get("hostPath")
        path = host.get("path") if isinstance(host, dict) else None
        if isinstance(path, str) and _reaches_node(path):
            return (
                f"volume {name!r} mounts the node's {path} (hostPath), which holds the "
                "sidecar's volumes or processes"
            )
    for container in _containers(spec):
        who = container.get("name")
        for key in ("volumeMounts", "volumeDevices"):
            for mount in _named(container.get(key)):
                if mount.get("name") in OUR_VOLUMES:
                    return (
                        f"container {who!r} already mounts a volume named {mount['name']!r}, "
                        "like jitckpt's own: it would get the sidecar's volume"
                    )
        context = container.get("securityContext")
        if isinstance(context, dict) and context.get("privileged") is True:
            return (
                f"container {who!r} is privileged: it could reach the sidecar's volumes "
                "through the node's disks"
            )
    return None
