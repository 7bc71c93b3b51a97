"""Events on the job of a pod admitted without protection, through the real kubernetes
client against a local HTTP server that records what the webhook asks of the API."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fastapi.testclient import TestClient
from kubernetes import client as kube

from tests.webhook.server_support import admission_review, check_answer, fixture
from webhook.config import WebhookConfig
from webhook.events import AdmissionEvents
from webhook.mutate import NamespaceInfo
from webhook.namespaces import NamespaceCache
from webhook.server import create_app

OWNER = {
    "apiVersion": "kubeflow.org/v1",
    "kind": "PyTorchJob",
    "name": "bert-ft",
    "uid": "6f1c1ab0-0d6e-4b43-9d0e-2b1c3c4d5e6f",
    "controller": True,
    "blockOwnerDeletion": True,
}


class EventsApi:
    """Answers every request with ``status`` and records (method, path, body)."""

    def __init__(self, status: int) -> None:
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        self.posted = threading.Condition()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with api.posted:
                    api.requests.append((self.command, self.path, body))
                    api.posted.notify_all()
                answer = json.dumps(body if status < 300 else {"kind": "Status", "code": status})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer.encode())

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def core(self) -> Any:
        configuration = kube.Configuration()
        configuration.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        return kube.CoreV1Api(kube.ApiClient(configuration))


@pytest.fixture
def api() -> Iterator[EventsApi]:
    server = EventsApi(201)
    yield server
    server.server.shutdown()


def namespace(**annotations: str) -> NamespaceCache:
    cache = NamespaceCache()
    cache.replace_all([NamespaceInfo("team-a", {"jitckpt.io/injection": "enabled"}, annotations)])
    return cache


def trainer_pod(index: int, **spec: Any) -> dict[str, Any]:
    pod = fixture("pytorchjob-worker.yaml")
    pod["metadata"]["name"] = f"bert-ft-worker-{index}"
    pod["metadata"]["ownerReferences"] = [OWNER]
    pod["spec"].update(spec)
    return pod


def admit(app_client: TestClient, pod: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
    review = admission_review(pod, namespace="team-a")
    review["request"]["dryRun"] = dry_run
    answer = app_client.post("/mutate", json=review)
    return check_answer(answer.json(), review["request"]["uid"])


def test_a_skipped_job_gets_one_event_on_its_owner_and_none_for_a_dry_run(
    api: EventsApi,
) -> None:
    """Before, a skip was only an admission warning, which the job's controller got."""
    events = AdmissionEvents(api.core())
    cache = namespace(**{"jitckpt.io/destination": "s3://ml-checkpoints"})
    with TestClient(create_app(WebhookConfig(), cache, events=events)) as app_client:
        admit(app_client, trainer_pod(9, hostNetwork=True), dry_run=True)
        for index in range(3):  # three pods of one job: one Event
            admit(app_client, trainer_pod(index, hostNetwork=True))
        app_client.portal.call(events.settle)
    ((method, path, body),) = api.requests
    assert (method, path) == ("POST", "/api/v1/namespaces/team-a/events")
    assert body["type"] == "Warning" and body["reason"] == "NotInjected"
    assert body["message"].startswith("host-network: hostNetwork pods are not injected")
    assert body["involvedObject"] == {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "name": "bert-ft",
        "namespace": "team-a",
        "uid": OWNER["uid"],
    }


def test_a_job_without_credentials_is_told_at_its_first_admission(api: EventsApi) -> None:
    events = AdmissionEvents(api.core())
    cache = namespace(**{"jitckpt.io/destination": "s3://ml-checkpoints"})
    with TestClient(create_app(WebhookConfig(), cache, events=events)) as app_client:
        answer = admit(app_client, trainer_pod(0))
        app_client.portal.call(events.settle)
    assert "patch" in answer
    assert any(w.startswith("no-credentials: ") for w in answer["warnings"])
    ((_, _, body),) = api.requests
    assert body["reason"] == "NoStoreCredentials" and body["type"] == "Warning"
    assert "jitckpt.io/s3-secret" in body["message"]
    assert body["involvedObject"]["uid"] == OWNER["uid"]


def test_injected_pods_post_nothing_and_a_forbidden_post_turns_events_off() -> None:
    forbidden = EventsApi(403)
    try:
        events = AdmissionEvents(forbidden.core())
        cache = namespace(
            **{"jitckpt.io/destination": "s3://ml-checkpoints", "jitckpt.io/s3-secret": "s3"}
        )
        with TestClient(create_app(WebhookConfig(), cache, events=events)) as app_client:
            assert "patch" in admit(app_client, trainer_pod(0))
            app_client.portal.call(events.settle)
            assert forbidden.requests == []
            admit(app_client, trainer_pod(1, hostNetwork=True))
            app_client.portal.call(events.settle)
            assert events.disabled_reason is not None and "events: create" in events.disabled_reason
            admit(app_client, trainer_pod(2, shareProcessNamespace=True))
            app_client.portal.call(events.settle)
        assert len(forbidden.requests) == 1
    finally:
        forbidden.server.shutdown()
