"""The ``jitckpt.io/status`` annotation: what one injection added, and how to take it out.

The webhook records every name it added (containers, volumes, env), the grace
period it changed, the configuration it used and the digest of its patch.
With that record an injected pod can be turned back into the pod that was
admitted (``strip``), which is how the injection is re-derived: to stay
idempotent, and for ``jitckpt audit`` to tell drift from a clean injection.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from shim import layout
from webhook.settings import REASON_KEY, STATUS_KEY

AGENT = layout.AGENT_CONTAINER  # the sidecar (native) or the legacy run container
RESTORE = "jitckpt-restore"  # the legacy restore init container
VOL_LOCAL = "jitckpt-local"
VOL_RUN = "jitckpt-run"
VOL_SHIM = "jitckpt-shim"
VOL_PVC = "jitckpt-pvc"
VOL_SECRET = "jitckpt-s3-secret"
OUR_CONTAINERS = (AGENT, RESTORE)
OUR_VOLUMES = (VOL_LOCAL, VOL_RUN, VOL_SHIM, VOL_PVC, VOL_SECRET)


class InjectionStatus(BaseModel):
    """The JSON of the status annotation; parsing checks every field's type."""

    version: str
    mode: str
    jobKind: str
    jobName: str
    destination: str  # the job root
    initContainers: list[str] = Field(default_factory=list)
    containers: list[str] = Field(default_factory=list)
    volumes: list[str] = Field(default_factory=list)
    env: dict[str, list[str]] = Field(default_factory=dict)  # container -> names added
    prependedEnv: dict[str, list[str]] = Field(default_factory=dict)  # names edited in place
    preStop: list[str] = Field(default_factory=list)  # containers whose hook was added
    gracePeriod: dict[str, int | None] = Field(default_factory=dict)  # {"from", "to"}
    config: dict[str, str] = Field(default_factory=dict)  # settings used + injector config
    configSources: dict[str, str] = Field(default_factory=dict)
    patchSha256: str = ""

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> InjectionStatus:
        """Parse the annotation; ValueError when it is not a status this version wrote."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise ValueError(f"{STATUS_KEY} is unreadable: {where}: {first['msg']}") from None


def read_status(pod: dict[str, Any]) -> InjectionStatus | None:
    """The pod's status record, None when it has none; ValueError when unreadable."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    text = annotations.get(STATUS_KEY)
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"{STATUS_KEY} is not a string")
    return InjectionStatus.from_json(text)


def looks_injected(pod: dict[str, Any]) -> bool:
    """A status annotation or any container named like ours."""
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if isinstance(annotations, dict) and STATUS_KEY in annotations:
        return True
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return False
    for key in ("containers", "initContainers"):
        containers = spec.get(key)
        for container in containers if isinstance(containers, list) else []:
            if isinstance(container, dict) and container.get("name") in OUR_CONTAINERS:
                return True
    return False


def _drop_named(holder: dict[str, Any], key: str, names: list[str]) -> None:
    items = holder.get(key)
    if not isinstance(items, list):
        return
    kept = [i for i in items if not (isinstance(i, dict) and i.get("name") in names)]
    if kept:
        holder[key] = kept
    else:
        holder.pop(key, None)


def strip(pod: dict[str, Any], status: InjectionStatus) -> dict[str, Any]:
    """The pod as it was before the injection ``status`` describes.

    A new pod that copies only what it takes out and shares the rest with ``pod``.
    """
    original = {**pod}
    spec = original["spec"] = {**original.get("spec", {})}
    _drop_named(spec, "initContainers", status.initContainers)
    _drop_named(spec, "containers", status.containers)
    _drop_named(spec, "volumes", status.volumes)
    if isinstance(spec.get("containers"), list):
        spec["containers"] = [{**c} for c in spec["containers"]]
    for container in spec.get("containers") or []:
        name = container.get("name")
        _drop_named(container, "volumeMounts", status.volumes)
        _drop_named(container, "env", status.env.get(name, []))
        prepended = status.prependedEnv.get(name, [])
        if prepended and isinstance(container.get("env"), list):
            container["env"] = [
                _unprepend(e) if e.get("name") in prepended else e for e in container["env"]
            ]
        if name in status.preStop:
            lifecycle = {**(container.get("lifecycle") or {})}
            lifecycle.pop("preStop", None)
            if lifecycle:
                container["lifecycle"] = lifecycle
            else:
                container.pop("lifecycle", None)
    before = status.gracePeriod.get("from")
    if "to" in status.gracePeriod:
        if before is None:
            spec.pop("terminationGracePeriodSeconds", None)
        else:
            spec["terminationGracePeriodSeconds"] = before
    metadata = original["metadata"] = {**original.get("metadata", {})}
    if isinstance(metadata.get("annotations"), dict):
        metadata["annotations"] = {**metadata["annotations"]}
    drop_status_annotation(original)
    return original


def _unprepend(entry: dict[str, Any]) -> dict[str, Any]:
    """A copy of the env ``entry`` without the shim's directory in front of its value."""
    value = str(entry.get("value", ""))
    return {**entry, "value": value.removeprefix(layout.SHIM_DIR + ":")}


def drop_status_annotation(pod: dict[str, Any]) -> None:
    """Remove the webhook's annotations (status, reason) in place, and ``annotations`` if
    nothing else was in it."""
    metadata = pod.setdefault("metadata", {})
    annotations = metadata.get("annotations") or {}
    annotations.pop(STATUS_KEY, None)
    annotations.pop(REASON_KEY, None)
    if annotations:
        metadata["annotations"] = annotations
    else:
        metadata.pop("annotations", None)
