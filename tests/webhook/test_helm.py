"""The Helm chart (deploy/helm/jitckpt): the objects the kustomize overlays render, lint-clean.

A platform team installs with one or the other, so the two must not drift: for
each certificate mode the chart's defaults render exactly the overlay's objects
(tests/webhook/test_server_deploy.py holds those to the schemas and to what the
webhook needs), less only the labels Helm adds to say who manages them. What
the chart adds is its values; each one a platform team sets must reach the
objects it names, and one the webhook would refuse is refused by the chart's
schema before anything reaches a cluster. helm is the real one, built from the
Go module proxy by ``make controlplane`` (tools/controlplane/helm); the chart
in a real API server: tests/controlplane/test_deploy.py.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from local.controlplane.binaries import MODULES, MissingBinary, binary, pinned_version
from local.controlplane.install import CHART, DEPLOY, NAMESPACE, render, render_chart
from tests.support.tools import unavailable
from webhook.config import parse_config

MODES = ("self-signed", "cert-manager")
# The labels Helm's conventions add to every object (kustomize's part-of is the chart's too).
HELM_LABELS = ("app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "helm.sh/chart")
Key = tuple[str, str, str, str]


@pytest.fixture(scope="module")
def helm() -> str:
    try:
        return str(binary("helm"))
    except MissingBinary as exc:
        unavailable(str(exc))


def by_key(docs: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Objects by (apiVersion, kind, namespace, name), Helm's own labels taken off and each
    ConfigMap's files parsed (the chart writes the configuration from values, without the
    overlay's comments)."""
    out: dict[Key, dict[str, Any]] = {}
    for original in docs:
        doc = copy.deepcopy(original)
        meta = doc["metadata"]
        for label in HELM_LABELS:
            meta.get("labels", {}).pop(label, None)
        if doc["kind"] == "ConfigMap":
            doc["data"] = {name: yaml.safe_load(text) for name, text in doc["data"].items()}
        key = (doc["apiVersion"], doc["kind"], meta.get("namespace", ""), meta["name"])
        assert key not in out, key
        out[key] = doc
    return out


@pytest.mark.parametrize("mode", MODES)
def test_the_chart_renders_what_the_overlay_renders(helm: str, mode: str) -> None:
    chart = by_key(render_chart({"certificates": mode, "createNamespace": "true"}))
    overlay = by_key(render(DEPLOY / "overlays" / mode))
    assert sorted(chart) == sorted(overlay)
    for key, doc in overlay.items():
        assert chart[key] == doc, key
    # Helm's labels are on every object, so `helm list`/`uninstall` find them all.
    for doc in render_chart({"certificates": mode}):
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", doc["metadata"]["name"]
        assert labels["app.kubernetes.io/part-of"] == "jitckpt"


def test_by_default_the_namespace_is_the_platform_s_own(helm: str) -> None:
    """``helm install --create-namespace`` makes a namespace without the Pod Security
    label the overlays give theirs, so the chart only makes one when asked."""
    kinds = {doc["kind"] for doc in render_chart()}
    assert "Namespace" not in kinds
    assert {"Deployment", "MutatingWebhookConfiguration", "ConfigMap"} <= kinds


@pytest.mark.parametrize("mode", MODES)
def test_lint_is_clean(helm: str, mode: str) -> None:
    version = pinned_version(*MODULES["kube-apiserver"])
    done = subprocess.run(
        [helm, "lint", "--strict", f"--kube-version={version}", f"--set=certificates={mode}",
         str(CHART)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("mode", MODES)
def test_the_values_a_platform_team_sets_reach_the_objects(
    helm: str, mode: str, tmp_path: Path
) -> None:
    docs = render_chart(
        {
            "certificates": mode,
            "replicas": "3",
            "failurePolicy": "Ignore",
            "timeoutSeconds": "5",
            "nodeSelector.node-role\\.kubernetes\\.io/control-plane": "",
            "priorityClassName": "system-cluster-critical",
            "config.invalid_setting_policy": "deny",
            "config.defaults.destination": "s3://ml-checkpoints/jobs",
            "config.defaults.s3-secret": "checkpoint-bucket",
            "sidecarImage": "registry.example.com/ml/jitckpt-sidecar:1.2.3",
            "webhookImage.repository": "registry.example.com/ml/jitckpt-webhook",
            "webhookImage.tag": "1.2.3",
            "webhookImage.digest": "",
        },
        namespace="ml-platform",
    )
    objects = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    for doc in docs:
        if not doc["apiVersion"].startswith("cert-manager.io/"):
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration"):
            assert doc["metadata"]["namespace"] == "ml-platform", doc["metadata"]["name"]
        for subject in doc.get("subjects", []):
            assert subject["namespace"] == "ml-platform"

    deployment = objects[("Deployment", "jitckpt-webhook")]
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node-role.kubernetes.io/control-plane": ""}
    assert pod["priorityClassName"] == "system-cluster-critical"
    (container,) = pod["containers"]
    assert container["image"] == "registry.example.com/ml/jitckpt-webhook:1.2.3"
    (hook,) = objects[("MutatingWebhookConfiguration", "jitckpt-webhook")]["webhooks"]
    assert (hook["failurePolicy"], hook["timeoutSeconds"]) == ("Ignore", 5)
    assert hook["clientConfig"]["service"]["namespace"] == "ml-platform"

    # The configuration is the one the webhook reads, through its own parser.
    (text,) = objects[("ConfigMap", "jitckpt-webhook-config")]["data"].values()
    config = parse_config(text, tmp_path / "config.yaml")
    assert config.webhook_namespace == "ml-platform"
    assert config.sidecar_image == "registry.example.com/ml/jitckpt-sidecar:1.2.3"
    assert config.invalid_setting_policy == "deny"
    assert config.defaults["destination"] == "s3://ml-checkpoints/jobs"
    assert config.defaults["s3-secret"] == "checkpoint-bucket"
    assert config.defaults["grace-period-seconds"] == "300"

    # Wherever the namespace is named in a string, it is the release's.
    if mode == "self-signed":
        assert "--service=jitckpt-webhook.ml-platform" in container["args"]
    else:
        annotations = objects[("MutatingWebhookConfiguration", "jitckpt-webhook")]["metadata"]
        assert annotations["annotations"] == {
            "cert-manager.io/inject-ca-from": "ml-platform/jitckpt-webhook-tls"
        }
        names = objects[("Certificate", "jitckpt-webhook-tls")]["spec"]["dnsNames"]
        assert "jitckpt-webhook.ml-platform.svc" in names
        assert not any(NAMESPACE in name for name in names)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("certificates=none", "/certificates"),
        ("failurePolicy=Never", "/failurePolicy"),
        ("config.invalid_setting_policy=warn", "/config/invalid_setting_policy"),
        ("webhookImage.digest=latest", "/webhookImage/digest"),
        # The sidecar image and the webhook's namespace have one place each.
        ("config.sidecar_image=other", "/config"),
        ("config.webhook_namespace=other", "/config"),
        ("replicas=0", "/replicas"),
        ("unknownValue=1", "unknownValue"),
    ],
)
def test_a_value_the_webhook_would_refuse_is_refused_at_render(
    helm: str, value: str, said: str
) -> None:
    key, _, setting = value.partition("=")
    with pytest.raises(subprocess.CalledProcessError) as refused:
        render_chart({key: setting})
    assert "values don't meet the specifications of the schema" in refused.value.stderr
    assert said in refused.value.stderr, refused.value.stderr
