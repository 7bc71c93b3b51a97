"""Helpers shared by the server tests: AdmissionReviews, answers, a served subprocess."""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from local.ports import free_port
from webhook.mutate import NamespaceInfo
from webhook.namespaces import NamespaceCache

FIXTURES = Path(__file__).parent / "testdata" / "fixtures"
REPO = Path(__file__).resolve().parents[2]
# The console script of the environment running the tests.
JITCKPT = str(Path(sys.executable).with_name("jitckpt"))


def fixture(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((FIXTURES / name).read_text())
    return doc


def admission_review(
    pod: dict[str, Any],
    *,
    namespace: str | None = None,
    uid: str | None = None,
    operation: str = "CREATE",
) -> dict[str, Any]:
    """The AdmissionReview the API server sends for a pod CREATE."""
    ns = namespace or pod.get("metadata", {}).get("namespace", "default")
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid or str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod.get("metadata", {}).get("name", ""),
            "namespace": ns,
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kubeflow:training-operator"},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def check_answer(doc: Any, uid: str | None) -> dict[str, Any]:
    """Assert ``doc`` is a well-formed AdmissionReview answer; return its response."""
    assert isinstance(doc, dict), doc
    assert doc.get("apiVersion") == "admission.k8s.io/v1", doc
    assert doc.get("kind") == "AdmissionReview", doc
    response = doc["response"]
    assert isinstance(response, dict)
    assert isinstance(response["allowed"], bool)
    assert response["uid"] == (uid or ""), (response["uid"], uid)
    assert set(response) <= {
        "uid",
        "allowed",
        "patch",
        "patchType",
        "warnings",
        "auditAnnotations",
        "status",
    }, response
    if "patch" in response:
        assert response["patchType"] == "JSONPatch"
        ops = json.loads(base64.b64decode(response["patch"], validate=True))
        assert isinstance(ops, list) and ops
    for warning in response.get("warnings", []):
        assert isinstance(warning, str) and warning
        assert "\n" not in warning and len(warning) <= 1024
    if not response["allowed"]:
        assert response["status"]["message"], response
    return response


def patched(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """The pod after the answer's JSONPatch, as the API server would apply it."""
    if "patch" not in response:
        return pod
    ops = json.loads(base64.b64decode(response["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(pod, ops)
    return result


def marked_reason(pod: dict[str, Any], response: dict[str, Any]) -> str:
    """The skip reason the answer marks the pod with (``jitckpt.io/reason``), checking
    that the mark is all its patch changes."""
    after = patched(copy.deepcopy(pod), response)
    annotations = dict(after["metadata"].get("annotations") or {})
    mark = annotations.pop("jitckpt.io/reason")
    before = copy.deepcopy(pod)
    if annotations:
        after["metadata"]["annotations"] = annotations
    else:
        after["metadata"].pop("annotations")
    before["metadata"].setdefault("annotations", {}).pop("jitckpt.io/reason", None)
    if not before["metadata"]["annotations"]:
        before["metadata"].pop("annotations")
    assert after == before, "the answer changes more than the reason annotation"
    reason: str = mark.split(": ", 1)[0]
    return reason


def jitckpt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [JITCKPT, *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )


@dataclass
class Served:
    """A running ``jitckpt webhook serve`` subprocess."""

    proc: subprocess.Popen[str]
    url: str
    log_path: Path

    def log_lines(self) -> list[dict[str, Any]]:
        """The server's stderr so far, each line parsed as JSON (fails on any other line)."""
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line]


@contextmanager
def serve(
    cert_dir: Path, tmp: Path, *extra: str, kubeconfig: Path | None = None
) -> Iterator[Served]:
    """Start the server on a free port and wait for /healthz.

    Without ``kubeconfig`` no Kubernetes API is reachable (no in-cluster
    environment, a kubeconfig path that does not exist).
    """
    port = free_port()
    env = dict(os.environ)
    env.pop("KUBERNETES_SERVICE_HOST", None)
    env["KUBECONFIG"] = str(kubeconfig or tmp / "no-such-kubeconfig")
    env["HOME"] = str(tmp)
    log_path = tmp / f"serve-{port}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                JITCKPT,
                "webhook",
                "serve",
                "--cert-dir",
                str(cert_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=env,
        )
    served = Served(proc, f"https://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                httpx.get(served.url + "/healthz", verify=False, timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield served
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# The in-process app's helpers (fastapi's TestClient against create_app).
TEAM_A = NamespaceInfo(
    name="team-a",
    labels=fixture("namespace-team-a.yaml")["metadata"]["labels"],
    annotations=fixture("namespace-team-a.yaml")["metadata"]["annotations"],
)


def cache_with(*infos: NamespaceInfo) -> NamespaceCache:
    cache = NamespaceCache()
    cache.replace_all(infos)
    return cache


def post(client: TestClient, pod: dict[str, Any], **kw: Any) -> dict[str, Any]:
    review = admission_review(pod, **kw)
    answer = client.post("/mutate", json=review)
    assert answer.status_code == 200, answer.text
    return check_answer(answer.json(), review["request"]["uid"])


def metric(client: TestClient, name: str, **labels: str) -> float:
    text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0
