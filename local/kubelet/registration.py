"""The Node object and its Lease: how the control plane knows this kubelet is alive.

The node posts its status once at start (Ready, its capacity, 127.0.0.1 as its
address) and then renews a Lease in ``kube-node-lease`` every ten seconds, which
is what the node lifecycle controller watches; a kubelet that stops renewing is
marked unready and its pods evicted, as on a cluster.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
RENEW_SECONDS = 10.0
# What a CPU node of a training cluster offers; the scheduler fits pods' requests to it.
DEFAULT_CAPACITY: Mapping[str, str] = {
    "cpu": "16",
    "memory": "64Gi",
    "pods": "110",
    "ephemeral-storage": "100Gi",
}
LOCAL_NODE_LABEL = "node.jitckpt.dev/local"


def now_rfc3339(micro: bool = False) -> str:
    moment = dt.datetime.now(dt.UTC)
    if micro:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def node_status(name: str, capacity: Mapping[str, str], version: str) -> dict[str, Any]:
    """The status a healthy kubelet posts: Ready, no pressure, its capacity."""
    at = now_rfc3339()

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": at,
            "lastTransitionTime": at,
        }

    return {
        "conditions": [
            condition("Ready", "True", "KubeletReady", "the local pod runner is posting ready"),
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "no pressure"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "no pressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "no pressure"),
        ],
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": name},
        ],
        "capacity": dict(capacity),
        "allocatable": dict(capacity),
        "nodeInfo": {
            "kubeletVersion": version,
            "operatingSystem": "linux",
            "architecture": "amd64",
            "containerRuntimeVersion": "jitckpt-podrunner://0",
            "kernelVersion": "",
            "osImage": "",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
            "kubeProxyVersion": "",
        },
    }


class Registration:
    """The Node ``name`` and its Lease, renewed by a thread until ``stop``."""

    def __init__(
        self, api: client.ApiClient, name: str, capacity: Mapping[str, str], version: str
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.leases = client.CoordinationV1Api(api)
        self.name = name
        self.capacity = capacity
        self.version = version
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        node: Any = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    LOCAL_NODE_LABEL: "true",
                },
            },
        }
        try:
            created = self.core.create_node(node)
        except ApiException as exc:
            if exc.status != 409:  # a kubelet restarted on its node
                raise
            created = self.core.read_node(self.name)
        assert created.metadata is not None and created.metadata.uid is not None
        uid = str(created.metadata.uid)
        status = node_status(self.name, self.capacity, self.version)
        self.core.patch_node_status(self.name, {"status": status})
        self._renew(uid)
        self._thread = threading.Thread(
            target=self._keep_renewing,
            args=(uid,),
            name=f"lease-{self.name}",
            daemon=True,
        )
        self._thread.start()

    def _renew(self, uid: str) -> None:
        body: Any = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": LEASE_NAMESPACE,
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": uid}
                ],
            },
            "spec": {
                "holderIdentity": self.name,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": now_rfc3339(micro=True),
            },
        }
        try:
            self.leases.patch_namespaced_lease(self.name, LEASE_NAMESPACE, body)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.leases.create_namespaced_lease(LEASE_NAMESPACE, body)

    def _keep_renewing(self, uid: str) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            try:
                self._renew(uid)
            except (ApiException, OSError):
                continue  # the API server is away for a moment: the next renewal retries

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
