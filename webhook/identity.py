"""The pod's own AWS workload identity, found on the trainer and given to the sidecar.

On EKS another webhook (IRSA's pod-identity-webhook, or the EKS Pod Identity
agent's) puts the pod's role into every container as env plus a projected
token mount. When it ran before this webhook, the trainer carries it and the
sidecar, added after, would not: it would fall back to the node's instance
role, a different and usually broader identity. So the sidecar gets the same
env and the token's mount, read-only. When that webhook runs after this one it
adds itself to the sidecar as well; either order ends with the same identity.
"""

from __future__ import annotations

import copy
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# IRSA (AssumeRoleWithWebIdentity with the pod's projected service-account token).
IRSA_ROLE = "AWS_ROLE_ARN"
IRSA_TOKEN_FILE = "AWS_WEB_IDENTITY_TOKEN_FILE"
# EKS Pod Identity (the node-local credentials endpoint, authorized by a projected token).
POD_IDENTITY_URI = "AWS_CONTAINER_CREDENTIALS_FULL_URI"
POD_IDENTITY_TOKEN_FILE = "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"
# Set by those webhooks next to the above; they shape how the identity is used.
COMPANIONS = ("AWS_ROLE_SESSION_NAME", "AWS_STS_REGIONAL_ENDPOINTS", "AWS_REGION")
KINDS = {"irsa": (IRSA_ROLE, IRSA_TOKEN_FILE), "eks-pod-identity": (POD_IDENTITY_URI,)}
TOKEN_FILES = {"irsa": IRSA_TOKEN_FILE, "eks-pod-identity": POD_IDENTITY_TOKEN_FILE}


@dataclass(frozen=True)
class WorkloadIdentity:
    """What to copy into the sidecar: env entries and read-only token mounts."""

    kind: str  # "irsa" or "eks-pod-identity"
    env: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)


def _env_by_name(container: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    entries = container.get("env") or []
    return {e["name"]: e for e in entries if isinstance(e, dict) and isinstance(e.get("name"), str)}


def _token_mount(container: Mapping[str, Any], path: str) -> dict[str, Any] | None:
    """The trainer's mount that holds the token file ``path`` (the deepest), read-only."""
    best: dict[str, Any] | None = None
    for mount in container.get("volumeMounts") or []:
        if not isinstance(mount, dict) or not isinstance(mount.get("mountPath"), str):
            continue
        root = posixpath.normpath(mount["mountPath"])
        inside = path == root or path.startswith(root.rstrip("/") + "/")
        if inside and (best is None or len(root) > len(posixpath.normpath(best["mountPath"]))):
            best = mount
    if best is None:
        return None
    return {**copy.deepcopy(best), "readOnly": True}


def find(container: Mapping[str, Any]) -> WorkloadIdentity | None:
    """The workload identity the trainer ``container`` carries, or None."""
    env = _env_by_name(container)
    for kind, required in KINDS.items():
        if not all(name in env for name in required):
            continue
        # In the trainer's order: the identity webhook gives every container the same list,
        # so a sidecar it reached itself looks the same (no drift for `jitckpt audit`).
        names = {*required, TOKEN_FILES[kind], *COMPANIONS, "AWS_DEFAULT_REGION"}
        copied = [copy.deepcopy(e) for n, e in env.items() if n in names]
        token = env.get(TOKEN_FILES[kind], {}).get("value")
        mounts: list[dict[str, Any]] = []
        warnings: list[str] = []
        if isinstance(token, str) and token:
            mount = _token_mount(container, posixpath.normpath(token))
            if mount is None:
                warnings.append(
                    f"the {kind} token file {token} is on no volume of container "
                    f"{container.get('name')!r}: the sidecar cannot read it"
                )
            else:
                mounts.append(mount)
        return WorkloadIdentity(kind, copied, mounts, warnings)
    return None


def undo_later(pod: Mapping[str, Any], ours: set[str]) -> tuple[dict[str, Any], str] | None:
    """``pod`` as it was before an identity webhook that ran after this one, and its kind;
    None when nothing says one did.

    Webhooks are called in the order of their configurations' names, so on EKS IRSA's
    usually runs after this one: it gives every container, the sidecars ``ours`` included,
    the same identity env and token mount, and adds the token's volume. Taken out of every
    container (only entries equal to the sidecar's), the pod is the one this webhook
    returned, which ``jitckpt audit`` can check against its record.
    """
    spec = pod.get("spec") or {}
    containers = [
        c
        for key in ("initContainers", "containers")
        for c in spec.get(key) or []
        if isinstance(c, dict)
    ]
    sidecars = [c for c in containers if c.get("name") in ours]
    found = [identity for c in sidecars if (identity := find(c)) is not None]
    if not found or len(found) < len(sidecars) or any(f.kind != found[0].kind for f in found):
        return None
    first = found[0]
    env = {e["name"]: e for e in first.env}  # only the identity's names (``find``)
    mount = first.mounts[0] if first.mounts else None
    out = copy.deepcopy(dict(pod))
    for key in ("initContainers", "containers"):
        for container in out["spec"].get(key) or []:
            if not isinstance(container, dict):
                continue
            entries = container.get("env") or []
            kept = [e for e in entries if not (isinstance(e, dict) and env.get(e.get("name")) == e)]
            if kept:
                container["env"] = kept
            else:
                container.pop("env", None)
            if mount is not None:
                mounts = [
                    m
                    for m in container.get("volumeMounts") or []
                    if not (
                        isinstance(m, dict)
                        and m.get("name") == mount.get("name")
                        and m.get("mountPath") == mount.get("mountPath")
                    )
                ]
                if mounts:
                    container["volumeMounts"] = mounts
                else:
                    container.pop("volumeMounts", None)
    if mount is not None:
        out["spec"]["volumes"] = [
            v for v in out["spec"].get("volumes") or [] if v.get("name") != mount.get("name")
        ]
    return out, first.kind
