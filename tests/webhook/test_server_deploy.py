"""Every manifest under deploy/ validates, each overlay renders, and the pieces agree.

Schemas: ``kubernetes-validate`` for Kubernetes 1.29 and the newest version it
ships, in strict mode (unknown fields fail). cert-manager's Issuer and
Certificate are CRDs the package has no schema for: they are checked
structurally (the fields cert-manager requires, and references that resolve).
Overlays are rendered with ``kubectl kustomize`` (or ``kustomize build``), the
same code ``kubectl apply -k`` runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from jitckpt.cli import build_parser
from tests.support.tools import kubectl
from tests.test_images import WEBHOOK_IMAGE
from tests.webhook.server_support import REPO
from webhook.config import VERSION, load_config

DEPLOY = REPO / "deploy"
OVERLAYS = ["cert-manager", "self-signed"]
VERSIONS = ["1.29", kubernetes_validate.latest_version()]
CRD_GROUPS = ("cert-manager.io/",)
JOB_LABELS = ("training.kubeflow.org/job-name", "jobset.sigs.k8s.io/jobset-name")


def resource_files(directory: Path) -> list[Path]:
    """The files a kustomization lists as resources (patches are checked rendered)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    files = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        files += resource_files(path) if path.is_dir() else [path]
    return files


ALL_FILES = sorted({f for o in OVERLAYS for f in resource_files(DEPLOY / "overlays" / o)})


def validate(doc: dict[str, Any]) -> None:
    if doc["apiVersion"].startswith(CRD_GROUPS):
        check_cert_manager(doc)
        return
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def check_cert_manager(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "cert-manager.io/v1"
    assert doc["metadata"]["name"] and doc["metadata"].get("namespace")
    spec = doc["spec"]
    if doc["kind"] == "Issuer":
        assert len(set(spec) & {"selfSigned", "ca", "acme", "vault", "venafi"}) == 1
        if "ca" in spec:
            assert spec["ca"]["secretName"]
    else:
        assert doc["kind"] == "Certificate"
        assert set(spec) <= {
            "secretName", "issuerRef", "dnsNames", "commonName", "isCA", "duration",
            "renewBefore", "usages", "privateKey", "ipAddresses", "secretTemplate",
        }  # fmt: skip
        assert spec["secretName"] and spec["issuerRef"]["name"]
        assert spec["issuerRef"].get("kind", "Issuer") in ("Issuer", "ClusterIssuer")
        assert spec.get("dnsNames") or spec.get("commonName")
        assert spec["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_each_manifest_file_validates(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        validate(doc)


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIRECTORY``: what ``kubectl apply -k`` would send."""
    argv = [kubectl(), "kustomize", str(directory)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


class Rendered:
    """One rendered overlay, looked up by kind and name."""

    def __init__(self, overlay: str) -> None:
        self.docs = kustomize(DEPLOY / "overlays" / overlay)

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [
            d for d in self.docs if d["kind"] == kind and name in (None, d["metadata"]["name"])
        ]
        assert len(found) == 1, (kind, name, len(found))
        return found[0]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return Rendered(request.param)


def test_rendered_overlay_validates(rendered: Rendered) -> None:
    for doc in rendered.docs:
        validate(doc)
    kinds = {d["kind"] for d in rendered.docs}
    assert kinds >= {
        "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
        "Deployment", "Service", "PodDisruptionBudget", "MutatingWebhookConfiguration",
    }  # fmt: skip


def test_reporter_role_grants_creating_events_and_nothing_else(rendered: Rendered) -> None:
    """The role is bound to the trainer's service account: untrusted code holds it too."""
    reporter = rendered.one("ClusterRole", "jitckpt-reporter")
    assert reporter["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    assert "aggregationRule" not in reporter


def test_webhook_configuration_points_at_the_service(rendered: Rendered) -> None:
    mwc = rendered.one("MutatingWebhookConfiguration")
    service = rendered.one("Service")
    deployment = rendered.one("Deployment")
    (hook,) = mwc["webhooks"]
    assert hook["admissionReviewVersions"] == ["v1"]
    # its one side effect, an Event on a job admitted unprotected, is never made for a dry run
    assert hook["sideEffects"] == "NoneOnDryRun"
    assert hook["timeoutSeconds"] == 10
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["failurePolicy"] in ("Fail", "Ignore")
    assert hook["namespaceSelector"] == {"matchLabels": {"jitckpt.io/injection": "enabled"}}
    assert hook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    ref = hook["clientConfig"]["service"]
    assert ref["name"] == service["metadata"]["name"]
    assert ref["namespace"] == service["metadata"]["namespace"]
    assert ref["path"] == "/mutate"
    (port,) = service["spec"]["ports"]
    assert ref["port"] == port["port"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert port["targetPort"] in [p["name"] for p in container["ports"]]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    pdb = rendered.one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"] == 2


def test_match_condition_passes_only_kubeflow_job_pods(rendered: Rendered) -> None:
    """The CEL expression, checked by evaluating its one shape on label sets.

    No CEL interpreter ships here; the expression is held to the exact form
    ``has(labels) && (A in labels || B in labels)`` and that form is evaluated.
    """
    (hook,) = rendered.one("MutatingWebhookConfiguration")["webhooks"]
    (condition,) = hook["matchConditions"]
    expression = " ".join(condition["expression"].split())
    shape = re.fullmatch(
        r"has\(object\.metadata\.labels\) && \('([^']+)' in object\.metadata\.labels \|\| "
        r"'([^']+)' in object\.metadata\.labels\)",
        expression,
    )
    assert shape, expression
    keys = shape.groups()
    assert set(keys) == set(JOB_LABELS)

    def passes(labels: dict[str, str] | None) -> bool:
        return labels is not None and any(k in labels for k in keys)

    assert passes({"training.kubeflow.org/job-name": "bert"})
    assert passes({"jobset.sigs.k8s.io/jobset-name": "llm", "app": "x"})
    assert not passes(None) and not passes({"app": "web"})
    # Opting out is by label selector or the webhook's own answer, never by the condition.
    assert hook["objectSelector"] == {
        "matchExpressions": [{"key": "jitckpt.io/inject", "operator": "NotIn", "values": ["false"]}]
    }


def test_deployment_is_restricted_and_its_args_parse(rendered: Rendered) -> None:
    deployment = rendered.one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    assert container["command"] == ["jitckpt"]
    args = build_parser(container["args"][0]).parse_args(container["args"])
    assert args.func.__name__ == "run_serve"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert str(args.cert_dir) == mounts["certs"]
    assert str(args.config.parent) == mounts["config"]
    assert args.port == container["ports"][0]["containerPort"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    configmap = rendered.one("ConfigMap", volumes["config"]["configMap"]["name"])
    assert set(configmap["data"]) == {args.config.name}


def test_configmap_is_a_valid_webhook_config(rendered: Rendered, tmp_path: Path) -> None:
    (configmap,) = rendered.all("ConfigMap")
    (text,) = configmap["data"].values()
    path = tmp_path / "config.yaml"
    path.write_text(text)
    config = load_config(path)
    assert config.webhook_namespace == rendered.one("Namespace")["metadata"]["name"]
    assert config.invalid_setting_policy in ("admit", "deny")


def images(docs: list[dict[str, Any]], tmp_path: Path) -> tuple[str, str]:
    """The webhook Deployment's image and the sidecar image its config injects."""
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    path = tmp_path / "config.yaml"
    path.write_text(configmap["data"]["config.yaml"])
    return container["image"], load_config(path).sidecar_image


def test_images_are_set_in_one_place_and_released_together(
    rendered: Rendered, tmp_path: Path
) -> None:
    """The Deployment's image comes from the base's ``images:``; both images carry the
    project's version (the webhook injects the sidecar of its own release), and both are
    pinned by digest (what ``make images`` pushed; a tag can be moved)."""
    base = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    (entry,) = [i for i in base["images"] if i["name"] == "jitckpt-webhook"]
    webhook, sidecar = images(rendered.docs, tmp_path)
    assert webhook == f"{entry['newName']}:{entry['newTag']}@{entry['digest']}"
    for image in (webhook, sidecar):
        name_tag, _, digest = image.partition("@")
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), image
        assert name_tag.rpartition(":")[2] == VERSION
    assert (
        webhook.split("@")[0].replace("jitckpt-webhook", "jitckpt-sidecar") == sidecar.split("@")[0]
    )
    # No manifest file names an image itself: the base's images: entry does (the Helm
    # chart's templates are not YAML until rendered: tests/webhook/test_helm.py; the
    # examples are a user's objects, not the install's).
    manifests = [
        p
        for p in DEPLOY.rglob("*.yaml")
        if p.relative_to(DEPLOY).parts[0] not in ("helm", "examples")
    ]
    named = {value for path in manifests for value in _image_fields(path)}
    assert named == {"jitckpt-webhook"}


NOT_INSTALLED = ("helm", "examples")


def _image_fields(path: Path) -> list[Any]:
    """Every ``image:`` value in the YAML documents of ``path``."""
    found: list[Any] = []
    todo: list[Any] = list(yaml.safe_load_all(path.read_text()))
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            found += [v for k, v in node.items() if k == "image"]
            todo += node.values()
        elif isinstance(node, list):
            todo += node
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pointing_the_install_at_pushed_images(overlay: str, tmp_path: Path) -> None:
    """What the install page's "Images" (docs/platform/install.md) tells a platform engineer
    to do, on a copy of deploy/: the base's images: entry (as ``kustomize edit set image``
    writes it) and the config's sidecar_image. The rendered install then names the pushed
    images and no other."""
    deploy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, deploy)
    registry, version = "registry.example.com/ml", "1.2.3"
    kustomization = deploy / "base" / "kustomization.yaml"
    base = yaml.safe_load(kustomization.read_text())
    base["images"] = [
        {"name": "jitckpt-webhook", "newName": f"{registry}/jitckpt-webhook", "newTag": version}
    ]
    kustomization.write_text(yaml.safe_dump(base))
    configmap = deploy / "base" / "configmap.yaml"
    lines = configmap.read_text().splitlines(keepends=True)
    (at,) = [i for i, line in enumerate(lines) if line.strip().startswith("sidecar_image:")]
    lines[at] = f"    sidecar_image: {registry}/jitckpt-sidecar:{version}\n"
    configmap.write_text("".join(lines))

    docs = kustomize(deploy / "overlays" / overlay)
    webhook, sidecar = images(docs, tmp_path)
    assert webhook == f"{registry}/jitckpt-webhook:{version}"
    assert sidecar == f"{registry}/jitckpt-sidecar:{version}"
    assert "ghcr.io" not in yaml.safe_dump_all(docs)


def rbac_rules(rendered: Rendered, subject: str) -> list[tuple[str, dict[str, Any]]]:
    """(role kind, rule) of every role bound to the service account ``subject``."""
    rules = []
    for binding in rendered.all("ClusterRoleBinding") + rendered.all("RoleBinding"):
        if any(s["name"] == subject for s in binding["subjects"]):
            role = rendered.one(binding["roleRef"]["kind"], binding["roleRef"]["name"])
            rules += [(role["kind"], rule) for rule in role["rules"]]
    return rules


def test_rbac_is_least_privilege(rendered: Rendered) -> None:
    for role in rendered.all("ClusterRole") + rendered.all("Role"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
    granted = {
        (kind, g, r, v, tuple(rule.get("resourceNames", ())))
        for kind, rule in rbac_rules(rendered, "jitckpt-webhook")
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    base = {
        ("ClusterRole", "", "namespaces", "list", ()),
        ("ClusterRole", "", "namespaces", "watch", ()),
        ("ClusterRole", "", "events", "create", ()),  # webhook/events.py, nothing more
    }
    if not any("--self-signed" in a for a in _args(rendered)):
        assert granted == base
        return
    args = build_parser(_args(rendered)[0]).parse_args(_args(rendered))
    mwc = rendered.one("MutatingWebhookConfiguration")["metadata"]["name"]
    assert args.webhook_config_name == mwc
    hooks = ("admissionregistration.k8s.io", "mutatingwebhookconfigurations")
    assert granted == base | {
        ("Role", "", "secrets", "create", ()),
        ("Role", "", "secrets", "get", (args.tls_secret,)),
        ("ClusterRole", *hooks, "get", (mwc,)),
        ("ClusterRole", *hooks, "patch", (mwc,)),
    }
    service = rendered.one("Service")["metadata"]
    assert args.service == f"{service['name']}.{service['namespace']}"


def _args(rendered: Rendered) -> list[str]:
    args: list[str] = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    return args


def test_cert_manager_overlay_wires_certificate_secret_and_ca_injection() -> None:
    rendered = Rendered("cert-manager")
    mwc = rendered.one("MutatingWebhookConfiguration")
    namespace, name = mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].split("/")
    certificate = rendered.one("Certificate", name)
    assert certificate["metadata"]["namespace"] == namespace
    service = rendered.one("Service")["metadata"]
    assert f"{service['name']}.{service['namespace']}.svc" in certificate["spec"]["dnsNames"]
    assert set(certificate["spec"]["usages"]) == {"server auth", "digital signature"}
    # The issuer chain resolves: serving cert <- CA issuer <- CA certificate <- self-signed.
    issuer = rendered.one("Issuer", certificate["spec"]["issuerRef"]["name"])
    ca_certificate = next(
        c
        for c in rendered.all("Certificate")
        if c["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"]
    )
    assert ca_certificate["spec"]["isCA"] is True
    assert (
        "selfSigned" in rendered.one("Issuer", ca_certificate["spec"]["issuerRef"]["name"])["spec"]
    )
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["certs"]["secret"]["secretName"] == certificate["spec"]["secretName"]
    assert "caBundle" not in mwc["webhooks"][0]["clientConfig"]


def test_self_signed_overlay_gives_the_webhook_a_writable_cert_dir() -> None:
    rendered = Rendered("self-signed")
    assert not [d for d in rendered.docs if d["apiVersion"].startswith(CRD_GROUPS)]
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["certs"]["emptyDir"]["medium"] == "Memory"
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "certs")
    assert not mount.get("readOnly")


def test_deployment_runs_as_the_image_user(rendered: Rendered) -> None:
    uid, _, gid = WEBHOOK_IMAGE.user().partition(":")
    security = rendered.one("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsUser"] == int(uid)
    assert security["runAsGroup"] == int(gid or uid)
