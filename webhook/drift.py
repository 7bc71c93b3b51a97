"""Audit of one pod: is it injected, by what, and has it drifted?

Drift is found by re-deriving the injection. The status annotation names
everything that was added, so ``strip`` gives back the admitted pod; then

- ``config``: the current configuration would inject something else (the
  digest of the spec patch it would make differs from the recorded one);
- ``edited``: the injected parts differ from what the recorded configuration
  injects (someone changed the sidecar, a volume, the trainer's env...);
- ``missing``: not injected, but the current configuration would inject it.

Comparisons of injected parts ignore fields the API server adds by default
and compare resource quantities by value, so ``kubectl get -o yaml`` output
is audited correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from webhook import jobs
from webhook import patch as patches
from webhook.config import WebhookConfig
from webhook.injection import CONFIG_FIELDS, build
from webhook.mutate import NamespaceInfo, mutate
from webhook.settings import PREFIX, SOURCE_NAMESPACE, parse_quantity
from webhook.status import (
    InjectionStatus,
    looks_injected,
    read_status,
    strip,
)


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
    if not row.injected:
        if namespace is not None:
            result = mutate(pod, namespace, config, require_opt_in=True)
            if result.injected:
                row.drift.append("missing")
                row.notes.append("the current configuration would inject this pod")
        return row
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
    row.secret = status.config.get("s3-secret", "")
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

    settings_used = {k: v for k, v in status.config.items() if k not in CONFIG_FIELDS}
    expected = build(
        original,
        trainer,
        values=settings_used,
        sources=status.configSources,
        namespace=ns_name,
        config=_recorded_config(config, status),
    )
    edited = _edited(expected.pod, pod, status)
    if edited:
        row.drift.append("edited")
        row.notes += edited

    if namespace is None:
        namespace = _assumed_namespace(ns_name, status)
        row.notes.append(f"namespace {ns_name} not in the input: its recorded settings assumed")
    current = mutate(original, namespace, config, require_opt_in=False)
    if not current.injected:
        row.drift.append("config")
        row.notes.append(f"the current configuration would not inject it: {current.message}")
    elif patches.spec_digest(original, current.pod) != status.patchSha256:
        row.drift.append("config")
        row.notes.append("the current configuration would inject it differently")
    return row
