"""The admission app in-process: answers, namespace cache, metrics, health, logs."""

from __future__ import annotations

import copy
import io
import json
import logging
import threading
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.webhook.server_support import (
    TEAM_A,
    cache_with,
    fixture,
    marked_reason,
    metric,
    patched,
    post,
)
from webhook.config import WebhookConfig
from webhook.jsonlog import configure_logging
from webhook.mutate import NamespaceInfo, mutate
from webhook.namespaces import NamespaceCache
from webhook.server import create_app


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(WebhookConfig(), cache_with(TEAM_A))) as c:
        yield c


def test_injection_answer_matches_mutate_and_carries_audit_annotations(client: TestClient) -> None:
    pod = fixture("pytorchjob-master.yaml")
    response = post(client, pod)
    expected = mutate(copy.deepcopy(pod), TEAM_A, WebhookConfig())
    assert expected.injected
    assert patched(pod, response) == expected.pod
    assert response["auditAnnotations"] == expected.audit_annotations
    assert metric(client, "jitckpt_webhook_injected_total") == 1
    assert metric(client, "jitckpt_webhook_requests_total") == 1
    assert metric(client, "jitckpt_webhook_request_duration_seconds_count") == 1
    # Reinvocation (reinvocationPolicy: IfNeeded) sees the injected pod: no second patch.
    again = post(client, patched(pod, response))
    assert "patch" not in again and "warnings" not in again
    assert metric(client, "jitckpt_webhook_skipped_total", reason="already-injected") == 1


def test_skip_reasons_are_counted_and_explained(client: TestClient) -> None:
    initializer = post(client, fixture("trainjob-dataset-initializer.yaml"), namespace="team-a")
    assert "patch" not in initializer and "warnings" not in initializer  # normal: no noise

    opted_out = fixture("pytorchjob-worker.yaml")
    opted_out["metadata"]["namespace"] = "team-a"
    opted_out["metadata"].setdefault("annotations", {})["jitckpt.io/inject"] = "false"
    response = post(client, opted_out)
    assert "opted out" in response["warnings"][0]
    assert marked_reason(opted_out, response) == "opted-out"

    bad = fixture("pytorchjob-master.yaml")
    bad["metadata"]["annotations"]["jitckpt.io/grace-period-seconds"] = "soon"
    response = post(client, bad)
    assert response["allowed"] is True and marked_reason(bad, response) == "invalid-setting"
    assert len(response["warnings"]) == 2
    assert "pod admitted without checkpointing" in response["warnings"][0]
    assert response["warnings"][1].startswith('jitckpt.io/grace-period-seconds="soon"')
    assert "must be an integer" in response["warnings"][1]

    assert metric(client, "jitckpt_webhook_skipped_total", reason="not-trainer") == 1
    assert metric(client, "jitckpt_webhook_skipped_total", reason="opted-out") == 1
    assert metric(client, "jitckpt_webhook_skipped_total", reason="invalid-setting") == 1
    assert metric(client, "jitckpt_webhook_injected_total") == 0


def test_invalid_setting_is_denied_when_the_config_says_deny() -> None:
    app = create_app(WebhookConfig(invalid_setting_policy="deny"), cache_with(TEAM_A))
    with TestClient(app) as client:
        pod = fixture("pytorchjob-master.yaml")
        pod["metadata"]["annotations"]["jitckpt.io/destination"] = "s3://Bad_Bucket/x"
        response = post(client, pod)
        assert response["allowed"] is False
        assert response["status"]["code"] == 403
        assert "jitckpt.io/destination" in response["status"]["message"]
        assert metric(client, "jitckpt_webhook_denied_total") == 1


def test_namespace_label_removed_from_cache_means_not_injected() -> None:
    removed = NamespaceInfo(name="team-a", labels={}, annotations=dict(TEAM_A.annotations))
    with TestClient(create_app(WebhookConfig(), cache_with(removed))) as client:
        pod = fixture("pytorchjob-master.yaml")
        response = post(client, pod)
        assert marked_reason(pod, response) == "not-opted-in"
        assert metric(client, "jitckpt_webhook_skipped_total", reason="not-opted-in") == 1


def test_unknown_namespace_waits_for_the_watch_then_admits_unchanged() -> None:
    cache = cache_with()
    app = create_app(WebhookConfig(), cache, namespace_wait_seconds=0.3)
    with TestClient(app) as client:
        started = time.monotonic()
        pod = fixture("pytorchjob-master.yaml")
        response = post(client, pod)
        assert time.monotonic() - started >= 0.3
        assert "not known" in response["warnings"][0]
        assert marked_reason(pod, response) == "namespace-unknown"
        assert metric(client, "jitckpt_webhook_skipped_total", reason="namespace-unknown") == 1

    # A namespace the watch delivers while a request waits is used at once.
    patient = create_app(WebhookConfig(), cache, namespace_wait_seconds=10)
    with TestClient(patient) as client:
        timer = threading.Timer(0.1, cache.upsert, args=(TEAM_A,))
        timer.start()
        try:
            started = time.monotonic()
            response = post(client, fixture("pytorchjob-master.yaml"))
            assert "patch" in response
            assert time.monotonic() - started < 5  # woken by the upsert, not the timeout
        finally:
            timer.cancel()


def test_without_kubernetes_api_config_defaults_alone_apply() -> None:
    config = WebhookConfig(defaults={"destination": "s3://cluster-bucket/ckpt"})
    with TestClient(create_app(config, None)) as client:
        pod = fixture("pytorchjob-master.yaml")
        injected = patched(pod, post(client, pod))
        agent = next(c for c in injected["spec"]["initContainers"] if c["name"] == "jitckpt-agent")
        env = {e["name"]: e.get("value") for e in agent["env"]}
        # The namespace's s3://ml-checkpoints/team-a is unknown without the API.
        assert env["JITCKPT_DESTINATION"] == "s3://cluster-bucket/ckpt/team-a/bert-ft"
        assert client.get("/readyz").status_code == 200


def test_health_and_readiness_follow_the_cache() -> None:
    cache = NamespaceCache()
    with TestClient(create_app(WebhookConfig(), cache)) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 503
        cache.replace_all([TEAM_A])
        assert client.get("/readyz").json() == {"ready": True}
        assert client.get("/docs").status_code == 404  # no API browser on a webhook


def test_each_admission_logs_one_json_line(client: TestClient) -> None:
    stream = io.StringIO()
    configure_logging("info", stream)
    try:
        response = post(client, fixture("pytorchjob-master.yaml"), uid="uid-for-log")
        assert "patch" in response
    finally:
        logging.getLogger().handlers.clear()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    injected = [line for line in lines if line["msg"] == "injected"]
    assert len(injected) == 1
    assert injected[0]["uid"] == "uid-for-log" and injected[0]["namespace"] == "team-a"
    assert injected[0]["pod"] == "bert-ft-master-0"


class BrokenCache(NamespaceCache):
    """Fault injection: a namespace lookup that raises, as a bug of ours would."""

    def get(self, name: str) -> NamespaceInfo | None:
        raise RuntimeError("bug")


def test_an_internal_error_admits_unchanged_without_a_stack_trace() -> None:
    cache = BrokenCache()
    cache.replace_all([TEAM_A])
    with TestClient(create_app(WebhookConfig(), cache)) as client:
        response = post(client, fixture("pytorchjob-master.yaml"))
        assert response["allowed"] is True and "patch" not in response
        assert response["warnings"] == [
            "jitckpt: internal error while injecting; pod admitted unchanged"
        ]
        assert metric(client, "jitckpt_webhook_failed_total", reason="internal") == 1
