"""A pod's status as the kubelet reports it, from what the pod runner knows.

Pure functions: the pod spec and the runner's container states in, the
``status`` stanza of a strategic-merge patch out. The phase is Pending until
every init container has finished (or, a native sidecar, started) and the main
containers run; Running while any main container runs; then Succeeded when every
main container exited 0, Failed otherwise. Container restarts
(``restartPolicy: OnFailure``/``Always`` for main containers) are not done by
the pod runner: a container that exits stays exited, which is what a pod being
deleted, the case jitckpt cares about, does on a real node too.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from local.podrunner.container import ContainerStatus
from local.podrunner.pod import ContainerState, PodResult


def rfc3339(at: float | None) -> str | None:
    if at is None:
        return None
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _terminated(status: ContainerStatus) -> dict[str, Any]:
    terminated: dict[str, Any] = {
        "exitCode": status.exit_code,
        "reason": status.reason,
        "startedAt": rfc3339(status.started_at),
        "finishedAt": rfc3339(status.finished_at),
    }
    if status.message:
        terminated["message"] = status.message
    return terminated


def _entry(
    spec: Mapping[str, Any], state: ContainerState | None, waiting: str, uid: str
) -> dict[str, Any]:
    name = str(spec["name"])
    entry: dict[str, Any] = {
        "name": name,
        "image": spec.get("image", ""),
        "imageID": "",
        "restartCount": 0,
        "ready": False,
        "started": False,
    }
    if state is None:
        entry["state"] = {"waiting": {"reason": waiting}}
        return entry
    entry["containerID"] = f"podrunner://{uid}/{name}"
    if state.running:
        entry["state"] = {"running": {"startedAt": rfc3339(state.status.started_at)}}
        entry["started"] = entry["ready"] = state.started
    else:
        entry["state"] = {"terminated": _terminated(state.status)}
    return entry


def _condition(kind: str, ok: bool, reason: str = "") -> dict[str, Any]:
    condition: dict[str, Any] = {"type": kind, "status": "True" if ok else "False"}
    if reason and not ok:
        condition["reason"] = reason
    return condition


def running_status(
    manifest: Mapping[str, Any],
    states: Mapping[str, ContainerState],
    pod_ip: str,
    started_at: float,
) -> dict[str, Any]:
    """The status of a pod whose lifecycle is under way."""
    spec = manifest.get("spec") or {}
    uid = str((manifest.get("metadata") or {}).get("uid", ""))
    init_specs = spec.get("initContainers") or []
    main_specs = spec.get("containers") or []
    mains = [states.get(str(c["name"])) for c in main_specs]
    initialized = all(s is not None for s in mains) or all(
        (s := states.get(str(c["name"]))) is not None
        and (s.started if c.get("restartPolicy") == "Always" else not s.running)
        for c in init_specs
    )
    running = any(s is not None and s.running for s in mains)
    ready = bool(mains) and all(s is not None and s.running for s in mains)
    waiting = "ContainerCreating" if initialized else "PodInitializing"
    return {
        "phase": "Running" if running else "Pending",
        "hostIP": "127.0.0.1",
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": rfc3339(started_at),
        "conditions": [
            _condition("PodReadyToStartContainers", True),
            _condition("Initialized", initialized, "ContainersNotInitialized"),
            _condition("ContainersReady", ready, "ContainersNotReady"),
            _condition("Ready", ready, "ContainersNotReady"),
        ],
        "initContainerStatuses": [
            _entry(c, states.get(str(c["name"])), "PodInitializing", uid) for c in init_specs
        ],
        "containerStatuses": [
            _entry(c, states.get(str(c["name"])), waiting, uid) for c in main_specs
        ],
    }


def final_status(manifest: Mapping[str, Any], result: PodResult) -> dict[str, Any]:
    """The status of a pod whose containers are all gone: its terminal phase, each
    container's exit code and termination message."""
    spec = manifest.get("spec") or {}
    uid = str((manifest.get("metadata") or {}).get("uid", ""))

    def ended(name: str) -> ContainerState | None:
        status = result.status(name)
        return ContainerState(status, running=False, started=False) if status else None

    return {
        "phase": result.phase,
        "hostIP": "127.0.0.1",
        "podIP": result.ip,
        "podIPs": [{"ip": result.ip}],
        "startTime": rfc3339(result.started_at),
        "conditions": [
            _condition("PodReadyToStartContainers", False, "PodCompleted"),
            _condition("ContainersReady", False, "PodCompleted"),
            _condition("Ready", False, "PodCompleted"),
        ],
        "initContainerStatuses": [
            _entry(c, ended(str(c["name"])), "PodInitializing", uid)
            for c in spec.get("initContainers") or []
        ],
        "containerStatuses": [
            _entry(c, ended(str(c["name"])), "ContainerCreating", uid)
            for c in spec.get("containers") or []
        ],
    }


def waiting_status(manifest: Mapping[str, Any], reason: str, message: str) -> dict[str, Any]:
    """A pod that cannot start yet (a Secret it names does not exist): Pending, each
    container waiting with why, as the kubelet's CreateContainerConfigError."""
    spec = manifest.get("spec") or {}

    def waiting(c: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "name": c["name"],
            "image": c.get("image", ""),
            "imageID": "",
            "restartCount": 0,
            "ready": False,
            "started": False,
            "state": {"waiting": {"reason": reason, "message": message}},
        }

    return {
        "phase": "Pending",
        "hostIP": "127.0.0.1",
        "conditions": [_condition("Ready", False, "ContainersNotReady")],
        "initContainerStatuses": [waiting(c) for c in spec.get("initContainers") or []],
        "containerStatuses": [waiting(c) for c in spec.get("containers") or []],
    }
