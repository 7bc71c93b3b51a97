"""Audit of one pod: is it injected, by what, and has it drifted?

Drift is found by re-deriving the injection. The status annotation names
everything that was added, so ``strip`` gives back the admitted pod; then

- ``config``: the current configuration would inject something else (the
  digest of the spec patch it would make differs from the recorded one);
- ``edited``: the injected parts differ from what the recorded configuration
  injects (someone changed the sidecar, a volume, the trainer's env...);
- ``missing``: not injected, but the current configuration would inject it;
- ``sidecar``: a jitckpt container or volume is not what the webhook would
  inject now (image, command, args, env, Secret references, mounts, security
  context; the volumes' sources). The annotation is the pod's own claim, so
  it is only used to take the injection out again: what the containers run
  and reach is compared with the injection the webhook would make now, and a
  jitckpt-named container or volume the webhook would not make at all is
  drift too. The Secret shown is the one the jitckpt containers reference.

Comparisons of injected parts ignore fields the API server adds by default
and compare resource quantities by value, so ``kubectl get -o yaml`` output
is audited correctly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from webhook import identity, jobs
from webhook import patch as patches
from webhook.config import WebhookConfig
from webhook.injection import CONFIG_FIELDS, build
from webhook.mutate import MutationResult, NamespaceInfo, mutate
from webhook.settings import PREFIX, REASON_KEY, SOURCE_NAMESPACE, parse_quantity
from webhook.status import (
    OUR_VOLUMES,
    InjectionStatus,
    looks_injected,
    read_status,
    strip,
)

# What a jitckpt container runs and reaches: compared both ways with the webhook's own.
SIDECAR_FIELDS = (
    "image",
    "command",
    "args",
    "env",
    "envFrom",
    "volumeMounts",
    "volumeDevices",
    "securityContext",
    "restartPolicy",
)
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
OUR_PREFIX = "jitckpt-"


def _ours(pod: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Every container of ``pod`` named like jitckpt's, by (list, name)."""
    spec = pod.get("spec") or {}
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for key in CONTAINER_LISTS:
        for item in spec.get(key) or []:
            name = item.get("name") if isinstance(item, dict) else None
            if isinstance(name, str) and name.startswith(OUR_PREFIX):
                found[(key, name)] = item
    return found


def _both_ways(want: Any, have: Any, path: str) -> list[str]:
    """Where ``have`` and ``want`` differ, an addition in ``have`` included."""
    return differences(want, have, path) or differences(have, want, path)


def sidecar_drift(expected: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """How the jitckpt containers and volumes of ``live`` differ from ``expected``'s (the
    pod as the webhook would inject it now)."""
    out: list[str] = []
    wanted = _ours(expected)
    for (key, name), have in _ours(live).items():
        want = wanted.get((key, name))
        if want is None:
            out.append(f"{key}/{name} is not a container the webhook injects")
            continue
        for field_name in SIDECAR_FIELDS:
            if _both_ways(want.get(field_name), have.get(field_name), field_name):
                shown = str(have.get(field_name))[:120]
                out.append(f"{key}/{name}: {field_name} is not what the webhook injects ({shown})")
    volumes = {_at(v, "name"): v for v in _items(_at(expected, "spec", "volumes"))}
    for have in _items(_at(live, "spec", "volumes")):
        volume = _at(have, "name")
        ours = isinstance(volume, str) and (volume in OUR_VOLUMES or volume.startswith(OUR_PREFIX))
        if ours and _both_ways(volumes.get(volume), have, "volume"):
            out.append(f"volumes/{volume} is not the volume the webhook injects")
    return out


def _at(node: Any, *keys: str) -> Any:
    """``node[k1][k2]...`` where each level is a mapping, else None."""
    for key in keys:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _items(node: Any) -> list[Any]:
    return node if isinstance(node, list) else []


def referenced_secrets(pod: dict[str, Any]) -> list[str]:
    """The Secrets the jitckpt containers of ``pod`` reference (env, envFrom, volumes)."""
    names: list[object] = []
    mounted: set[object] = set()
    for container in _ours(pod).values():
        names += [_at(s, "secretRef", "name") for s in _items(container.get("envFrom"))]
        names += [_at(e, "valueFrom", "secretKeyRef", "name") for e in _items(container.get("env"))]
        mounted |= {_at(m, "name") for m in _items(container.get("volumeMounts"))}
    for volume in _items(_at(pod, "spec", "volumes")):
        if _at(volume, "name") in mounted:
            names.append(_at(volume, "secret", "secretName"))
            names += [_at(i, "secret", "name") for i in _items(_at(volume, "projected", "sources"))]
    return list(dict.fromkeys(n for n in names if isinstance(n, str)))


@dataclass
class PodAudit:
    """One row of ``jitckpt audit``."""

    namespace: str
    pod: str
    injected: bool
    version: str = ""
    mode: str = ""
    destination: str = ""
    secret: str = ""
    grace_period_seconds: int | None = None
    drift: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Why the pod is not (or may not be) protected: its jitckpt.io/reason mark, what the
    # current configuration says of an unmarked pod it would not inject, or the sidecar's
    # own word (a terminated sidecar that ran unprotected); "" when nothing says so.
    reason: str = ""


def sidecar_unprotected(pod: dict[str, Any]) -> str:
    """The reason a jitckpt sidecar of ``pod`` gave for running unprotected, from the
    termination message the kubelet keeps in the pod's status (once it terminated)."""
    status = pod.get("status") or {}
    for key in ("initContainerStatuses", "containerStatuses"):
        for entry in _items(status.get(key)):
            if not (isinstance(entry, dict) and str(entry.get("name", "")).startswith(OUR_PREFIX)):
                continue
            for state in ("state", "lastState"):
                message = _at(entry, state, "terminated", "message")
                if isinstance(message, str) and '"unprotected":true' in message.replace(" ", ""):
                    try:
                        text = json.loads(message).get("message", "")
                    except (ValueError, AttributeError):
                        continue
                    return str(text)
    return ""


def differences(expected: Any, live: Any, path: str) -> list[str]:
    """Paths where ``live`` lacks or changes what ``expected`` has (extra keys are fine)."""
    if isinstance(expected, dict):
        if not isinstance(live, dict):
            return [path]
        out: list[str] = []
        for key, value in expected.items():
            if key not in live:
                out.append(f"{path}.{key}")
            else:
                out += differences(value, live[key], f"{path}.{key}")
        return out
    if isinstance(expected, list):
        if not isinstance(live, list) or len(live) != len(expected):
            return [path]
        out = []
        for i, (want, have) in enumerate(zip(expected, live, strict=True)):
            out += differences(want, have, f"{path}[{i}]")
        return out
    if expected == live:
        return []
    if isinstance(expected, str) and isinstance(live, str):
        want_q, have_q = parse_quantity(expected), parse_quantity(live)
        if want_q is not None and want_q == have_q:
            return []  # the API server rewrites "0.5" as "500m"
    return [path]


def _named(items: Any, name: str) -> Any:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            return item
    return None


def _edited(expected: dict[str, Any], live: dict[str, Any], status: InjectionStatus) -> list[str]:
    """What of the recorded injection no longer looks as it was injected."""
    out: list[str] = []
    for key, names in (
        ("initContainers", status.initContainers),
        ("containers", status.containers + list(status.env)),
        ("volumes", status.volumes),
    ):
        for name in dict.fromkeys(names):
            want = _named(expected["spec"].get(key), name)
            have = _named(live["spec"].get(key), name)
            if have is None:
                out.append(f"{key}/{name} removed")
            elif differences(want, have, f"{key}/{name}"):
                out.append(f"{key}/{name} changed")
    grace = live["spec"].get("terminationGracePeriodSeconds")
    if "to" in status.gracePeriod and grace != status.gracePeriod["to"]:
        out.append("terminationGracePeriodSeconds changed")
    return out


def _recorded_config(config: WebhookConfig, status: InjectionStatus) -> WebhookConfig:
    update = {
        attr: status.config[key] for key, attr in CONFIG_FIELDS.items() if key in status.config
    }
    return WebhookConfig.model_validate({**config.model_dump(), "defaults": {}, **update})


def _assumed_namespace(name: str, status: InjectionStatus) -> NamespaceInfo:
    """The namespace's settings as recorded, for input without its Namespace document."""
    annotations = {
        PREFIX + key: value
        for key, value in status.config.items()
        if status.configSources.get(key) == SOURCE_NAMESPACE
    }
    return NamespaceInfo(name=name, labels={}, annotations=annotations)


def _recorded_drift(
    pod: dict[str, Any],
    original: dict[str, Any],
    *,
    trainer: jobs.TrainerPod,
    status: InjectionStatus,
    namespace: NamespaceInfo,
    config: WebhookConfig,
) -> tuple[list[tuple[str, str]], MutationResult]:
    """``edited`` and ``config`` drift of ``pod`` (``original`` once stripped), with notes,
    and the injection the current configuration makes of ``original``."""
    settings_used = {k: v for k, v in status.config.items() if k not in CONFIG_FIELDS}
    expected = build(
        original,
        trainer,
        values=settings_used,
        sources=status.configSources,
        namespace=namespace.name,
        config=_recorded_config(config, status),
    )
    found = [("edited", note) for note in _edited(expected.pod, pod, status)]
    current = mutate(original, namespace, config, require_opt_in=False)
    if not current.injected:
        found.append(
            ("config", f"the current configuration would not inject it: {current.message}")
        )
    elif patches.spec_digest(original, current.pod) != status.patchSha256:
        found.append(("config", "the current configuration would inject it differently"))
    return found, current


def _identity_added_later(
    pod: dict[str, Any], status: InjectionStatus, namespace: NamespaceInfo, config: WebhookConfig
) -> str | None:
    """The kind of workload identity a webhook called after this one gave every container,
    when the pod without it is exactly what this webhook injected; else None."""
    undone = identity.undo_later(pod, {*status.initContainers, *status.containers})
    if undone is None:
        return None
    earlier, kind = undone
    original = strip(earlier, status)
    trainer = jobs.detect(original)
    if not isinstance(trainer, jobs.TrainerPod):
        return None
    found, _ = _recorded_drift(
        earlier, original, trainer=trainer, status=status, namespace=namespace, config=config
    )
    return None if found else kind


def audit_pod(
    pod: dict[str, Any], namespace: NamespaceInfo | None, config: WebhookConfig
) -> PodAudit:
    """Audit ``pod``; ``namespace`` is None when the input did not describe it."""
    meta = pod.get("metadata") or {}
    ns_name = namespace.name if namespace else (meta.get("namespace") or "default")
    name = meta.get("name") or f"{meta.get('generateName') or ''}*"
    spec = pod.get("spec") or {}
    row = PodAudit(ns_name, name, looks_injected(pod))
    row.grace_period_seconds = spec.get("terminationGracePeriodSeconds")
    mark = (meta.get("annotations") or {}).get(REASON_KEY)
    row.reason = mark if isinstance(mark, str) else ""
    if not row.injected:
        if namespace is not None:
            result = mutate(pod, namespace, config, require_opt_in=True)
            if result.injected:
                row.drift.append("missing")
                row.notes.append("the current configuration would inject this pod")
            elif not row.reason and result.skip_reason is not None:
                row.reason = f"{result.skip_reason}: {result.message}"
        return row
    row.reason = sidecar_unprotected(pod) or row.reason
    try:
        status = read_status(pod)
    except ValueError as exc:
        row.drift.append("unverifiable")
        row.notes.append(str(exc))
        return row
    if status is None:
        row.drift.append("unverifiable")
        row.notes.append("a jitckpt container without the jitckpt.io/status annotation")
        return row
    row.version, row.mode, row.destination = status.version, status.mode, status.destination
    row.secret = ",".join(referenced_secrets(pod))
    original = strip(pod, status)
    trainer = jobs.detect(original)
    if isinstance(trainer, jobs.NotTrainer):
        row.drift.append("edited")
        row.notes.append(f"no longer a trainer pod once stripped: {trainer.message}")
        return row
    if isinstance(trainer, jobs.UnknownNodes):
        row.drift.append("config")
        row.notes.append(f"the current rules would not inject it: {trainer.message}")
        return row

    if namespace is None:
        namespace = _assumed_namespace(ns_name, status)
        row.notes.append(f"namespace {ns_name} not in the input: its recorded settings assumed")
    found, current = _recorded_drift(
        pod, original, trainer=trainer, status=status, namespace=namespace, config=config
    )
    if found:
        later = _identity_added_later(pod, status, namespace, config)
        if later is not None:
            found = []
            row.notes.append(
                f"workload identity ({later}) added to every container by a webhook after jitckpt's"
            )
    for kind, note in found:
        if kind not in row.drift:
            row.drift.append(kind)
        row.notes.append(note)
    if current.injected:
        unlike = sidecar_drift(current.pod, pod)
        if unlike:
            row.drift.append("sidecar")
            row.notes += unlike
    return row
