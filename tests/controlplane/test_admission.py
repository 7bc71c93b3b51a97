"""Pods admitted by a real kube-apiserver through the jitckpt webhook installed from deploy/.

What only a real API server decides is decided here by one: whether the
webhook is called at all (the namespaceSelector, the objectSelector, the CEL
matchConditions), what a call that fails does (failurePolicy), whether the
webhook's JSON patch applies, and whether the pod that results passes the
server's defaulting, validation and Pod Security admission. The webhook's own
counters (its /metrics) tell a pod it never saw from one it skipped, and why.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from local.controlplane.install import WEBHOOK_CONFIG, InstalledWebhook
from local.ports import free_port
from tests.controlplane.kube import Kube, calls, counters
from tests.webhook.server_support import fixture
from webhook.settings import STATUS_KEY

pytestmark = [pytest.mark.xdist_group("controlplane")]

NOT_CALLED: dict[str, float] = {}
# Injected, then called once more: the API server runs its own mutating plugins again
# after a webhook changed the pod (the ServiceAccount plugin mounts the token into the
# injected sidecar), and reinvocationPolicy IfNeeded calls the webhook again on that
# change; it finds the pod injected already.
INJECTED = {"requests": 2, "injected": 1, "skipped:already-injected": 1}


def skipped(reason: str) -> dict[str, float]:
    return {"requests": 1, f"skipped:{reason}": 1}


# Each fixture pod, and what admission through the real API server must do with it:
# the reasons are the webhook's own tests' (tests/webhook/test_server_app.py and the
# golden cases); the plain pod carries no job label, so the CEL condition keeps it away.
FIXTURE_PODS = {
    "pytorchjob-master.yaml": INJECTED,
    "pytorchjob-worker.yaml": INJECTED,
    "trainjob-node.yaml": INJECTED,
    "trainjob-dataset-initializer.yaml": skipped("not-trainer"),
    "plain-pod.yaml": NOT_CALLED,
}
# The fixture's jobset.sigs.k8s.io/job-key is 64 hex digits, a length no label value may
# have (at most 63): a real API server refuses that pod. JobSet's key is a SHA-1, 40 digits.
JOB_KEY = "jobset.sigs.k8s.io/job-key"
RESTRICTED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@pytest.fixture(scope="session")
def kube(api: Any, installed: InstalledWebhook) -> Kube:
    """A client of the cluster, once the webhook is installed and its namespaces exist."""
    kube = Kube(api)
    for name in ("namespace-team-a.yaml", "namespace-team-b.yaml"):
        kube.ensure_namespace(fixture(name))
    return kube


def opted_in_namespace(kube: Kube, name: str, **labels: str) -> str:
    """A namespace like team-a's (same opt-in and annotations) with ``labels`` added."""
    namespace = fixture("namespace-team-a.yaml")
    namespace["metadata"]["name"] = name
    namespace["metadata"]["labels"].update(labels)
    kube.ensure_namespace(namespace)
    return name


def admit(
    kube: Kube, installed: InstalledWebhook, pod: dict[str, Any], *, dry_run: bool = False
) -> tuple[dict[str, Any], dict[str, float]]:
    """Create ``pod``; the pod the server stored (or would) and what the webhook counted."""
    before = counters(installed)
    created = kube.create_pod(pod, dry_run=dry_run)
    return created, calls(before, counters(installed))


def valid_fixture(name: str) -> dict[str, Any]:
    """The fixture pod, its JobSet key made the length JobSet's is (see JOB_KEY)."""
    pod = fixture(name)
    for key in ("labels", "annotations"):
        if JOB_KEY in pod["metadata"].get(key, {}):
            pod["metadata"][key][JOB_KEY] = pod["metadata"][key][JOB_KEY][:40]
    return pod


def assert_injected_whole(created: dict[str, Any]) -> None:
    """Every container and volume the status annotation names is in the stored pod."""
    status = json.loads(created["metadata"]["annotations"][STATUS_KEY])
    spec = created["spec"]
    assert set(status["initContainers"]) <= {c["name"] for c in spec.get("initContainers", [])}
    assert set(status["containers"]) <= {c["name"] for c in spec["containers"]}
    assert set(status["volumes"]) <= {v["name"] for v in spec.get("volumes", [])}


def assert_untouched(created: dict[str, Any], pod: dict[str, Any]) -> None:
    assert STATUS_KEY not in created["metadata"].get("annotations", {})
    assert [c["name"] for c in created["spec"]["containers"]] == [
        c["name"] for c in pod["spec"]["containers"]
    ]
    assert [c["name"] for c in created["spec"].get("initContainers", [])] == [
        c["name"] for c in pod["spec"].get("initContainers", [])
    ]


@pytest.fixture
def created_pods(kube: Kube) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Pods a test created, deleted after it (they never leave Pending: no node)."""
    pods: list[dict[str, Any]] = []
    yield pods.append
    for pod in pods:
        kube.delete_pod(pod)


@pytest.mark.parametrize("name", sorted(FIXTURE_PODS))
def test_fixture_pod_is_admitted_as_the_webhook_decides(
    name: str,
    kube: Kube,
    installed: InstalledWebhook,
    created_pods: Callable[[dict[str, Any]], None],
) -> None:
    pod = valid_fixture(name)
    created, changes = admit(kube, installed, pod)
    created_pods(created)
    assert changes == FIXTURE_PODS[name], installed.log()
    if FIXTURE_PODS[name] == INJECTED:
        assert_injected_whole(created)
        # The server's defaulting reached the injected containers too.
        for container in created["spec"]["initContainers"] + created["spec"]["containers"]:
            assert container["terminationMessagePolicy"] in ("File", "FallbackToLogsOnError")
    else:
        assert_untouched(created, pod)


def test_namespace_not_opted_in_is_never_sent_to_the_webhook(
    kube: Kube, installed: InstalledWebhook
) -> None:
    namespace = fixture("namespace-team-a.yaml")
    namespace["metadata"] = {"name": "team-not-opted-in"}
    kube.ensure_namespace(namespace)
    pod = fixture("pytorchjob-master.yaml")
    pod["metadata"]["namespace"] = "team-not-opted-in"
    created, changes = admit(kube, installed, pod, dry_run=True)
    assert changes == NOT_CALLED
    assert_untouched(created, pod)


def test_opt_out_label_is_never_sent_and_opt_out_annotation_is_the_webhooks_answer(
    kube: Kube, installed: InstalledWebhook
) -> None:
    labelled = fixture("pytorchjob-master.yaml")
    labelled["metadata"]["labels"]["jitckpt.io/inject"] = "false"
    created, changes = admit(kube, installed, labelled, dry_run=True)
    assert changes == NOT_CALLED  # the objectSelector
    assert_untouched(created, labelled)

    annotated = fixture("pytorchjob-master.yaml")
    annotated["metadata"]["annotations"]["jitckpt.io/inject"] = "false"
    created, changes = admit(kube, installed, annotated, dry_run=True)
    assert changes == skipped("opted-out")
    assert_untouched(created, annotated)


def eventually(check: Callable[[], bool], what: str, seconds: float = 20.0) -> None:
    """The API server sees a changed webhook configuration through a watch: soon, not at once."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"within {seconds:.0f}s: {what}")
        time.sleep(0.2)


def reconfigure(kube: Kube, patch: list[dict[str, Any]]) -> None:
    """Patch the installed MutatingWebhookConfiguration (RFC 6902)."""
    kube.patch_webhook_configuration(WEBHOOK_CONFIG, patch)


def test_failure_policy_is_the_api_servers(kube: Kube, installed: InstalledWebhook) -> None:
    """Fail: a job pod is refused while no webhook answers; Ignore: admitted untouched."""
    original = kube.webhook_configuration(WEBHOOK_CONFIG)
    (hook,) = original["webhooks"]
    assert hook["failurePolicy"] == "Fail"  # the self-signed overlay's choice
    job_pod = fixture("pytorchjob-master.yaml")
    plain = fixture("plain-pod.yaml")
    dead = f"https://127.0.0.1:{free_port()}/mutate"

    def refused() -> bool:
        try:
            kube.create_pod(job_pod, dry_run=True)
        except ApiException as exc:
            assert "failed calling webhook" in exc.body, exc.body
            return True
        return False

    def admitted_untouched() -> bool:
        try:
            created = kube.create_pod(job_pod, dry_run=True)
        except ApiException:
            return False
        assert_untouched(created, job_pod)
        return True

    url = "/webhooks/0/clientConfig/url"
    try:
        reconfigure(kube, [{"op": "replace", "path": url, "value": dead}])
        eventually(refused, "a job pod refused with failurePolicy Fail and no webhook")
        kube.create_pod(plain, dry_run=True)  # the CEL condition keeps others out of it
        reconfigure(
            kube,
            [{"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Ignore"}],
        )
        eventually(admitted_untouched, "a job pod admitted untouched with failurePolicy Ignore")
    finally:
        reconfigure(
            kube,
            [
                {"op": "replace", "path": url, "value": hook["clientConfig"]["url"]},
                {"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Fail"},
            ],
        )
        eventually(
            lambda: STATUS_KEY in kube.create_pod(job_pod, dry_run=True)["metadata"]["annotations"],
            "injection again once the configuration is restored",
        )


def restricted(pod: dict[str, Any]) -> dict[str, Any]:
    """``pod`` with what Pod Security's restricted level asks of a user's own containers."""
    pod = copy.deepcopy(pod)
    pod["spec"]["securityContext"] = dict(RESTRICTED_POD)
    for container in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
        container["securityContext"] = copy.deepcopy(RESTRICTED_CONTAINER)
    return pod


@pytest.mark.parametrize("level", ["baseline", "restricted"])
def test_injected_pod_passes_pod_security_of_its_namespace(
    level: str, kube: Kube, installed: InstalledWebhook
) -> None:
    """Pod Security runs after the mutating webhooks: it judges the injected pod."""
    namespace = opted_in_namespace(
        kube, f"team-{level}", **{"pod-security.kubernetes.io/enforce": level}
    )
    for name in ("pytorchjob-master.yaml", "pytorchjob-worker.yaml", "trainjob-node.yaml"):
        pod = valid_fixture(name)
        pod["metadata"]["namespace"] = namespace
        if level == "restricted":
            with pytest.raises(ApiException) as refused:  # the level is enforced at all
                kube.create_pod(pod, dry_run=True)
            assert refused.value.status == 403 and "violates PodSecurity" in refused.value.body
            pod = restricted(pod)
        created, changes = admit(kube, installed, pod, dry_run=True)
        assert changes == INJECTED, name
        assert_injected_whole(created)


def test_reinvocation_policy_is_the_api_servers(kube: Kube, installed: InstalledWebhook) -> None:
    """IfNeeded (deploy/'s): called again after the pod changed; Never: called once."""
    pod = fixture("pytorchjob-master.yaml")
    created, changes = admit(kube, installed, pod, dry_run=True)
    assert changes == INJECTED
    # What changed it after the webhook: the API server's ServiceAccount plugin, run again
    # after the webhooks, mounted the service-account token into the injected sidecar too.
    (token,) = [
        v["name"] for v in pod["spec"]["volumes"] if v["name"].startswith("kube-api-access")
    ]
    (agent,) = [c for c in created["spec"]["initContainers"] if c.get("restartPolicy") == "Always"]
    assert token in [m["name"] for m in agent["volumeMounts"]]

    policy = "/webhooks/0/reinvocationPolicy"
    once = {"requests": 1, "injected": 1}

    def calls_become(expected: dict[str, float]) -> Callable[[], bool]:
        return lambda: admit(kube, installed, pod, dry_run=True)[1] == expected

    try:
        reconfigure(kube, [{"op": "replace", "path": policy, "value": "Never"}])
        eventually(calls_become(once), "one call per pod with reinvocationPolicy Never")
    finally:
        reconfigure(kube, [{"op": "replace", "path": policy, "value": "IfNeeded"}])
        eventually(calls_become(INJECTED), "reinvocation again once IfNeeded is restored")
