"""A running injected pod goes on uploading after its S3 Secret is rotated.

The pod is the webhook's output for a PyTorchJob pod, run by the pod runner;
its store checks credentials. Mid-run the Secret's volume is rotated the way
the kubelet does it (a new version, one swap of ``..data``) and the old key is
deleted: from then on the store accepts only the new key, and the sidecar's
next uploads must use it, without a restart.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from local.podrunner import Node, ObjectStore, Pod
from local.s3server import LocalS3
from shim import layout, protocol
from shim.channel import Client
from tests.sidecar import shimtalk
from tests.sidecar.helpers import stage
from tests.support.iamstore import IamStore
from tests.webhook.golden import load_yaml
from tests.webhook.server_support import FIXTURES
from webhook.config import WebhookConfig
from webhook.mutate import MutationResult, NamespaceInfo, mutate
from webhook.status import VOL_LOCAL, VOL_RUN

SECRET = "ckpt-s3"
TRAINER_READY = "trainer: SIGTERM handler in place"


def injected_pod(bucket: str) -> dict[str, Any]:
    result = injected_by(
        {"jitckpt.io/destination": f"s3://{bucket}/runs", "jitckpt.io/s3-secret": SECRET}
    )
    assert result.injected, result.message
    result.pod["spec"]["terminationGracePeriodSeconds"] = 20
    return result.pod


def injected_by(annotations: dict[str, str]) -> MutationResult:
    """The fixture's PyTorchJob pod with a trainer that waits for SIGTERM, injected for a
    namespace with ``annotations``."""
    pod = load_yaml(FIXTURES / "pytorchjob-master.yaml")
    (trainer,) = pod["spec"]["containers"]
    # PID 1 of its container: the kernel drops SIGTERM for it until it has a
    # handler, so it says when the handler is in place, and stops on SIGTERM as a trainer does.
    stop = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))"
    ready = f"print({TRAINER_READY!r}, flush=True)"
    trainer["command"] = ["python", "-c", f"{stop}; {ready}; time.sleep(600)"]
    trainer.pop("args", None)
    return mutate(pod, team_a(annotations), WebhookConfig())


def team_a(annotations: dict[str, str]) -> NamespaceInfo:
    return NamespaceInfo("team-a", {"jitckpt.io/injection": "enabled"}, annotations)


def status(pod: Pod) -> dict[str, Any]:
    url = f"http://{pod.ip}:{layout.STATUS_PORT}/status"
    with urllib.request.urlopen(url, timeout=5) as answer:
        document: dict[str, Any] = json.loads(answer.read())
    return document


def trainer_ready(pod: Pod) -> bool:
    """The trainer started (after the sidecar's startupProbe passed) and has its handler."""
    try:
        log = pod.container("pytorch").log_path
    except KeyError:
        return False  # not started yet
    return TRAINER_READY in log.read_text()


def wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_uploads_go_on_after_the_kubelet_rotates_the_secret(tmp_path: Path) -> None:
    with LocalS3() as server:
        store = IamStore(server)
        first = store.new_key()
        node = Node(
            root=tmp_path / "node",
            objects=ObjectStore(secrets={SECRET: store.data_connection(first)}),
        )
        pod = Pod(node, injected_pod(store.bucket)).start()
        try:
            wait(lambda: status(pod)["phase"] == "ready", 120, "the sidecar to be ready")
            assert status(pod)["identity"]["kind"] == "s3-secret"
            run_dir, local_dir = pod.volume_path(VOL_RUN), pod.volume_path(VOL_LOCAL)
            assert run_dir is not None and local_dir is not None
            client = Client(str(run_dir / "agent.sock"))
            client.call(shimtalk.hello(4242))

            def upload(step: int) -> None:
                name = f"checkpoint-{step}-periodic-1"
                _, names = stage(local_dir / layout.STAGING_SUBDIR, name, {"w.bin": 4096})
                inside = Path(layout.LOCAL_DIR) / layout.STAGING_SUBDIR / name
                answer = client.call(shimtalk.staged(step, "periodic", inside, names))
                assert isinstance(answer, protocol.StagedAnswer), answer
                wait(
                    lambda: (status(pod)["last_committed"] or {}).get("step") == step,
                    60,
                    f"checkpoint-{step} committed",
                )

            upload(10)
            second = store.new_key()
            assert pod.update_secret(SECRET, store.data_connection(second)) == 1
            store.iam.delete_access_key(UserName="trainer", AccessKeyId=first[0])
            assert not store.accepts(first) and store.accepts(second)
            upload(20)
            client.close()
            wait(lambda: trainer_ready(pod), 120, "the trainer's SIGTERM handler")
        finally:
            pod.terminate()
            result = pod.wait(60)
        assert result.containers["pytorch"].exit_code == 143
        assert result.init_containers["jitckpt-agent"].exit_code == 0, result.message(
            "jitckpt-agent"
        )
        assert "last committed checkpoint: step 20" in result.message("jitckpt-agent")


@pytest.mark.slow
def test_a_namespace_without_credentials_starts_its_pods_and_says_why(tmp_path: Path) -> None:
    """The deploy/README example as it was: a destination and no s3-secret. Before, the
    sidecar exited, its startupProbe never passed and the trainer never started. Now the
    webhook marks the pod and warns at admission, the trainer starts, and the sidecar's
    /status and termination message say it runs unprotected."""
    from webhook.drift import audit_pod

    annotations = {"jitckpt.io/destination": "s3://ml-checkpoints/runs"}
    result = injected_by(annotations)
    assert result.injected, result.message
    mark = result.pod["metadata"]["annotations"]["jitckpt.io/reason"]
    assert mark.startswith("no-credentials: ") and mark in result.warnings
    row = audit_pod(result.pod, team_a(annotations), WebhookConfig())
    assert row.reason == mark and row.drift == [], row
    spec = result.pod
    spec["spec"]["terminationGracePeriodSeconds"] = 20
    node = Node(root=tmp_path / "node", objects=ObjectStore())
    started = Pod(node, spec).start()
    try:
        wait(lambda: trainer_ready(started), 120, "the trainer to start")
        document = status(started)
        assert document["phase"] == "unprotected"
        assert "no credentials for the store" in document["unprotected"]
        # the trainer runs as without jitckpt: no shim was left for it to load
        shim = started.volume_path("jitckpt-shim")
        assert shim is not None and not list(shim.rglob("*.py"))
    finally:
        started.terminate()
        finished = started.wait(60)
    assert finished.containers["pytorch"].exit_code == 143
    assert finished.init_containers["jitckpt-agent"].exit_code == 0
    message = finished.message("jitckpt-agent")
    assert "UNPROTECTED" in message and "no credentials for the store" in message
