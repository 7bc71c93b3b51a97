"""Kubernetes Events: skipped quietly, logged once, when no API can be reached or used."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import ssl
import threading
from pathlib import Path

import pytest

from sidecar.events import EventPoster


def _post_three(poster: EventPoster) -> None:
    async def main() -> None:
        for reason in ("Restored", "CheckpointSaved", "CheckpointUploaded"):
            await poster.post(reason, "text")

    asyncio.run(main())


@pytest.mark.parametrize(
    ("env", "namespace", "expected"),
    [
        ({}, "ns-a", "not running in a cluster"),
        (
            {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1"},
            "ns-a",
            "no in-cluster config",
        ),
        ({}, "", "pod name or namespace unknown"),
    ],
)
def test_events_off_logged_once(
    env: dict[str, str], namespace: str, expected: str, caplog: pytest.LogCaptureFixture
) -> None:
    poster = EventPoster(namespace, "pod-0", env=env)
    with caplog.at_level(logging.INFO, logger="sidecar.events"):
        _post_three(poster)
    lines = [r.getMessage() for r in caplog.records if "Kubernetes Events off" in r.getMessage()]
    assert len(lines) == 1 and expected in lines[0], lines
    assert poster.disabled_reason is not None


def test_unreachable_api_is_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In-cluster config present (token and CA files), but the API server does not answer."""
    from kubernetes.config import incluster_config

    token = tmp_path / "token"
    token.write_text("t0ken")
    ca = tmp_path / "ca.crt"
    ca.write_text("not a certificate\n")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1"}
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "1")
    poster = EventPoster("ns-a", "pod-0", env=env)
    with caplog.at_level(logging.INFO, logger="sidecar.events"):
        _post_three(poster)
    lines = [r.getMessage() for r in caplog.records if "Kubernetes Events off" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "API unreachable" in lines[0] or "API error" in lines[0]


class _ApiServer:
    """A TLS endpoint standing in for the kube-apiserver: records requests, answers a status."""

    def __init__(self, tmp_path: Path, status: int) -> None:
        from webhook.certs import generate

        bundle = generate(["127.0.0.1"])
        (tmp_path / "tls.crt").write_bytes(bundle.cert_pem)
        (tmp_path / "tls.key").write_bytes(bundle.key_pem)
        self.ca = tmp_path / "ca.crt"
        self.ca.write_bytes(bundle.ca_pem)
        self.requests: list[dict[str, object]] = []
        records = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                request = json.loads(self.rfile.read(length) or b"null")
                records.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "type": self.headers.get("Content-Type"),
                        "auth": self.headers.get("Authorization"),
                        "body": request,
                    }
                )
                # Like the API server: the stored object back, or a Status on refusal.
                answer = request if status < 300 else {"kind": "Status", "code": status}
                body = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_PATCH = _answer

            def log_message(self, *args: object) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _in_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: int
) -> tuple[_ApiServer, EventPoster]:
    from kubernetes.config import incluster_config

    api = _ApiServer(tmp_path, status)
    token = tmp_path / "token"
    token.write_text("sa-token")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(api.ca))
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return api, EventPoster("ns-a", "job-1-master-0", env=env)


def test_events_posted_when_permitted_and_nothing_else_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Creating Events is the only API call (the jitckpt-reporter role grants no more)."""
    api, poster = _in_cluster(tmp_path, monkeypatch, 201)
    _post_three(poster)
    api.server.shutdown()
    assert poster.disabled_reason is None
    assert [(r["method"], r["path"]) for r in api.requests] == [
        ("POST", "/api/v1/namespaces/ns-a/events")
    ] * 3
    events = api.requests
    body = events[2]["body"]
    assert isinstance(body, dict)
    assert body["reason"] == "CheckpointUploaded"
    assert body["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "job-1-master-0",
        "namespace": "ns-a",
    }
    assert str(events[0]["auth"]).lower() == "bearer sa-token"


def test_forbidden_is_logged_once_then_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    api, poster = _in_cluster(tmp_path, monkeypatch, 403)
    with caplog.at_level(logging.INFO, logger="sidecar.events"):
        _post_three(poster)
    api.server.shutdown()
    lines = [r.getMessage() for r in caplog.records if "Kubernetes Events off" in r.getMessage()]
    assert len(lines) == 1 and "ClusterRole jitckpt-reporter" in lines[0]
    assert len(api.requests) == 1, "nothing posted after the refusal"
