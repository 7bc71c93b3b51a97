"""The sidecar is pulled at least as strictly as the pod's own containers, and
``sidecar_image`` takes a digest."""

from __future__ import annotations

import pytest

from tests.webhook.golden import load_yaml
from tests.webhook.server_support import FIXTURES
from webhook.config import WebhookConfig
from webhook.mutate import NamespaceInfo, mutate
from webhook.status import AGENT

DIGEST = "sha256:" + "c" * 64
NAMESPACE = NamespaceInfo(
    "team-a",
    {"jitckpt.io/injection": "enabled"},
    {"jitckpt.io/destination": "s3://ml-checkpoints/team-a"},
)


def sidecar_policy(image: str, policy: str | None, config: WebhookConfig) -> str:
    pod = load_yaml(FIXTURES / "pytorchjob-worker.yaml")
    for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
        container["image"] = image
        container.pop("imagePullPolicy", None)
        if policy is not None:
            container["imagePullPolicy"] = policy
    result = mutate(pod, NAMESPACE, config)
    assert result.injected, result.message
    (agent,) = [c for c in result.pod["spec"]["initContainers"] if c["name"] == AGENT]
    return str(agent["imagePullPolicy"])


@pytest.mark.parametrize(
    ("image", "policy", "expected"),
    [
        ("registry.example.com/train:1.0", "Always", "Always"),
        ("registry.example.com/train:latest", None, "Always"),  # the kubelet's default
        ("registry.example.com/train", None, "Always"),
        ("registry.example.com/train:1.0", None, "IfNotPresent"),
        (f"registry.example.com/train@{DIGEST}", None, "IfNotPresent"),
        ("registry.example.com/train:1.0", "Never", "IfNotPresent"),  # never below the config
    ],
)
def test_sidecar_pulled_as_strictly_as_the_pod(image: str, policy: str, expected: str) -> None:
    assert sidecar_policy(image, policy, WebhookConfig()) == expected


def test_a_configured_always_stays_always() -> None:
    config = WebhookConfig(sidecar_image_pull_policy="Always")
    assert sidecar_policy("registry.example.com/train:1.0", "IfNotPresent", config) == "Always"


@pytest.mark.parametrize(
    "image",
    [
        f"registry.example.com:5000/ml/jitckpt-sidecar@{DIGEST}",
        f"ghcr.io/jitckpt/jitckpt-sidecar:0.1.0@{DIGEST}",
        "ghcr.io/jitckpt/jitckpt-sidecar:0.1.0",
    ],
)
def test_sidecar_image_by_digest_is_injected_as_given(image: str) -> None:
    config = WebhookConfig(sidecar_image=image)
    pod = mutate(load_yaml(FIXTURES / "pytorchjob-worker.yaml"), NAMESPACE, config).pod
    (agent,) = [c for c in pod["spec"]["initContainers"] if c["name"] == AGENT]
    assert agent["image"] == image


@pytest.mark.parametrize(
    "image", ["", "a b", "Registry/UPPER:1", "x@sha256:123", "x@md5:" + "c" * 32, "x:"]
)
def test_sidecar_image_must_be_a_reference(image: str) -> None:
    with pytest.raises(ValueError, match="image reference"):
        WebhookConfig(sidecar_image=image)
