"""What a security team's scanner (checkov, pinned in the Makefile) says of what we ship.

- Injection never weakens a pod: for every golden injected pod and for
  hardened pods (restricted settings, images by digest pulled ``Always``, no
  service-account token; a PyTorchJob worker, a TrainJob node, one with IRSA
  from either side of this webhook), the injected pod fails no check that the
  pod did not fail before. The shipped configuration (deploy/base's ConfigMap)
  is what injects.
- deploy/: each overlay, and the sidecar-status component rendered into a
  training namespace, pass every check, or skip it in the manifest with the
  scanner's own annotation and a reason.

checkov runs from its own venv (``make setup``): it pins libraries to versions
the project's constraints do not allow. One scan per area, every file at once.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.tools import unavailable
from tests.webhook import eks_identity
from tests.webhook.golden import discover, dump_yaml, load_yaml
from tests.webhook.server_support import FIXTURES, REPO
from webhook.config import WebhookConfig
from webhook.mutate import NamespaceInfo, mutate

# One worker for the module: checkov scans every pod once.
# Its shared fixtures are session ones (tests/conftest.py says why).
pytestmark = pytest.mark.xdist_group("webhook-scanner")

CHECKOV = REPO / ".venv-checkov" / "bin" / "checkov"
DEPLOY = REPO / "deploy"
OVERLAYS = ["cert-manager", "self-signed"]
DIGEST = "@sha256:" + "ab" * 32
HARDENED_UID = 10001
SKIP_ANNOTATION = re.compile(r"^checkov\.io/skip\d+$")
# The one check a lone pod cannot pass: which NetworkPolicy selects it is the
# namespace's business (deploy/components/sidecar-status adds one for sidecars).
POD_ALONE = {"CKV2_K8S_6"}

# JSON, and no download of the vendor's guideline mappings (no network here or in CI).
SCAN_ARGS = ("-o", "json", "--skip-download")
Findings = dict[str, set[str]]  # file name -> failed check ids


def checkov() -> Path:
    if not os.access(CHECKOV, os.X_OK):
        unavailable(f"checkov is not installed at {CHECKOV} (make setup installs it)")
    return CHECKOV


def scan(directory: Path) -> tuple[Findings, int]:
    """Failed checks per file, and how many checks passed (a scan that read nothing fails)."""
    done = subprocess.run(
        [str(checkov()), "-d", str(directory), "--framework", "kubernetes", *SCAN_ARGS],
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr[-2000:]
    reports = json.loads(done.stdout)
    failed: Findings = {}
    passed = 0
    for report in reports if isinstance(reports, list) else [reports]:
        passed += len(report["results"]["passed_checks"])
        for check in report["results"]["failed_checks"]:
            failed.setdefault(check["file_path"].lstrip("/"), set()).add(check["check_id"])
    return failed, passed


# --- pods ---------------------------------------------------------------------


def shipped_config() -> WebhookConfig:
    """The webhook's configuration as deploy/base ships it."""
    configmap = load_yaml(DEPLOY / "base" / "configmap.yaml")
    return WebhookConfig.model_validate(yaml.safe_load(configmap["data"]["config.yaml"]))


def _hardened_container(container: dict[str, Any], probes: bool) -> None:
    name = container["image"].split("@")[0]
    container["image"] = name + DIGEST
    container["imagePullPolicy"] = "Always"
    container["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": HARDENED_UID,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    quantities = {"cpu": "2", "memory": "8Gi"}
    container["resources"] = {"requests": dict(quantities), "limits": dict(quantities)}
    container["volumeMounts"] = [
        m for m in container.get("volumeMounts") or [] if not m["name"].startswith("kube-api")
    ]
    if probes:
        check = {"exec": {"command": ["true"]}, "periodSeconds": 30}
        container["livenessProbe"] = dict(check)
        container["readinessProbe"] = dict(check)


def harden(pod: dict[str, Any], name: str) -> dict[str, Any]:
    """``pod`` as a security team would admit it."""
    out = copy.deepcopy(pod)
    out["metadata"]["name"] = name
    spec = out["spec"]
    spec["automountServiceAccountToken"] = False
    spec["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": HARDENED_UID,
        "runAsGroup": HARDENED_UID,
        "fsGroup": HARDENED_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    spec["volumes"] = [v for v in spec.get("volumes") or [] if not v["name"].startswith("kube-api")]
    for container in spec.get("initContainers") or []:
        _hardened_container(container, probes=False)
    for container in spec["containers"]:
        _hardened_container(container, probes=True)
    return out


def opted_in(name: str, secret: bool) -> NamespaceInfo:
    annotations = {"jitckpt.io/destination": f"s3://ml-checkpoints/{name}"}
    if secret:
        annotations["jitckpt.io/s3-secret"] = f"{name}-s3"
    return NamespaceInfo(name, {"jitckpt.io/injection": "enabled"}, annotations)


def hardened_cases() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """name -> (pod before, pod after injection and any identity webhook)."""
    config = shipped_config()
    worker = harden(load_yaml(FIXTURES / "pytorchjob-worker.yaml"), "bert-ft-worker-0")
    node = harden(load_yaml(FIXTURES / "trainjob-node.yaml"), "llama-sft-node-0-1-x7k2p")
    master = harden(load_yaml(FIXTURES / "pytorchjob-master.yaml"), "gpt-small-master-0")
    cases: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    legacy = copy.deepcopy(node)
    legacy["metadata"].setdefault("annotations", {})["jitckpt.io/sidecar-mode"] = "legacy"
    for name, pod, ns in (
        ("worker", worker, opted_in("team-a", secret=True)),
        ("node", node, opted_in("team-b", secret=True)),
        ("node-legacy", legacy, opted_in("team-b", secret=True)),
    ):
        cases[name] = (pod, mutate(pod, ns, config).pod)
    # IRSA: its webhook ran before ours, and after ours (then the pod it saw was ours).
    irsa = eks_identity.apply(master, "irsa")
    ns = opted_in("team-a", secret=False)
    cases["irsa-first"] = (irsa, mutate(irsa, ns, config).pod)
    cases["irsa-after"] = (irsa, eks_identity.apply(mutate(master, ns, config).pod, "irsa"))
    return cases


@pytest.fixture(scope="session")
def pod_scan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Findings, dict[str, str]]:
    """One scan of every pod before and after; returns findings and case -> file stem."""
    directory = tmp_path_factory.mktemp("pods")
    stems: dict[str, str] = {}
    for case in discover():
        if case.expected_result()["injected"]:
            pod = copy.deepcopy(case.pod)
            pod["metadata"].setdefault("name", case.name)
            after = mutate(pod, case.namespace, case.config, require_opt_in=True).pod
            stems[f"golden/{case.name}"] = write_pair(directory, f"golden-{case.name}", pod, after)
    for name, (before, after) in hardened_cases().items():
        stems[f"hardened/{name}"] = write_pair(directory, f"hardened-{name}", before, after)
    findings, passed = scan(directory)
    assert passed > 0
    return findings, stems


def write_pair(directory: Path, stem: str, before: dict[str, Any], after: dict[str, Any]) -> str:
    (directory / f"{stem}.before.yaml").write_text(dump_yaml(before))
    (directory / f"{stem}.after.yaml").write_text(dump_yaml(after))
    return stem


def new_findings(findings: Findings, stem: str) -> set[str]:
    return findings.get(f"{stem}.after.yaml", set()) - findings.get(f"{stem}.before.yaml", set())


def test_injection_adds_no_finding_to_any_golden_pod(
    pod_scan: tuple[Findings, dict[str, str]],
) -> None:
    findings, stems = pod_scan
    added = {
        case: sorted(new_findings(findings, stem))
        for case, stem in stems.items()
        if case.startswith("golden/")
    }
    assert added and not any(added.values()), added


def test_injection_adds_no_finding_to_a_hardened_pod(
    pod_scan: tuple[Findings, dict[str, str]],
) -> None:
    findings, stems = pod_scan
    hardened = {case: stem for case, stem in stems.items() if case.startswith("hardened/")}
    assert len(hardened) == 5
    for case, stem in hardened.items():
        # The pods are really hardened: a finding the sidecar added would show.
        assert findings.get(f"{stem}.before.yaml", set()) <= POD_ALONE, case
        assert new_findings(findings, stem) == set(), case


# --- deploy/ ------------------------------------------------------------------


def kustomize(directory: Path) -> str:
    from tests.support.tools import kubectl

    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, check=True
    )
    return done.stdout


def training_namespace_with_status_component(root: Path) -> Path:
    """A training namespace's kustomization that enables the sidecar-status component
    with its own monitoring namespace, as deploy/components/sidecar-status says."""
    shutil.copytree(DEPLOY, root / "deploy")
    team = root / "team-a"
    team.mkdir()
    path = "/spec/ingress/0/from/0/namespaceSelector/matchLabels/kubernetes.io~1metadata.name"
    patch = [{"op": "replace", "path": path, "value": "observability"}]
    kustomization = {
        "namespace": "team-a",
        "components": ["../deploy/components/sidecar-status"],
        "patches": [
            {
                "target": {
                    "kind": "NetworkPolicy",
                    "labelSelector": "app.kubernetes.io/name=jitckpt-sidecar-status",
                },
                "patch": yaml.safe_dump(patch),
            }
        ],
    }
    (team / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return team


def test_deploy_passes_every_check_or_skips_it_with_a_reason(tmp_path: Path) -> None:
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    for overlay in OVERLAYS:
        (rendered / f"{overlay}.yaml").write_text(kustomize(DEPLOY / "overlays" / overlay))
    team = training_namespace_with_status_component(tmp_path / "copy")
    component = kustomize(team)
    (rendered / "team-a.yaml").write_text(component)
    policies = list(yaml.safe_load_all(component))
    assert {p["metadata"]["namespace"] for p in policies} == {"team-a"}
    for policy in policies:
        kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    for policy in policies:
        selector = policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]
        assert selector == {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}
    findings, passed = scan(rendered)
    assert passed > 0
    assert findings == {}
    # Every skip names one check and says why.
    for path in rendered.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            annotations = (doc.get("metadata") or {}).get("annotations") or {}
            for key, value in annotations.items():
                if SKIP_ANNOTATION.match(key):
                    check, _, reason = value.partition("=")
                    assert re.fullmatch(r"CKV2?_K8S_\d+", check) and len(reason) > 20, value
