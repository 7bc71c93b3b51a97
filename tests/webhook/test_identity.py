"""The pod's own workload identity reaches the sidecar, whichever webhook ran first.

Without it a sidecar of an IRSA or EKS Pod Identity pod would fall back to the
node's instance role. The identity webhook may run before this one (the
trainer carries the identity: the sidecar must get a read-only copy) or after
it (it adds itself to the sidecar too; this webhook, reinvoked, must leave the
pod as it is).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.webhook import eks_identity
from tests.webhook.golden import load_yaml
from tests.webhook.server_support import FIXTURES
from webhook.config import WebhookConfig
from webhook.drift import audit_pod
from webhook.mutate import NamespaceInfo, mutate
from webhook.settings import REASON_KEY
from webhook.status import AGENT, RESTORE

IDENTITY_ENV = {
    "irsa": ("AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"),
    "eks-pod-identity": (
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    ),
}
PODS = {"pytorchjob-worker": "team-a", "trainjob-node": "team-b"}


def namespace(name: str, secret: bool) -> NamespaceInfo:
    annotations = {"jitckpt.io/destination": f"s3://ml-checkpoints/{name}"}
    if secret:
        annotations["jitckpt.io/s3-secret"] = f"{name}-s3"
    return NamespaceInfo(name, {"jitckpt.io/injection": "enabled"}, annotations)


def inject(pod: dict[str, Any], ns: NamespaceInfo, mode: str) -> dict[str, Any]:
    pod = {**pod, "metadata": {**pod["metadata"]}}
    pod["metadata"]["annotations"] = {
        **(pod["metadata"].get("annotations") or {}),
        "jitckpt.io/sidecar-mode": mode,
    }
    result = mutate(pod, ns, WebhookConfig())
    assert result.injected, result.message
    return result.pod


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env") or []}


def sidecars(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    every = spec.get("initContainers", []) + spec["containers"]
    return [c for c in every if c["name"] in (AGENT, RESTORE)]


def trainer(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] in ("pytorch", "node"))


def assert_same_identity(pod: dict[str, Any], kind: str) -> None:
    """Every sidecar carries the trainer's identity env, and its token mount read-only."""
    theirs = trainer(pod)
    token_path = env_of(theirs)[IDENTITY_ENV[kind][1]]["value"]
    (mount,) = [m for m in theirs["volumeMounts"] if token_path.startswith(m["mountPath"] + "/")]
    found = sidecars(pod)
    assert found
    for sidecar in found:
        for name in IDENTITY_ENV[kind]:
            assert env_of(sidecar)[name] == env_of(theirs)[name], (sidecar["name"], name)
        (copied,) = [m for m in sidecar["volumeMounts"] if m["name"] == mount["name"]]
        assert copied["mountPath"] == mount["mountPath"] and copied["readOnly"] is True


@pytest.mark.parametrize("mode", ["native", "legacy"])
@pytest.mark.parametrize("kind", sorted(IDENTITY_ENV))
@pytest.mark.parametrize("fixture", sorted(PODS))
def test_identity_webhook_first_the_sidecar_gets_a_read_only_copy(
    fixture: str, kind: str, mode: str
) -> None:
    pod = eks_identity.apply(load_yaml(FIXTURES / f"{fixture}.yaml"), kind)
    injected = inject(pod, namespace(PODS[fixture], secret=False), mode)
    assert_same_identity(injected, kind)


@pytest.mark.parametrize("kind", sorted(IDENTITY_ENV))
@pytest.mark.parametrize("fixture", sorted(PODS))
def test_identity_webhook_after_ends_the_same_and_reinvocation_changes_nothing(
    fixture: str, kind: str
) -> None:
    ns = namespace(PODS[fixture], secret=False)
    first = inject(load_yaml(FIXTURES / f"{fixture}.yaml"), ns, "native")
    assert all(IDENTITY_ENV[kind][0] not in env_of(c) for c in sidecars(first))
    # Injected with no identity in sight: marked no-credentials, and said.
    assert first["metadata"]["annotations"][REASON_KEY].startswith("no-credentials: ")
    after = eks_identity.apply(first, kind)
    assert_same_identity(after, kind)
    # The reinvocation after the identity webhook takes the mark off, and changes nothing else.
    again = mutate(after, ns, WebhookConfig())
    assert not again.injected
    assert again.patch == [{"op": "remove", "path": "/metadata/annotations/jitckpt.io~1reason"}]
    assert REASON_KEY not in again.pod["metadata"]["annotations"]
    assert mutate(again.pod, ns, WebhookConfig()).patch == []
    # Both orders give the sidecar the same identity.
    before = inject(eks_identity.apply(load_yaml(FIXTURES / f"{fixture}.yaml"), kind), ns, "native")
    for ours, theirs in zip(sidecars(before), sidecars(after), strict=True):
        for name in IDENTITY_ENV[kind]:
            assert env_of(ours)[name] == env_of(theirs)[name]


def test_a_secret_wins_over_the_pod_identity() -> None:
    """With an s3-secret the sidecar uses the Secret's files; the trainer's role is not
    copied (one identity, the one the namespace chose)."""
    pod = eks_identity.apply(load_yaml(FIXTURES / "pytorchjob-worker.yaml"), "irsa")
    injected = inject(pod, namespace("team-a", secret=True), "native")
    (sidecar,) = sidecars(injected)
    assert "AWS_ROLE_ARN" not in env_of(sidecar)
    assert "JITCKPT_S3_SECRET_DIR" in env_of(sidecar)


def test_a_token_file_on_no_volume_is_said() -> None:
    pod = load_yaml(FIXTURES / "pytorchjob-worker.yaml")
    container = trainer(pod)
    container["env"] = [
        *container.get("env", []),
        {"name": "AWS_ROLE_ARN", "value": eks_identity.IRSA_ROLE},
        {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": "/nowhere/token"},
    ]
    result = mutate(pod, namespace("team-a", secret=False), WebhookConfig())
    assert result.injected
    assert any("/nowhere/token" in w and "cannot read it" in w for w in result.warnings)
    (sidecar,) = sidecars(result.pod)
    assert env_of(sidecar)["AWS_ROLE_ARN"]["value"] == eks_identity.IRSA_ROLE


@pytest.mark.parametrize("mode", ["native", "legacy"])
@pytest.mark.parametrize("kind", sorted(IDENTITY_ENV))
@pytest.mark.parametrize("fixture", sorted(PODS))
def test_audit_of_an_identity_webhook_after_ours_finds_no_drift(
    fixture: str, kind: str, mode: str
) -> None:
    """Webhooks run in the order of their configurations' names: on EKS IRSA's usually runs
    after jitckpt's. The pod it returns is what jitckpt injected plus the pod's identity."""
    ns = namespace(PODS[fixture], secret=False)
    after = eks_identity.apply(inject(load_yaml(FIXTURES / f"{fixture}.yaml"), ns, mode), kind)
    row = audit_pod(after, ns, WebhookConfig())
    assert row.drift == [], row.notes
    assert f"workload identity ({kind}) added to every container by a webhook" in row.notes[0]


def test_audit_after_an_identity_webhook_still_sees_an_edit() -> None:
    """Taking the identity out must not hide anything else: a trainer's JITCKPT env changed
    is drift, and so is a sidecar given another role than the trainer's."""
    ns = namespace("team-a", secret=False)
    after = eks_identity.apply(
        inject(load_yaml(FIXTURES / "pytorchjob-worker.yaml"), ns, "native"), "irsa"
    )
    edited = copy.deepcopy(after)
    (trainer,) = edited["spec"]["containers"]
    env_of(trainer)["JITCKPT_JIT"]["value"] = "false"
    assert "edited" in audit_pod(edited, ns, WebhookConfig()).drift
    other_role = copy.deepcopy(after)
    for sidecar in sidecars(other_role):
        env_of(sidecar)["AWS_ROLE_ARN"]["value"] = "arn:aws:iam::123456789012:role/admin"
    row = audit_pod(other_role, ns, WebhookConfig())
    assert row.drift != [], row.notes
