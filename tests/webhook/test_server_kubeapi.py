"""The namespace watch and the self-signed install, with the real kubernetes client.

The API side is ``kubeapi_stub`` (no kube-apiserver runs here). Covered: list
then watch, ADDED/MODIFIED/DELETED, re-list after ``410 Gone``, backoff over
failing lists; the shared certificate Secret (created once, reused, and the
creation race between replicas) and the caBundle patch; and the whole
``jitckpt webhook serve --self-signed`` started against a kubeconfig.
"""

from __future__ import annotations

import base64
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from kubernetes import client

from tests.webhook.kubeapi_stub import KubeAPIStub, kubeconfig, namespace, serve
from tests.webhook.server_support import (
    REPO,
    admission_review,
    check_answer,
    fixture,
    patched,
)
from tests.webhook.server_support import serve as serve_webhook
from webhook.certs import generate, read_bundle
from webhook.namespaces import NamespaceCache, NamespaceWatcher
from webhook.selfsigned import install, service_dns_names

OPTED_IN = {"jitckpt.io/injection": "enabled"}


def eventually(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def stub() -> KubeAPIStub:
    return KubeAPIStub()


@pytest.fixture
def api(stub: KubeAPIStub) -> Iterator[client.ApiClient]:
    with serve(stub) as url:
        configuration = client.Configuration()
        configuration.host = url
        yield client.ApiClient(configuration)


def test_watch_keeps_the_cache_in_step(stub: KubeAPIStub, api: client.ApiClient) -> None:
    stub.put_namespace(namespace("team-a", OPTED_IN, **{"jitckpt.io/destination": "s3://a/p"}))
    stub.put_namespace(namespace("kube-system"))
    stub.fail_lists = 2  # the API server is not answering yet
    cache = NamespaceCache()
    # A long resync: changes must arrive through watch events, not periodic re-lists.
    watcher = NamespaceWatcher(api, cache, resync_seconds=60, backoff_initial=0.05)
    watcher.start()
    try:
        eventually(lambda: cache.synced)
        assert stub.fail_lists == 0
        team_a = cache.get("team-a")
        assert team_a is not None and team_a.labels == OPTED_IN
        assert team_a.annotations == {"jitckpt.io/destination": "s3://a/p"}

        lists = stub.lists
        stub.put_namespace(namespace("team-b", OPTED_IN))
        eventually(lambda: cache.get("team-b") is not None, timeout=5)
        stub.put_namespace(namespace("team-a", {}))
        eventually(lambda: cache.get("team-a").labels == {})  # type: ignore[union-attr]
        stub.delete_namespace("team-b")
        eventually(lambda: cache.get("team-b") is None)
        assert stub.lists == lists  # delivered by watch events, not by a re-list

        # A change the watch never reports is picked up by the re-list after 410 Gone.
        stub.put_namespace(namespace("team-c", OPTED_IN), silently=True)
        time.sleep(0.2)
        assert cache.get("team-c") is None
        lists_before = stub.lists
        stub.expire()
        eventually(lambda: cache.get("team-c") is not None)
        assert stub.lists > lists_before
    finally:
        watcher.stop()


def test_self_signed_install_shares_one_certificate(
    stub: KubeAPIStub, api: client.ApiClient, tmp_path: Path
) -> None:
    mwc = yaml.safe_load((REPO / "deploy/base/mutatingwebhookconfiguration.yaml").read_text())
    stub.hooks["jitckpt-webhook"] = mwc
    kwargs = {
        "service": "jitckpt-webhook.jitckpt-system",
        "secret_name": "jitckpt-webhook-tls",
        "webhook_config_name": "jitckpt-webhook",
    }
    first = install(api, tmp_path / "replica-1", **kwargs)
    second = install(api, tmp_path / "replica-2", **kwargs)
    assert first == second == read_bundle(tmp_path / "replica-2")
    assert list(stub.secrets) == [("jitckpt-system", "jitckpt-webhook-tls")]
    published = stub.hooks["jitckpt-webhook"]["webhooks"][0]["clientConfig"]["caBundle"]
    assert base64.b64decode(published) == first.ca_pem
    patches = [r for r in stub.requests if r[0] == "PATCH"]
    assert len(patches) == 1  # the second replica found the bundle already in place

    # Two replicas racing: this one's create loses, and it adopts the winner's certificate.
    stub.secrets.clear()
    winner = generate(service_dns_names("jitckpt-webhook.jitckpt-system"))
    stub.secret_race = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "jitckpt-webhook-tls", "namespace": "jitckpt-system"},
        "data": {
            "ca.crt": base64.b64encode(winner.ca_pem).decode(),
            "tls.crt": base64.b64encode(winner.cert_pem).decode(),
            "tls.key": base64.b64encode(winner.key_pem).decode(),
        },
    }
    assert install(api, tmp_path / "replica-3", **kwargs) == winner
    published = stub.hooks["jitckpt-webhook"]["webhooks"][0]["clientConfig"]["caBundle"]
    assert base64.b64decode(published) == winner.ca_pem


def test_serve_self_signed_against_a_kubeconfig(stub: KubeAPIStub, tmp_path: Path) -> None:
    """The serve command end to end: certificate, caBundle, watch, readiness, injection."""
    stub.hooks["jitckpt-webhook"] = yaml.safe_load(
        (REPO / "deploy/base/mutatingwebhookconfiguration.yaml").read_text()
    )
    team_a = fixture("namespace-team-a.yaml")
    stub.put_namespace(team_a)
    with serve(stub) as url:
        config = tmp_path / "kubeconfig"
        config.write_text(kubeconfig(url))
        cert_dir = tmp_path / "certs"
        with serve_webhook(
            cert_dir,
            tmp_path,
            "--self-signed",
            "--service",
            "jitckpt-webhook.jitckpt-system",
            "--webhook-config-name",
            "jitckpt-webhook",
            kubeconfig=config,
        ) as server:
            secret = stub.secrets[("jitckpt-system", "jitckpt-webhook-tls")]
            ca = base64.b64decode(secret["data"]["ca.crt"])
            hook = stub.hooks["jitckpt-webhook"]["webhooks"][0]
            assert base64.b64decode(hook["clientConfig"]["caBundle"]) == ca
            # The certificate names the Service, not 127.0.0.1: check the chain, not the name.
            verify = ssl.create_default_context(cadata=ca.decode())
            verify.check_hostname = False
            with httpx.Client(base_url=server.url, verify=verify, timeout=10) as http:
                eventually(lambda: http.get("/readyz").status_code == 200, timeout=30)
                pod = fixture("pytorchjob-master.yaml")
                review = admission_review(pod, uid="u-1")
                response = check_answer(http.post("/mutate", json=review).json(), "u-1")
                # The destination comes from the namespace annotation, read through the watch.
                injected = patched(pod, response)
                agent = next(
                    c for c in injected["spec"]["initContainers"] if c["name"] == "jitckpt-agent"
                )
                env = {e["name"]: e.get("value") for e in agent["env"]}
                assert env["JITCKPT_DESTINATION"] == "s3://ml-checkpoints/team-a/team-a/bert-ft"
    assert not any("no Kubernetes API" in line["msg"] for line in server.log_lines())
