"""Injected golden pods: valid Pods, a "restricted" sidecar, and no Secret in any trainer."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_validate import utils as kv

from tests.webhook.golden import Case, discover
from webhook.mutate import mutate
from webhook.status import AGENT, RESTORE, VOL_SECRET, read_status

INJECTED = [c for c in discover() if c.expected_result()["injected"]]
VERSIONS = ["1.29", kv.latest_version()]

# Pod Security Standards, "restricted" profile (Kubernetes 1.29+), container-level rules
# and the volume types it allows.
ALLOWED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
ALLOWED_CAPABILITIES_ADD = {"NET_BIND_SERVICE"}
ALLOWED_SECCOMP = {"RuntimeDefault", "Localhost"}


def injected_pod(case: Case) -> dict[str, Any]:
    return mutate(case.pod, case.namespace, case.config, require_opt_in=True).pod


def restricted_violations(pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
    """The container-level rules of the restricted profile that ``container`` breaks."""
    pod_sc = pod["spec"].get("securityContext") or {}
    sc = container.get("securityContext") or {}
    problems = []
    if sc.get("privileged") is True:
        problems.append("privileged")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation must be false")
    caps = sc.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []):
        problems.append("capabilities must drop ALL")
    if set(caps.get("add") or []) - ALLOWED_CAPABILITIES_ADD:
        problems.append("capabilities may add only NET_BIND_SERVICE")
    run_as_non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    if run_as_non_root is not True:
        problems.append("runAsNonRoot must be true")
    if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
        problems.append("runAsUser must not be 0")
    seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
    if seccomp not in ALLOWED_SECCOMP:
        problems.append("seccompProfile must be RuntimeDefault or Localhost")
    for port in container.get("ports") or []:
        if port.get("hostPort"):
            problems.append("hostPort")
    if (sc.get("seLinuxOptions") or {}).get("type") not in (None, "", "container_t"):
        problems.append("seLinuxOptions.type")
    if sc.get("procMount") not in (None, "Default"):
        problems.append("procMount")
    return problems


def sidecars(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    return [
        c
        for c in spec.get("initContainers", []) + spec["containers"]
        if c["name"] in (AGENT, RESTORE)
    ]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", INJECTED, ids=[c.name for c in INJECTED])
def test_injected_pod_validates_against_kubernetes_schema(case: Case, version: str) -> None:
    pod = injected_pod(case)
    kv.validate(pod, version, strict=True)


def test_schema_validation_catches_a_broken_pod() -> None:
    pod = injected_pod(INJECTED[0])
    pod["spec"]["initContainers"][0]["restartPolicy"] = 7
    with pytest.raises(kv.ValidationError):
        kv.validate(pod, "1.29", strict=True)


@pytest.mark.parametrize("case", INJECTED, ids=[c.name for c in INJECTED])
def test_sidecar_meets_restricted_profile(case: Case) -> None:
    pod = injected_pod(case)
    found = sidecars(pod)
    assert found, "no sidecar injected"
    for container in found:
        assert restricted_violations(pod, container) == [], container["name"]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["runAsUser"] > 0
    status = read_status(pod)
    assert status is not None
    for volume in pod["spec"]["volumes"]:
        if volume["name"] in status.volumes:
            kinds = set(volume) - {"name"}
            assert kinds <= ALLOWED_VOLUME_TYPES, volume


def test_restricted_check_catches_violations() -> None:
    pod = injected_pod(INJECTED[0])
    container = sidecars(pod)[0]
    container["securityContext"].update(
        {"allowPrivilegeEscalation": True, "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}
    )
    container["ports"][0]["hostPort"] = 8471
    assert restricted_violations(pod, container) == [
        "allowPrivilegeEscalation must be false",
        "capabilities may add only NET_BIND_SERVICE",
        "hostPort",
    ]


def secret_exposure(pod: dict[str, Any], container: dict[str, Any], secret: str) -> list[str]:
    """Every way ``container`` can read the Secret ``secret``."""
    ways = []
    for source in container.get("envFrom") or []:
        if (source.get("secretRef") or {}).get("name") == secret:
            ways.append("envFrom")
    for entry in container.get("env") or []:
        ref = (entry.get("valueFrom") or {}).get("secretKeyRef") or {}
        if ref.get("name") == secret:
            ways.append(f"env {entry['name']}")
    secret_volumes = set()
    for volume in pod["spec"].get("volumes") or []:
        if (volume.get("secret") or {}).get("secretName") == secret:
            secret_volumes.add(volume["name"])
        for projection in (volume.get("projected") or {}).get("sources") or []:
            if (projection.get("secret") or {}).get("name") == secret:
                secret_volumes.add(volume["name"])
    for mount in container.get("volumeMounts") or []:
        if mount["name"] in secret_volumes:
            ways.append(f"volume {mount['name']}")
    return ways


@pytest.mark.parametrize("case", INJECTED, ids=[c.name for c in INJECTED])
def test_no_trainer_container_gets_the_s3_secret(case: Case) -> None:
    pod = injected_pod(case)
    status = read_status(pod)
    assert status is not None
    secret = status.config.get("s3-secret")
    names = {c["name"] for c in sidecars(pod)}
    spec = pod["spec"]
    for container in spec.get("initContainers", []) + spec["containers"]:
        exposure = secret_exposure(pod, container, secret) if secret else []
        if container["name"] in names:
            # As read-only files only, never as env (which a rotation never reaches).
            assert exposure == ([f"volume {VOL_SECRET}"] if secret else [])
            mounts = [m for m in container["volumeMounts"] if m["name"] == VOL_SECRET]
            assert all(m.get("readOnly") is True for m in mounts)
        else:
            assert exposure == [], container["name"]
            assert not container.get("envFrom"), container["name"]


def test_secret_check_catches_a_leak() -> None:
    pod = injected_pod(INJECTED[0])
    trainer = pod["spec"]["containers"][0]
    trainer["env"].append(
        {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "AWS_ACCESS_KEY_ID"}}}
    )
    pod["spec"]["volumes"].append({"name": "creds", "secret": {"secretName": "s"}})
    trainer["volumeMounts"].append({"name": "creds", "mountPath": "/creds"})
    assert secret_exposure(pod, trainer, "s") == ["env KEY", "volume creds"]
