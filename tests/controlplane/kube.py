"""Talking to the test cluster in plain dicts, and reading the webhook's counters around a call.

The kubernetes client's models would turn every pod into its own classes and
back; the tests compare with the YAML fixtures, so requests and answers stay
JSON (``_preload_content=False``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from local.controlplane.install import InstalledWebhook

COUNTERS = (
    "jitckpt_webhook_requests_total",
    "jitckpt_webhook_injected_total",
    "jitckpt_webhook_skipped_total",
    "jitckpt_webhook_denied_total",
)


def _json(response: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(response.data)
    return doc


@dataclass
class Kube:
    """The few calls the tests make, as the cluster's administrator."""

    api: client.ApiClient

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    def create_pod(self, pod: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        namespace = pod["metadata"]["namespace"]
        extra = {"dry_run": "All"} if dry_run else {}
        return _json(
            self.core.create_namespaced_pod(namespace, pod, _preload_content=False, **extra)
        )

    def delete_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.core.delete_namespaced_pod(meta["name"], meta["namespace"], grace_period_seconds=0)

    def ensure_namespace(self, namespace: dict[str, Any]) -> None:
        """The namespace, and its ``default`` ServiceAccount (the controller-manager's job)."""
        name = namespace["metadata"]["name"]
        self.core.create_namespace(namespace)
        self.core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})

    def webhook_configuration(self, name: str) -> dict[str, Any]:
        api = client.AdmissionregistrationV1Api(self.api)
        return _json(api.read_mutating_webhook_configuration(name, _preload_content=False))

    def patch_webhook_configuration(self, name: str, patch: list[dict[str, Any]]) -> None:
        """An RFC 6902 patch (the client sends a list as application/json-patch+json)."""
        api = client.AdmissionregistrationV1Api(self.api)
        api.patch_mutating_webhook_configuration(name, patch)


def counters(webhook: InstalledWebhook) -> dict[tuple[str, str], float]:
    """The webhook's request, injection, skip (by reason) and denial counts."""
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(webhook.metrics()):
        for sample in family.samples:
            if sample.name in COUNTERS:
                found[(sample.name, sample.labels.get("reason", ""))] = sample.value
    return found


def calls(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, float]:
    """What changed between two readings: ``requests``, ``injected``, ``skipped:REASON``..."""
    changed: dict[str, float] = {}
    for key, value in after.items():
        delta = value - before.get(key, 0.0)
        if delta:
            name, reason = key
            short = name.removeprefix("jitckpt_webhook_").removesuffix("_total")
            changed[f"{short}:{reason}" if reason else short] = delta
    return changed
