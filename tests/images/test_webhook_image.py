"""The webhook image's own command, from its root, answers an AdmissionReview over TLS.

A pod of the built image run by the local pod runner from the image root
(``Node.image_roots``): the image's ENTRYPOINT and CMD, its USER, a read-only
root as the Deployment asks, and the serving certificate from a Secret volume.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from local.podrunner import Node, ObjectStore, Pod
from local.podrunner.image import ImageRoot
from tests.images.support import written_to_root
from tests.webhook.server_support import admission_review, check_answer, fixture, jitckpt, patched

IMAGE = "registry.example.com/ml/jitckpt-webhook:0.1.0"
CERTS = "/etc/jitckpt/certs"


def manifest(read_only: bool) -> dict[str, Any]:
    """The Deployment's container as far as the image is concerned: no command, no user."""
    context = {
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": read_only,
        "allowPrivilegeEscalation": False,
    }
    container = {
        "name": "webhook",
        "image": IMAGE,
        "ports": [{"containerPort": 8443}],
        "securityContext": context,
        "volumeMounts": [{"name": "certs", "mountPath": CERTS, "readOnly": True}],
    }
    volumes = [{"name": "certs", "secret": {"secretName": "webhook-certs"}}]
    return {
        "metadata": {"name": "webhook", "namespace": "jitckpt-system"},
        "spec": {"containers": [container], "volumes": volumes},
    }


@contextmanager
def serving(
    image: ImageRoot, tmp_path: Path, read_only: bool
) -> Iterator[tuple[Pod, httpx.Client]]:
    """The webhook pod, started, and a client that trusts only its CA once it is ready."""
    node = Node(root=tmp_path / "node", objects=ObjectStore(), image_roots={IMAGE: image})
    pod = Pod(node, manifest(read_only))
    certs = tmp_path / "certs"
    jitckpt("webhook", "certs", "--out", str(certs), "--dns", pod.ip)
    node.objects.secrets["webhook-certs"] = {
        name: (certs / name).read_text() for name in ("tls.crt", "tls.key")
    }
    pod.start()
    verify = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    try:
        with httpx.Client(base_url=f"https://{pod.ip}:8443", verify=verify, timeout=10) as client:
            deadline = time.monotonic() + 120
            while True:
                assert not pod.done, (pod.wait().reason, pod.events)
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the webhook never became ready"
                time.sleep(0.2)
            yield pod, client
    finally:
        pod.terminate(5)
        pod.wait(30)


def mutate(client: httpx.Client) -> dict[str, Any]:
    pod = fixture("pytorchjob-master.yaml")
    pod["metadata"]["annotations"]["jitckpt.io/destination"] = "s3://bucket/prefix"
    review = admission_review(pod)
    answer = client.post("/mutate", json=review)
    assert answer.status_code == 200
    response = check_answer(answer.json(), review["request"]["uid"])
    assert response["allowed"] is True
    return patched(pod, response)


def uids(pid: int) -> list[int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    (line,) = [entry for entry in status if entry.startswith("Uid:")]
    return [int(field) for field in line.split()[1:]]


def test_serves_an_admission_review_as_its_user_on_a_read_only_root(
    webhook_image: ImageRoot, tmp_path: Path
) -> None:
    with serving(webhook_image, tmp_path, read_only=True) as (pod, client):
        injected = mutate(client)
        assert "jitckpt-agent" in [c["name"] for c in injected["spec"]["initContainers"]]
        container = pod.container("webhook")
        pid = container._init_pid
        assert pid is not None
        assert uids(pid) == [65532] * 4, "the image's USER, with no runAsUser in the spec"
        assert Path(f"/proc/{pid}/root").resolve() != Path("/")
        probe = container.exec(["python", "-c", "open('/written', 'w')"], timeout=30)
        assert probe.exit_code != 0 and "Read-only file system" in probe.output


def test_writes_nothing_to_its_root(webhook_image: ImageRoot, tmp_path: Path) -> None:
    """With a writable root, whatever it writes lands in the overlay: nothing may."""
    with serving(webhook_image, tmp_path, read_only=False) as (_, client):
        mutate(client)
    (scratch,) = (tmp_path / "node" / "pods").glob("*/containers/webhook/root/upper")
    assert written_to_root(scratch, {CERTS.lstrip("/")}) == set()
