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
from pathlib import Path

import pytest
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


def _poster(
    cluster: ControlPlane,
    namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> EventPoster:
    """An EventPoster as the sidecar of a pod in ``namespace`` makes one: its service account's
    token and the cluster's CA where the kubelet mounts them, the API server's address in env."""
    token = run_kubectl(cluster, "create", "token", "default", "-n", namespace).strip()
    (tmp_path / "token").write_text(token)
    assert cluster.pki is not None
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(cluster.pki.ca))
    env = {
        "KUBERNETES_SERVICE_HOST": HOST,
        "KUBERNETES_SERVICE_PORT": str(cluster.apiserver_port),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return EventPoster(namespace, POD, env=env)


def _namespace(kube: Kube, name: str) -> str:
    kube.ensure_namespace({"metadata": {"name": name}})
    return name


def _post(poster: EventPoster) -> None:
    async def both() -> None:
        await poster.post(UPLOADED, "checkpoint step 50 committed")
        await poster.post(JIT, "JIT checkpoint step 57 committed")

    asyncio.run(both())


def test_events_are_refused_without_the_reporter_binding(
    control_plane: ControlPlane,
    installed: InstalledWebhook,
    api: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kube = Kube(api)  # type: ignore[arg-type]
    namespace = _namespace(kube, "events-unbound")
    poster = _poster(control_plane, namespace, tmp_path, monkeypatch)
    _post(poster)
    assert poster.disabled_reason is not None
    assert "not permitted (403)" in poster.disabled_reason
    assert REPORTER in poster.disabled_reason
    assert kube.core.list_namespaced_event(namespace).items == []


def test_events_are_posted_with_the_reporter_binding_and_nothing_more_is_granted(
    control_plane: ControlPlane,
    installed: InstalledWebhook,
    api: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kube = Kube(api)  # type: ignore[arg-type]
    namespace = _namespace(kube, "events-bound")
    run_kubectl(
        control_plane, "-n", namespace, "create", "rolebinding", REPORTER,
        f"--clusterrole={REPORTER}", f"--serviceaccount={namespace}:default",
    )  # fmt: skip
    poster = _poster(control_plane, namespace, tmp_path, monkeypatch)
    _post(poster)
    assert poster.disabled_reason is None
    events = kube.core.list_namespaced_event(namespace).items
    assert sorted(e.reason for e in events) == sorted([UPLOADED, JIT])
    for event in events:
        assert (event.involved_object.kind, event.involved_object.name) == ("Pod", POD)
        assert event.source.component == "jitckpt-agent"
    account = f"system:serviceaccount:{namespace}:default"
    for verb, resource in ASKED:
        answer = run_kubectl(
            control_plane, "auth", "can-i", verb, resource, "-n", namespace, f"--as={account}",
            check=False,
        ).strip()  # fmt: skip
        assert answer == ("yes" if (verb, resource) == ("create", "events") else "no"), (
            verb,
            resource,
        )
