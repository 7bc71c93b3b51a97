"""The sidecar's Events, posted to a real API server with the pod's own service-account token.

deploy/ ships the ClusterRole ``jitckpt-reporter`` (``create`` on ``events``,
nothing else) for platform teams to bind to a training namespace's service
account. Here the sidecar's ``EventPoster`` connects exactly as in a pod
(in-cluster config: the token file, the cluster CA, ``KUBERNETES_SERVICE_*``),
with a token the API server issued for ``default`` in a namespace of its own:
without the binding the server refuses and the poster says once which role
to bind; with it the Events are stored, on the pod, with the reasons the
sidecar gives; and the role lets that account do nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.config import incluster_config

from local.controlplane.cluster import ControlPlane
from local.controlplane.install import InstalledWebhook, run_kubectl
from local.controlplane.pki import HOST
from sidecar.events import JIT, UPLOADED, EventPoster
from tests.controlplane.kube import Kube

pytestmark = [pytest.mark.xdist_group("controlplane")]

REPORTER = "jitckpt-reporter"  # deploy/base/reporter-clusterrole.yaml
POD = "llama-ft-master-0"
# What the training code sharing the account might try: only the first is granted.
ASKED = [("create", "events"), ("get", "pods"), ("patch", "pods"), ("list", "secrets")]
ASKED += [("delete", "events"), ("get", "events")]


@dataclass
class TrainingNamespace:
    """A namespace of the cluster and the EventPoster its pods' sidecars would make."""

    kube: Kube
    name: str
    poster: EventPoster


@pytest.fixture
def training_namespace(
    control_plane: ControlPlane,
    installed: InstalledWebhook,
    api: client.ApiClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[str, bool], TrainingNamespace]:
    """A new namespace (with the reporter role bound to ``default`` or not) and a poster as
    the sidecar of a pod there makes one: the account's token and the cluster's CA where the
    kubelet mounts them, the API server's address in env."""

    def make(name: str, bound: bool) -> TrainingNamespace:
        kube = Kube(api)
        kube.ensure_namespace({"metadata": {"name": name}})
        if bound:
            run_kubectl(
                control_plane, "-n", name, "create", "rolebinding", REPORTER,
                f"--clusterrole={REPORTER}", f"--serviceaccount={name}:default",
            )  # fmt: skip
        token = run_kubectl(control_plane, "create", "token", "default", "-n", name).strip()
        (tmp_path / "token").write_text(token)
        assert control_plane.pki is not None
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(control_plane.pki.ca))
        env = {
            "KUBERNETES_SERVICE_HOST": HOST,
            "KUBERNETES_SERVICE_PORT": str(control_plane.apiserver_port),
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return TrainingNamespace(kube, name, EventPoster(name, POD, env=env))

    return make


def _post(poster: EventPoster) -> None:
    async def both() -> None:
        await poster.post(UPLOADED, "checkpoint step 50 committed")
        await poster.post(JIT, "JIT checkpoint step 57 committed")

    asyncio.run(both())


def test_events_are_refused_without_the_reporter_binding(
    training_namespace: Callable[[str, bool], TrainingNamespace],
) -> None:
    namespace = training_namespace("events-unbound", False)
    poster = namespace.poster
    _post(poster)
    assert poster.disabled_reason is not None
    assert "not permitted (403)" in poster.disabled_reason
    assert REPORTER in poster.disabled_reason
    assert namespace.kube.core.list_namespaced_event(namespace.name).items == []


def test_events_are_posted_with_the_reporter_binding_and_nothing_more_is_granted(
    control_plane: ControlPlane, training_namespace: Callable[[str, bool], TrainingNamespace]
) -> None:
    namespace = training_namespace("events-bound", True)
    poster = namespace.poster
    _post(poster)
    assert poster.disabled_reason is None
    events = namespace.kube.core.list_namespaced_event(namespace.name).items
    assert sorted(e.reason for e in events) == sorted([UPLOADED, JIT])
    for event in events:
        assert (event.involved_object.kind, event.involved_object.name) == ("Pod", POD)
        assert event.source.component == "jitckpt-agent"
    account = f"system:serviceaccount:{namespace.name}:default"
    for verb, resource in ASKED:
        answer = run_kubectl(
            control_plane, "auth", "can-i", verb, resource, "-n", namespace.name, f"--as={account}",
            check=False,
        ).strip()  # fmt: skip
        assert answer == ("yes" if (verb, resource) == ("create", "events") else "no"), (
            verb,
            resource,
        )
