"""Kubernetes Events: skipped quietly, logged once, when no API can be reached or used."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from sidecar.events import EventPoster


def _post_three(poster: EventPoster) -> None:
    async def main() -> None:
        for reason in ("Restored", "CheckpointSaved", "CheckpointUploaded"):
            await poster.post(reason, "text", {"step": 1})

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
