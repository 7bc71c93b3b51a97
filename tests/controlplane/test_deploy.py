"""deploy/ applied to a real kube-apiserver: every object accepted and stored as written.

tests/webhook/test_server_deploy.py holds the manifests to the published
schemas; a real server also runs what no schema has: the CEL of the
matchConditions compiled, the RBAC escalation check on the roles it grants,
the defaulting of each object. The self-signed overlay is applied by the
session's install (local/controlplane/install.py); the cert-manager overlay's
objects, less cert-manager's own kinds (no cert-manager runs here), are sent
with a server-side dry run, and so are the Helm chart's in both modes.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from local.controlplane.binaries import MissingBinary
from local.controlplane.cluster import ControlPlane
from local.controlplane.install import (
    DEPLOY,
    WEBHOOK_CONFIG,
    InstalledWebhook,
    local_overlay,
    render,
    render_chart,
    run_kubectl,
)
from tests.support.tools import unavailable

pytestmark = [pytest.mark.xdist_group("controlplane")]


def stored(cluster: ControlPlane, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects the server holds for ``docs``, in their order (one ``kubectl get -f``)."""
    out = run_kubectl(cluster, "get", "-f", "-", "-o", "json", stdin=yaml.safe_dump_all(docs))
    found: dict[str, Any] = json.loads(out)
    items: list[dict[str, Any]] = found["items"] if found["kind"] == "List" else [found]
    return items


def test_every_object_of_the_self_signed_overlay_is_stored(
    control_plane: ControlPlane, installed: InstalledWebhook
) -> None:
    kinds = {doc["kind"] for doc in installed.objects}
    assert kinds >= {
        "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
        "ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
        "MutatingWebhookConfiguration",
    }  # fmt: skip
    live_objects = stored(control_plane, installed.objects)
    assert len(live_objects) == len(installed.objects)
    for doc, live in zip(installed.objects, live_objects, strict=True):
        name = (doc["kind"], doc["metadata"]["name"])
        assert (live["kind"], live["metadata"]["name"]) == name
        # The server adds labels of its own (a Namespace's kubernetes.io/metadata.name).
        assert (
            doc["metadata"].get("labels", {}).items() <= live["metadata"].get("labels", {}).items()
        ), name
        for key in ("rules", "roleRef", "subjects", "data"):
            if key in doc:
                assert live[key] == doc[key], (name, key)


def test_webhook_configuration_is_the_overlays_but_for_its_address(
    control_plane: ControlPlane, installed: InstalledWebhook
) -> None:
    (written,) = installed.objects_of("MutatingWebhookConfiguration")
    (live,) = stored(control_plane, [written])
    (hook,) = live["webhooks"]
    assert hook["clientConfig"]["url"] == f"{installed.url}/mutate"
    assert "service" not in hook["clientConfig"]
    base = yaml.safe_load((DEPLOY / "base" / "mutatingwebhookconfiguration.yaml").read_text())
    (ours,) = base["webhooks"]
    for key in (
        "name", "admissionReviewVersions", "sideEffects", "timeoutSeconds", "reinvocationPolicy",
        "failurePolicy", "matchPolicy", "rules", "namespaceSelector", "objectSelector",
        "matchConditions",
    ):  # fmt: skip
        assert hook[key] == ours[key], key
    assert live["metadata"]["name"] == WEBHOOK_CONFIG


def test_cert_manager_overlay_is_accepted_by_the_api_server(
    control_plane: ControlPlane, installed: InstalledWebhook, tmp_path: Path
) -> None:
    # Through the same address layer as the install: a dry run is merged with the live
    # objects, and a webhook with both a URL and a Service is invalid.
    (hook,) = installed.objects_of("MutatingWebhookConfiguration")[0]["webhooks"]
    overlay = local_overlay(
        tmp_path, hook["clientConfig"]["url"], base64.b64decode(hook["clientConfig"]["caBundle"]),
        DEPLOY / "overlays" / "cert-manager",
    )  # fmt: skip
    docs = [d for d in render(overlay) if not d["apiVersion"].startswith("cert-manager.io/")]
    assert {d["kind"] for d in docs} >= {"Deployment", "MutatingWebhookConfiguration"}
    out = run_kubectl(
        control_plane, "apply", "--server-side", "--dry-run=server", "--force-conflicts", "-f", "-",
        stdin=yaml.safe_dump_all(docs),
    )  # fmt: skip
    assert out.count("serverside-applied (server dry run)") == len(docs), out


@pytest.mark.parametrize("mode", ["self-signed", "cert-manager"])
def test_the_helm_chart_is_accepted_by_the_api_server(
    control_plane: ControlPlane, installed: InstalledWebhook, mode: str
) -> None:
    """What ``helm install`` would send (tests/webhook/test_helm.py: the overlays' objects),
    with the same change of address as the install, in a server-side dry run over it."""
    try:
        docs = render_chart({"certificates": mode, "createNamespace": "true"})
    except MissingBinary as exc:
        unavailable(str(exc))
    docs = [d for d in docs if not d["apiVersion"].startswith("cert-manager.io/")]
    (live_hook,) = installed.objects_of("MutatingWebhookConfiguration")[0]["webhooks"]
    (configuration,) = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    (hook,) = configuration["webhooks"]
    hook["clientConfig"] = live_hook["clientConfig"]
    assert {d["kind"] for d in docs} >= {"Namespace", "Deployment", "ClusterRoleBinding"}
    # As the install's own field manager: a dry run is merged with the live objects, and
    # fields of the install that the chart leaves out (another mode's) are dropped, not kept.
    out = run_kubectl(
        control_plane, "apply", "--server-side", "--dry-run=server", "--force-conflicts",
        "-f", "-", stdin=yaml.safe_dump_all(docs),
    )  # fmt: skip
    assert out.count("serverside-applied (server dry run)") == len(docs), out
