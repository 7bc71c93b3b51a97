"""What the cluster demo submits, as users and platform teams write it: the namespace's
opt-in, a ClusterQueue whose quota holds one job, and PyTorchJobs or TrainJobs of the
demo's HF Trainer script, unchanged."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
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


IMAGE = "registry.example/team/trainer:1.0"
RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}}


def _queued(name: str, priority: str) -> dict[str, Any]:
    """The metadata of a job for Kueue: its LocalQueue and its priority named."""
    labels = {f"{KUEUE}/queue-name": QUEUE, f"{KUEUE}/priority-class": priority}
    return {"name": name, "namespace": NAMESPACE, "labels": labels}


def _volumes(
    name: str, work: Path, keep_output: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the trainer's mounts: its output directory its own (an
    emptyDir, as in a container) or, ``keep_output``, kept across pods (a job's own
    periodic checkpoints, on a volume of its own), the final weights on the host for
    the comparison."""
    out = work / "output" / name
    out.mkdir(parents=True, exist_ok=True)
    output = {"hostPath": {"path": str(out)}} if keep_output else {"emptyDir": {}}
    volumes = [
        {"name": "output", **output},
        {"name": "weights", "hostPath": {"path": str(work / "weights")}},
    ]
    mounts = [
        {"name": "output", "mountPath": str(out)},
        {"name": "weights", "mountPath": str(work / "weights")},
    ]
    return volumes, mounts


def _env() -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in {**IMAGE_ENV, "PYTHONHASHSEED": "7"}.items()]


@dataclass(frozen=True)
class JobKind(ABC):
    """One Kubeflow job kind as the flow submits and follows it: its API, the label its
    controller puts on the job's pods, the trainer's container, the condition of a job
    that ended well."""

    name: str
    api_kind: str
    group: str
    version: str
    plural: str
    pod_label: str
    container: str
    succeeded: str

    @abstractmethod
    def manifest(
        self, name: str, priority: str, command: list[str], work: Path, *, keep_output: bool
    ) -> dict[str, Any]:
        """The job ``name`` as a user writes it for Kueue: one node, 1 CPU, its queue named;
        ``keep_output``: its output directory kept from one pod to the next."""

    @abstractmethod
    def trainer_pod(self, job: str) -> str:
        """A glob of the names of ``job``'s trainer pod (every instance of it)."""


class PyTorchJobKind(JobKind):
    def manifest(
        self, name: str, priority: str, command: list[str], work: Path, *, keep_output: bool
    ) -> dict[str, Any]:
        volumes, mounts = _volumes(name, work, keep_output)
        container = {"name": self.container, "image": IMAGE, "command": command, "env": _env(),
                     "resources": RESOURCES, "volumeMounts": mounts}  # fmt: skip
        master = {
            "replicas": 1,
            "restartPolicy": "Never",
            "template": {"spec": {"containers": [container], "volumes": volumes}},
        }
        return {
            "apiVersion": f"{self.group}/{self.version}",
            "kind": self.api_kind,
            "metadata": _queued(name, priority),
            "spec": {"nprocPerNode": "1", "pytorchReplicaSpecs": {"Master": master}},
        }

    def trainer_pod(self, job: str) -> str:
        return f"{job}-master-0"  # the operator's name for the master pod, every instance


class TrainJobKind(JobKind):
    """A TrainJob of the Trainer's ``torch-distributed`` runtime; its volumes through a
    runtime patch of the user's own manager, the way Trainer v2 takes pod changes."""

    def manifest(
        self, name: str, priority: str, command: list[str], work: Path, *, keep_output: bool
    ) -> dict[str, Any]:
        volumes, mounts = _volumes(name, work, keep_output)
        pod = {"volumes": volumes, "containers": [{"name": self.container, "volumeMounts": mounts}]}
        node = {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}
        patch = {
            "manager": "team.example/volumes",
            "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node]}}},
        }
        trainer = {"image": IMAGE, "command": command, "env": _env(), "numNodes": 1,
                   "resourcesPerNode": RESOURCES}  # fmt: skip
        return {
            "apiVersion": f"{self.group}/{self.version}",
            "kind": self.api_kind,
            "metadata": _queued(name, priority),
            "spec": {
                "runtimeRef": {"name": "torch-distributed"},
                "trainer": trainer,
                "runtimePatches": [patch],
            },
        }

    def trainer_pod(self, job: str) -> str:
        # JobSet's Job "<job>-node-0", whose pod of index 0 gets a generated suffix
        return f"{job}-node-0-0-*"


KINDS: dict[str, JobKind] = {
    "pytorchjob": PyTorchJobKind(
        "pytorchjob", "PyTorchJob", "kubeflow.org", "v1", "pytorchjobs",
        "training.kubeflow.org/job-name", "pytorch", "Succeeded",
    ),
    "trainjob": TrainJobKind(
        "trainjob", "TrainJob", "trainer.kubeflow.org", "v1alpha1", "trainjobs",
        "jobset.sigs.k8s.io/jobset-name", "node", "Complete",
    ),
}  # fmt: skip


def training(name: str, work: Path, save_steps: int = 0) -> list[str]:
    """The trainer's command; ``save_steps``: the job's own periodic saves instead, and
    the resume a job without jitckpt does itself: from the newest one in its output
    directory, if any (the script is the same, unchanged)."""
    out = work / "output" / name
    command = [
        "torchrun", str(BUNDLED_SCRIPT),
        "--output-dir", str(out),
        "--max-steps", str(MAX_STEPS),
        "--step-sleep", str(STEP_SLEEP),
        "--final-weights", str(work / "weights" / f"{name}.pt"),
    ]  # fmt: skip
    if not save_steps:
        return command
    newest = 'ls -1 "$0" | grep "^checkpoint-[0-9]*$" | sort -t- -k2 -n | tail -n 1'
    line = (f'last=$({newest}); exec "$@" --save-steps {save_steps} '
            '${last:+--resume "$0/$last"}')  # fmt: skip
    return ["sh", "-c", line, str(out), *command]


def opt_in(api: client.ApiClient, destination: Destination | None) -> None:
    """The namespace opted in to jitckpt with its store's Secret (``destination`` None:
    a namespace of its own, not opted in), and the queue."""
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    namespace: Any = {"metadata": {"name": NAMESPACE}}
    if destination is not None:
        namespace["metadata"]["labels"] = {"jitckpt.io/injection": "enabled"}
        namespace["metadata"]["annotations"] = {
            **destination.namespace_annotations(),
            "jitckpt.io/grace-period-seconds": "60",
        }
    core.create_namespace(namespace)
    if destination is not None:
        secret: Any = {"metadata": {"name": SECRET_NAME}, "stringData": destination.secret}
        core.create_namespaced_secret(NAMESPACE, secret)
    for doc in queue_objects():
        group, version = doc["apiVersion"].split("/")
        plural = PLURALS[doc["kind"]]
        if "namespace" in doc["metadata"]:
            custom.create_namespaced_custom_object(group, version, NAMESPACE, plural, doc)
        else:
            custom.create_cluster_custom_object(group, version, plural, doc)
