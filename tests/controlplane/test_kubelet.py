"""The pod runner as the nodes' kubelet, against a real API server and scheduler.

Pods are created as a user creates them (no nodeName): kube-scheduler binds them
to one of the two nodes, whose ``local/kubelet`` runs them and reports back.
Each test reads only what the API server says of the pod: its phase, its
containers' exit codes and termination messages, and for a deleted pod that it
stopped within its grace period and was then removed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from local.clusterdemo.observe import wait
from local.controlplane.cluster import ControlPlane
from tests.controlplane.conftest import NODES

pytestmark = [pytest.mark.xdist_group("nodes")]

IMAGE = "python:3.11-slim"  # the node runs every image with this machine's interpreter


@pytest.fixture(scope="module")
def core(node_cluster: ControlPlane) -> Iterator[client.CoreV1Api]:
    configuration = client.Configuration()
    config.load_kube_config(str(node_cluster.kubeconfig), client_configuration=configuration)
    with client.ApiClient(configuration) as api:
        yield client.CoreV1Api(api)


@pytest.fixture
def namespace(core: client.CoreV1Api, request: pytest.FixtureRequest) -> str:
    """A new namespace, once kube-controller-manager has made its ``default`` account."""
    name = request.node.name.replace("_", "-")[:50].strip("-").lower()
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))

    def account() -> bool:
        try:
            core.read_namespaced_service_account("default", name)
        except ApiException:
            return False
        return True

    wait(account, what=f"the default ServiceAccount of {name}")
    return name


def python_pod(name: str, script: str, env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A pod of one container running ``script``, with ``env`` from the API server."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "command": ["python", "-c", script],
                    "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                    "env": env or [],
                }
            ],
        },
    }


def terminal(core: client.CoreV1Api, namespace: str, name: str) -> Callable[[], Any]:
    def read() -> Any:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase in ("Succeeded", "Failed") else None

    return read


def test_the_nodes_register_ready_and_renew_their_leases(
    node_cluster: ControlPlane, core: client.CoreV1Api
) -> None:
    def schedulable(name: str) -> bool:
        """Ready, and the not-ready taint the node lifecycle controller put on the
        new node taken off again."""
        node = core.read_node(name)
        ready = {c.type: c.status for c in node.status.conditions}["Ready"]
        return ready == "True" and not [
            t for t in node.spec.taints or [] if t.effect == "NoSchedule"
        ]

    for name in NODES:
        wait(lambda node=name: schedulable(node), what=f"{name} ready and schedulable")
    configuration = core.api_client.configuration
    leases = client.CoordinationV1Api(client.ApiClient(configuration))
    renewed = {name: leases.read_namespaced_lease(name, "kube-node-lease") for name in NODES}
    assert {name: lease.spec.holder_identity for name, lease in renewed.items()} == {
        name: name for name in NODES
    }


def test_a_pod_is_scheduled_run_and_reported_with_its_exit_code_and_message(
    core: client.CoreV1Api, namespace: str
) -> None:
    # Its own name resolves to its own IP (the kubelet's /etc/hosts): a PyTorchJob
    # master's MASTER_ADDR is its pod's name.
    script = (
        "import os, socket, sys\n"
        "ip = socket.gethostbyname('exits-three')\n"
        "open('/dev/termination-log', 'w').write(f\"ran on {os.environ['NODE']} as {ip}\")\n"
        "sys.exit(3)\n"
    )
    node = {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    core.create_namespaced_pod(namespace, python_pod("exits-three", script, [node]))
    done = wait(terminal(core, namespace, "exits-three"), what="the pod's end")
    assert done.spec.node_name in NODES
    assert done.status.phase == "Failed"
    assert done.status.pod_ip and done.status.pod_ip.startswith("127.")
    (status,) = done.status.container_statuses
    assert status.state.terminated.exit_code == 3
    assert status.state.terminated.reason == "Error"
    assert status.state.terminated.message == (
        f"ran on {done.spec.node_name} as {done.status.pod_ip}"
    )


def test_graceful_deletion_stops_the_pod_within_its_grace_period_and_removes_it(
    core: client.CoreV1Api, namespace: str
) -> None:
    script = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    open('/dev/termination-log', 'w').write('stopped by SIGTERM')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    core.create_namespaced_pod(namespace, python_pod("stops", script))

    def running() -> bool:
        pod = core.read_namespaced_pod("stops", namespace)
        statuses = pod.status.container_statuses or []
        return pod.status.phase == "Running" and all(s.state.running for s in statuses)

    wait(running, what="the pod running")
    seen: list[Any] = []
    stream = watch.Watch()
    asked = time.monotonic()
    core.delete_namespaced_pod("stops", namespace, grace_period_seconds=20)
    for event in stream.stream(
        core.list_namespaced_pod,
        namespace,
        field_selector="metadata.name=stops",
        timeout_seconds=60,
    ):
        seen.append(event["object"])
        if event["type"] == "DELETED":
            stream.stop()
    took = time.monotonic() - asked
    assert took < 20, f"the pod took {took:.1f} s to go, past its grace period"
    last = seen[-1]
    (status,) = last.status.container_statuses
    assert status.state.terminated.exit_code == 0
    assert status.state.terminated.message == "stopped by SIGTERM"
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_pod("stops", namespace)
    assert gone.value.status == 404


def test_a_pod_waits_for_its_secret_then_reaches_the_api_server_with_its_own_token(
    core: client.CoreV1Api, namespace: str
) -> None:
    # The container calls the API server the way an in-cluster client does: the
    # kubernetes Service's env, the projected token and CA. The default account may
    # do nothing, so an authenticated call is refused with 403, never 401.
    script = (
        "import os, ssl, urllib.error, urllib.request\n"
        "sa = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
        "env = os.environ\n"
        "host, port = env['KUBERNETES_SERVICE_HOST'], env['KUBERNETES_SERVICE_PORT']\n"
        "token = open(f'{sa}/token').read()\n"
        "context = ssl.create_default_context(cafile=f'{sa}/ca.crt')\n"
        "ns = open(f'{sa}/namespace').read()\n"
        "request = urllib.request.Request(f'https://{host}:{port}/api/v1/namespaces/{ns}/secrets',\n"
        "    headers={'Authorization': f'Bearer {token}'})\n"
        "try:\n"
        "    urllib.request.urlopen(request, context=context)\n"
        "    code = 200\n"
        "except urllib.error.HTTPError as exc:\n"
        "    code = exc.code\n"
        "open('/dev/termination-log', 'w').write(f\"{code} {os.environ['PASSWORD']}\")\n"
    )
    password = {
        "name": "PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "later", "key": "password"}},
    }
    core.create_namespaced_pod(namespace, python_pod("with-secret", script, [password]))

    def waiting() -> Any:
        statuses = core.read_namespaced_pod("with-secret", namespace).status.container_statuses
        state = statuses[0].state.waiting if statuses else None
        return state if state and state.reason == "CreateContainerConfigError" else None

    state = wait(waiting, what="the pod waiting for its Secret")
    assert state.message == 'secret "later" not found'
    core.create_namespaced_secret(
        namespace,
        client.V1Secret(metadata=client.V1ObjectMeta(name="later"), string_data={"password": "s3"}),
    )
    done = wait(terminal(core, namespace, "with-secret"), what="the pod's end")
    (status,) = done.status.container_statuses
    assert status.state.terminated.exit_code == 0, status.state.terminated
    assert status.state.terminated.message == "403 s3"
