"""What the cluster demo submits, as users and platform teams write it: the namespace's
opt-in, a ClusterQueue whose quota holds one job, and PyTorchJobs of the demo's HF
Trainer script, unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes import client

from local.demo.destination import SECRET_NAME, Destination
from local.demo.scenario import BUNDLED_SCRIPT, IMAGE_ENV

NAMESPACE = "team-queued"
QUEUE = "team-queue"
KUEUE = "kueue.x-k8s.io"
KUEUE_API = f"{KUEUE}/v1beta2"
MAX_STEPS = 24
PROGRESS_STEP = 6  # the step low must reach before high arrives
STEP_SLEEP = 0.3  # seconds a step: the preemption lands mid-run
# The resource names of the kinds queue_objects makes, for the custom-objects API.
PLURALS = {
    "ResourceFlavor": "resourceflavors",
    "ClusterQueue": "clusterqueues",
    "LocalQueue": "localqueues",
    "WorkloadPriorityClass": "workloadpriorityclasses",
}


def queue_objects() -> list[dict[str, Any]]:
    """A ClusterQueue whose quota holds one job (1 CPU), preempting lower priorities."""
    flavor = {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": "cpu"}}
    cluster_queue = {
        "apiVersion": KUEUE_API,
        "kind": "ClusterQueue",
        "metadata": {"name": "one-job"},
        "spec": {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory"],
                    "flavors": [
                        {
                            "name": "cpu",
                            "resources": [
                                {"name": "cpu", "nominalQuota": "1"},
                                {"name": "memory", "nominalQuota": "8Gi"},
                            ],
                        }
                    ],
                }
            ],
        },
    }
    local_queue = {
        "apiVersion": KUEUE_API,
        "kind": "LocalQueue",
        "metadata": {"name": QUEUE, "namespace": NAMESPACE},
        "spec": {"clusterQueue": "one-job"},
    }
    priorities = [
        {"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass",
         "metadata": {"name": name}, "value": value}
        for name, value in (("low", 100), ("high", 1000))
    ]  # fmt: skip
    return [flavor, cluster_queue, local_queue, *priorities]


def pytorchjob(name: str, priority: str, command: list[str], work: Path) -> dict[str, Any]:
    """A PyTorchJob as a user writes one for Kueue: one master, 1 CPU, its queue named."""
    out = work / "output" / name
    out.mkdir(parents=True, exist_ok=True)
    container = {
        "name": "pytorch",
        "image": "registry.example/team/trainer:1.0",
        "command": command,
        "env": [{"name": k, "value": v} for k, v in {**IMAGE_ENV, "PYTHONHASHSEED": "7"}.items()],
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
        # The pod's output directory is its own (an emptyDir), as in a container.
        "volumeMounts": [
            {"name": "output", "mountPath": str(out)},
            {"name": "weights", "mountPath": str(work / "weights")},
        ],
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {f"{KUEUE}/queue-name": QUEUE, f"{KUEUE}/priority-class": priority},
        },
        "spec": {
            "nprocPerNode": "1",
            "pytorchReplicaSpecs": {
                "Master": {
                    "replicas": 1,
                    "restartPolicy": "Never",
                    "template": {
                        "spec": {
                            "containers": [container],
                            "volumes": [
                                {"name": "output", "emptyDir": {}},
                                {"name": "weights", "hostPath": {"path": str(work / "weights")}},
                            ],
                        }
                    },
                }
            },
        },
    }


def training(name: str, work: Path) -> list[str]:
    return [
        "torchrun", str(BUNDLED_SCRIPT),
        "--output-dir", str(work / "output" / name),
        "--max-steps", str(MAX_STEPS),
        "--step-sleep", str(STEP_SLEEP),
        "--final-weights", str(work / "weights" / f"{name}.pt"),
    ]  # fmt: skip


def opt_in(api: client.ApiClient, destination: Destination) -> None:
    """The namespace opted in to jitckpt, its store's Secret, and the queue."""
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    annotations = {**destination.namespace_annotations(), "jitckpt.io/grace-period-seconds": "60"}
    labels = {"jitckpt.io/injection": "enabled"}
    namespace: Any = {"metadata": {"name": NAMESPACE, "labels": labels, "annotations": annotations}}
    core.create_namespace(namespace)
    secret: Any = {"metadata": {"name": SECRET_NAME}, "stringData": destination.secret}
    core.create_namespaced_secret(NAMESPACE, secret)
    for doc in queue_objects():
        group, version = doc["apiVersion"].split("/")
        plural = PLURALS[doc["kind"]]
        if "namespace" in doc["metadata"]:
            custom.create_namespaced_custom_object(group, version, NAMESPACE, plural, doc)
        else:
            custom.create_cluster_custom_object(group, version, plural, doc)
