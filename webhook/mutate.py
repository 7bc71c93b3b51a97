"""The mutation core: one pure function shared by the admission server and the CLI.

``mutate`` decides whether a pod gets the checkpoint sidecar, and if so builds
the injected pod and the RFC 6902 patch by diff. It does no I/O: the caller
supplies the namespace's labels and annotations and the configuration. Every
pod that is not injected comes back unchanged with a reason (a metric label)
and one sentence saying why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from webhook import identity, isolation, jobs, settings
from webhook import patch as patches
from webhook.config import VERSION, WebhookConfig
from webhook.injection import NO_CREDENTIALS, build
from webhook.status import OUR_CONTAINERS, looks_injected

SYSTEM_NAMESPACES = ("kube-system",)

SKIP_NOT_TRAINER = "not-trainer"
SKIP_OPTED_OUT = "opted-out"
SKIP_NO_DESTINATION = "no-destination"
SKIP_HOST_NETWORK = "host-network"
SKIP_SHARED_PROCESSES = "shared-process-namespace"
SKIP_EXPOSED = "exposes-sidecar"
SKIP_UNKNOWN_NODES = "unknown-nodes"
SKIP_SYSTEM_NAMESPACE = "system-namespace"
SKIP_NOT_OPTED_IN = "not-opted-in"
SKIP_INVALID_SETTING = "invalid-setting"
SKIP_ALREADY_INJECTED = "already-injected"
SKIP_REASONS = (
    SKIP_NOT_TRAINER,
    SKIP_OPTED_OUT,
    SKIP_NO_DESTINATION,
    SKIP_HOST_NETWORK,
    SKIP_SHARED_PROCESSES,
    SKIP_EXPOSED,
    SKIP_UNKNOWN_NODES,
    SKIP_SYSTEM_NAMESPACE,
    SKIP_NOT_OPTED_IN,
    SKIP_INVALID_SETTING,
    SKIP_ALREADY_INJECTED,
)
# Skips the admission server decides before mutating (also ``skipped{reason}`` labels).
SKIP_NOT_CREATE = "not-create"
SKIP_NAMESPACE_UNKNOWN = "namespace-unknown"
# Skips that leave the pod exactly as it came, without the reason annotation: a pod that
# is no trainer (a TrainJob's initializers, any other pod) is not the webhook's to touch,
# an injected one (reinvoked) carries its status instead, and the webhook never writes
# into a system namespace.
UNMARKED_SKIPS = frozenset({SKIP_NOT_TRAINER, SKIP_ALREADY_INJECTED, SKIP_SYSTEM_NAMESPACE})


@dataclass(frozen=True)
class NamespaceInfo:
    """What the mutation needs to know about the pod's namespace."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MutationResult:
    pod: dict[str, Any]  # the pod after mutation (the input, unchanged, when not injected)
    patch: list[dict[str, Any]]  # RFC 6902 operations; [] when unchanged
    injected: bool
    skip_reason: str | None  # metric label when not injected (one of SKIP_REASONS)
    message: str  # one human sentence: why skipped / what was injected
    warnings: list[str]  # for AdmissionResponse.warnings and CLI stderr
    audit_annotations: dict[str, str]
    deny: bool  # invalid setting and config says deny


def reason_mark(reason: str, message: str) -> dict[str, str]:
    """The annotation that says why a pod is not (or may not be) protected."""
    return {settings.REASON_KEY: f"{reason}: {message}"}


def _skip(
    pod: dict[str, Any],
    reason: str,
    message: str,
    warnings: list[str] | None = None,
    deny: bool = False,
) -> MutationResult:
    """The pod left uninjected; marked with ``reason`` (its only change) unless denied or
    one of ``UNMARKED_SKIPS``."""
    out, ops = pod, list[dict[str, Any]]()
    if not deny and reason not in UNMARKED_SKIPS:
        out, ops = patches.annotate(pod, reason_mark(reason, message))
    return MutationResult(out, ops, False, reason, message, warnings or [], {}, deny)


def _identity_arrived(pod: dict[str, Any]) -> MutationResult:
    """An injected pod marked ``no-credentials`` whose jitckpt containers all carry a
    workload identity now (an identity webhook called after this one, at reinvocation):
    the mark is taken off, the pod is otherwise unchanged."""
    message = "already injected (jitckpt.io/status or a jitckpt container present); unchanged"
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    mark = annotations.get(settings.REASON_KEY)
    spec = pod.get("spec") or {}
    ours = [
        c
        for key in ("initContainers", "containers")
        for c in spec.get(key) or []
        if isinstance(c, dict) and c.get("name") in OUR_CONTAINERS
    ]
    has_identity = bool(ours) and all(identity.find(c) is not None for c in ours)
    if not (isinstance(mark, str) and mark.startswith(NO_CREDENTIALS + ":") and has_identity):
        return _skip(pod, SKIP_ALREADY_INJECTED, message)
    kept = {k: v for k, v in annotations.items() if k != settings.REASON_KEY}
    out = {**pod, "metadata": {**pod["metadata"], "annotations": kept}}
    ops = [
        {"op": "remove", "path": patches.pointer(["metadata", "annotations", settings.REASON_KEY])}
    ]
    message = (
        "already injected; a workload identity was added since: the no-credentials mark is removed"
    )
    return MutationResult(out, ops, False, SKIP_ALREADY_INJECTED, message, [], {}, False)


def _strings(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v if isinstance(v, str) else str(v) for k, v in value.items()}


def mutate(
    pod: dict[str, Any],
    namespace: NamespaceInfo,
    config: WebhookConfig,
    *,
    require_opt_in: bool = True,
) -> MutationResult:
    """Inject the checkpoint sidecar into a Kubeflow trainer pod, or say why not."""
    if namespace.name in SYSTEM_NAMESPACES or namespace.name == config.webhook_namespace:
        return _skip(pod, SKIP_SYSTEM_NAMESPACE, f"namespace {namespace.name} is never injected")
    if looks_injected(pod):
        return _identity_arrived(pod)
    trainer = jobs.detect(pod)
    if isinstance(trainer, jobs.NotTrainer):
        return _skip(pod, SKIP_NOT_TRAINER, trainer.message)

    metadata = pod["metadata"]
    labels = _strings(metadata.get("labels"))
    annotations = _strings(metadata.get("annotations"))
    errors: list[settings.SettingError] = []
    for source, found in (("pod label", labels), ("pod annotation", annotations)):
        if settings.INJECT_KEY in found:
            error = settings.validate_opt_out(found[settings.INJECT_KEY], source)
            if error is not None:
                errors.append(error)
            elif found[settings.INJECT_KEY] == "false":
                return _skip(pod, SKIP_OPTED_OUT, f"opted out by {settings.INJECT_KEY}=false")

    if (
        require_opt_in
        and namespace.labels.get(settings.INJECTION_LABEL) != settings.INJECTION_ENABLED
    ):
        return _skip(
            pod,
            SKIP_NOT_OPTED_IN,
            f"namespace {namespace.name} lacks the label "
            f"{settings.INJECTION_LABEL}={settings.INJECTION_ENABLED}",
        )
    if pod["spec"].get("hostNetwork") is True:
        return _skip(pod, SKIP_HOST_NETWORK, "hostNetwork pods are not injected")
    if pod["spec"].get("shareProcessNamespace") is True:
        return _skip(
            pod,
            SKIP_SHARED_PROCESSES,
            "shareProcessNamespace pods are not injected: the trainer could read the "
            "sidecar's environment (the store's credentials) through /proc",
        )
    exposed = isolation.exposure(pod)
    if exposed is not None:
        return _skip(pod, SKIP_EXPOSED, f"{exposed}; not injected")
    if isinstance(trainer, jobs.UnknownNodes):
        return _skip(
            pod,
            SKIP_UNKNOWN_NODES,
            f"{trainer.kind} {trainer.job_name}: {trainer.message}; a checkpoint is valid only "
            "once every node committed, so the node count and this pod's node rank must be "
            "known: not injected (elastic jobs are not supported)",
        )

    resolution = settings.resolve(
        config.defaults,
        _strings(dict(namespace.annotations)),
        annotations,
        allow_insecure_tls=config.allow_insecure_tls,
    )
    errors += resolution.errors
    if errors:
        deny = config.invalid_setting_policy == "deny"
        text = "; ".join(str(e) for e in errors)
        return _skip(
            pod,
            SKIP_INVALID_SETTING,
            f"not injected: {text}",
            warnings=resolution.warnings + [str(e) for e in errors],
            deny=deny,
        )
    if "destination" not in resolution.values:
        return _skip(
            pod,
            SKIP_NO_DESTINATION,
            f"no {settings.PREFIX}destination on the pod, its namespace or the cluster "
            "defaults: nothing to checkpoint to",
            warnings=resolution.warnings,
        )
    injected = build(
        pod,
        trainer,
        values=resolution.values,
        sources=resolution.sources,
        namespace=namespace.name,
        config=config,
    )
    status = injected.status
    secret = status.config.get("s3-secret")
    audit = {
        "injected": f"jitckpt {VERSION}",
        "destination": status.destination,
        "patch-sha256": status.patchSha256,
    }
    if secret is not None:
        audit["s3-secret"] = secret
    added = status.initContainers + status.containers
    message = (
        f"injected {', '.join(added)} ({status.mode}) into {trainer.kind} {trainer.job_name}: "
        f"checkpoints to {status.destination}"
    )
    return MutationResult(
        pod=injected.pod,
        patch=injected.patch,
        injected=True,
        skip_reason=None,
        message=message,
        warnings=resolution.warnings + injected.warnings,
        audit_annotations=audit,
        deny=False,
    )
