"""Kubelet probes: httpGet, tcpSocket and exec, with the spec's timing fields.

A startupProbe gates the containers after a native sidecar, so its timing is
what decides when a trainer starts; the defaults are the kubelet's.
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from local.podrunner.container import Container


@dataclass(frozen=True)
class ProbeOutcome:
    passed: bool
    attempts: int
    detail: str
    seconds: float


def _port(value: Any, container: Mapping[str, Any]) -> int:
    """A probe port: a number, or the name of one of the container's ports."""
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container.get("ports") or []:
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"probe names port {value!r}, which the container does not declare")


def _http_get(
    action: Mapping[str, Any], spec: Mapping[str, Any], pod_ip: str, timeout: float
) -> str | None:
    host = str(action.get("host") or pod_ip)
    port = _port(action.get("port"), spec)
    scheme = str(action.get("scheme", "HTTP")).upper()
    conn: http.client.HTTPConnection
    if scheme == "HTTPS":
        import ssl

        context = ssl._create_unverified_context()  # the kubelet does not verify probe certs
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
    try:
        conn.request("GET", str(action.get("path", "/")), headers=headers)
        status = conn.getresponse().status
    except OSError as exc:
        return f"GET {host}:{port}: {exc}"
    finally:
        conn.close()
    return None if 200 <= status < 400 else f"GET {host}:{port} answered {status}"


def _tcp(
    action: Mapping[str, Any], spec: Mapping[str, Any], pod_ip: str, timeout: float
) -> str | None:
    host, port = str(action.get("host") or pod_ip), _port(action.get("port"), spec)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"connect {host}:{port}: {exc}"


def check_once(
    probe: Mapping[str, Any], spec: Mapping[str, Any], container: Container, pod_ip: str
) -> str | None:
    """One probe attempt: None when it passes, else why it failed."""
    timeout = float(probe.get("timeoutSeconds", 1))
    if "httpGet" in probe:
        return _http_get(probe["httpGet"], spec, pod_ip, timeout)
    if "tcpSocket" in probe:
        return _tcp(probe["tcpSocket"], spec, pod_ip, timeout)
    if "exec" in probe:
        result = container.exec(probe["exec"]["command"], timeout)
        return (
            None
            if result.exit_code == 0
            else f"exec exited {result.exit_code}: {result.output[-200:]}"
        )
    raise ValueError(f"unsupported probe handler {sorted(probe)}")


def run_startup_probe(
    probe: Mapping[str, Any],
    spec: Mapping[str, Any],
    container: Container,
    pod_ip: str,
    cancelled: Callable[[], bool],
) -> ProbeOutcome:
    """Probe until success, ``failureThreshold`` failures, the container exiting, or cancel."""
    start = time.monotonic()
    period = float(probe.get("periodSeconds", 10))
    threshold = int(probe.get("failureThreshold", 3))
    time.sleep(float(probe.get("initialDelaySeconds", 0)))
    failures, attempts, detail = 0, 0, ""
    while True:
        if cancelled():
            return ProbeOutcome(False, attempts, "pod is terminating", time.monotonic() - start)
        if not container.running:
            return ProbeOutcome(False, attempts, "container exited", time.monotonic() - start)
        attempts += 1
        error = check_once(probe, spec, container, pod_ip)
        if error is None:
            return ProbeOutcome(True, attempts, "passed", time.monotonic() - start)
        failures, detail = failures + 1, error
        if failures >= threshold:
            return ProbeOutcome(False, attempts, detail, time.monotonic() - start)
        next_at = time.monotonic() + period
        while time.monotonic() < next_at and container.running and not cancelled():
            time.sleep(min(0.05, period))
