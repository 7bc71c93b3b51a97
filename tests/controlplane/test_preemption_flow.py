"""Kueue preempts a PyTorchJob for a higher-priority one and admits it again: end to end.

Everything here is the real part: the API server admits every pod through
jitckpt's webhook (installed from deploy/), Kueue admits and preempts the jobs
of a ClusterQueue whose quota holds one, the training-operator creates and
deletes their pods, kube-scheduler binds them and ``local/kubelet`` runs them.
The training script is the demo's HF Trainer script, unchanged. The test only
creates the queue, the namespace's opt-in and three PyTorchJobs:

1. ``reference``, alone, uninterrupted: its final weights are the truth;
2. ``low`` (low priority), the same training, until it has made progress;
3. ``high`` (high priority) arrives: Kueue evicts ``low``, whose pods the
   operator deletes with their grace period; the shim stops at the next step and
   the sidecar commits the JIT checkpoint; ``high`` runs and finishes; Kueue
   admits ``low`` again, the operator creates new pods, the webhook injects
   them, the sidecar restores, and ``low`` ends with weights bitwise equal to the
   reference's.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, watch

from local.controlplane.cluster import ControlPlane
from local.demo.destination import SECRET_NAME, Destination
from local.demo.scenario import BUNDLED_SCRIPT, IMAGE_ENV
from local.demo.weights import compare_files
from shim.layout import JIT_EXIT_CODE
from tests.controlplane.conftest import Kubeflow
from tests.controlplane.test_kubelet import eventually
from webhook.status import AGENT

pytestmark = [pytest.mark.xdist_group("nodes")]

NAMESPACE = "team-queued"
QUEUE = "team-queue"
KUEUE = "kueue.x-k8s.io"
KUEUE_API = f"{KUEUE}/v1beta2"
MAX_STEPS = 24
PROGRESS_STEP = 6  # the step low must reach before high arrives
STEP_SLEEP = 0.3  # seconds a step: the preemption lands mid-run


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


class PodRecorder:
    """Every status the API server held of each pod of the namespace, by uid, in order:
    a deleted pod's last status (its exit codes, termination messages) is gone with it."""

    def __init__(self, core: client.CoreV1Api) -> None:
        self.core = core
        self.seen: dict[str, list[Any]] = {}
        self._watch = watch.Watch()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                for event in self._watch.stream(
                    self.core.list_namespaced_pod, NAMESPACE, timeout_seconds=30
                ):
                    pod = event["object"]
                    self.seen.setdefault(pod.metadata.uid, []).append(pod)
            except Exception:
                continue

    def start(self) -> PodRecorder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()

    def of_job(self, job: str) -> list[list[Any]]:
        """Each pod of ``job``, first created first, as the list of its states."""
        pods = [
            states
            for states in self.seen.values()
            if states[0].metadata.labels.get("training.kubeflow.org/job-name") == job
        ]
        return sorted(pods, key=lambda states: states[0].metadata.creation_timestamp)


def container(pod: Any, name: str) -> Any:
    statuses = (pod.status.container_statuses or []) + (pod.status.init_container_statuses or [])
    return next((s for s in statuses if s.name == name), None)


@pytest.fixture
def queued_namespace(
    node_cluster: ControlPlane, kubeflow: Kubeflow
) -> Iterator[tuple[client.ApiClient, Destination]]:
    """The namespace opted in to jitckpt (the embedded S3 store, its Secret), its queue."""
    destination = Destination.embedded()
    configuration = client.Configuration()
    config.load_kube_config(str(node_cluster.kubeconfig), client_configuration=configuration)
    api = client.ApiClient(configuration)
    core = client.CoreV1Api(api)
    annotations = {**destination.namespace_annotations(), "jitckpt.io/grace-period-seconds": "60"}
    core.create_namespace(
        {"metadata": {"name": NAMESPACE, "labels": {"jitckpt.io/injection": "enabled"},
                      "annotations": annotations}}
    )  # fmt: skip
    core.create_namespaced_secret(
        NAMESPACE, {"metadata": {"name": SECRET_NAME}, "stringData": destination.secret}
    )
    custom = client.CustomObjectsApi(api)
    for doc in queue_objects():
        group, version = doc["apiVersion"].split("/")
        plural = doc["kind"].lower() + ("es" if doc["kind"].endswith("s") else "s")
        if "namespace" in doc["metadata"]:
            custom.create_namespaced_custom_object(group, version, NAMESPACE, plural, doc)
        else:
            custom.create_cluster_custom_object(group, version, plural, doc)
    try:
        yield api, destination
    finally:
        destination.close()
        api.close()


def progress(node_root: Path, pod: str, step: int) -> Callable[[], bool]:
    """Whether the trainer of ``pod`` (any instance) has logged step ``step``."""

    def read() -> bool:
        for log in node_root.glob(f"*/pods/{NAMESPACE}_{pod}_*/containers/pytorch/log"):
            if f"step {step}/" in log.read_text(errors="replace"):
                return True
        return False

    return read


def job_condition(custom: client.CustomObjectsApi, name: str, kind: str) -> Callable[[], bool]:
    def read() -> bool:
        job = custom.get_namespaced_custom_object(
            "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name
        )
        conditions = (job.get("status") or {}).get("conditions") or []
        return any(c["type"] == kind and c["status"] == "True" for c in conditions)

    return read


def cluster_state(api: client.ApiClient, node_root: Path) -> str:
    """What a failure needs: the jobs' and workloads' conditions, each pod's phase and
    containers, the last lines of each container's log."""
    custom, lines = client.CustomObjectsApi(api), []
    for group, version, plural in (("kubeflow.org", "v1", "pytorchjobs"),
                                   (KUEUE, "v1beta2", "workloads")):  # fmt: skip
        for item in custom.list_namespaced_custom_object(group, version, NAMESPACE, plural)[
            "items"
        ]:
            conditions = (item.get("status") or {}).get("conditions") or []
            summary = [(c["type"], c["status"], c.get("reason")) for c in conditions]
            lines.append(f"{plural} {item['metadata']['name']}: {summary}")
    for pod in client.CoreV1Api(api).list_namespaced_pod(NAMESPACE).items:
        states = [
            (c.name, c.state.to_dict())
            for c in (pod.status.init_container_statuses or [])
            + (pod.status.container_statuses or [])
        ]
        lines.append(
            f"pod {pod.metadata.name} {pod.status.phase} {pod.spec.node_name} "
            f"{pod.status.reason}: {pod.status.message} {states}"
        )
    for log in sorted(node_root.glob(f"*/pods/{NAMESPACE}_*/containers/*/log")):
        tail = log.read_text(errors="replace").splitlines()[-8:]
        lines.append(f"--- {log.relative_to(node_root)}\n" + "\n".join(tail))
    return "\n".join(lines)


def test_kueue_preempts_a_pytorchjob_and_it_resumes_bitwise_when_admitted_again(
    queued_namespace: tuple[client.ApiClient, Destination],
    kubeflow: Kubeflow,
    node_root: Path,
    tmp_path: Path,
) -> None:
    api, _ = queued_namespace
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    (tmp_path / "weights").mkdir()
    os.chmod(tmp_path, 0o755)
    recorder = PodRecorder(core).start()

    def create(job: dict[str, Any]) -> None:
        custom.create_namespaced_custom_object("kubeflow.org", "v1", NAMESPACE, "pytorchjobs", job)

    try:
        create(pytorchjob("reference", "low", training("reference", tmp_path), tmp_path))
        eventually(job_condition(custom, "reference", "Succeeded"), 120, "the reference's end")

        create(pytorchjob("low", "low", training("low", tmp_path), tmp_path))
        eventually(progress(node_root, "low-master-0", PROGRESS_STEP), 180, "low's progress")
        create(pytorchjob("high", "high", ["python", "-c", "print('high ran')"], tmp_path))
        eventually(job_condition(custom, "high", "Succeeded"), 240, "high's end")
        eventually(job_condition(custom, "low", "Succeeded"), 300, "low's end after resuming")
    except AssertionError as exc:
        state = cluster_state(api, node_root)
        raise AssertionError(f"{exc}\n{state}\n{kubeflow.logs()}") from None
    finally:
        recorder.stop()

    first, *later = recorder.of_job("low")
    assert later, "Kueue never admitted low again: no second pod"
    # The preempted pod: deleted by the operator, its trainer stopped for the JIT save.
    last = first[-1]
    trainer = container(last, "pytorch").state.terminated
    assert trainer.exit_code == JIT_EXIT_CODE, trainer
    sidecar = container(last, AGENT).state.terminated
    committed = json.loads(sidecar.message)["last_committed"]
    assert committed["kind"] == "jit", sidecar.message
    assert PROGRESS_STEP <= committed["step"] < MAX_STEPS
    # high ran in between: created after low's progress, done before low's new pod.
    (high,) = recorder.of_job("high")
    assert container(high[-1], "pytorch").state.terminated.exit_code == 0
    resumed = later[-1][-1]
    assert container(resumed, "pytorch").state.terminated.exit_code == 0
    resumed_log = next(
        node_root.glob(
            f"*/pods/{NAMESPACE}_low-master-0_{resumed.metadata.uid}/containers/pytorch/log"
        )
    ).read_text()
    assert f"step {committed['step'] + 1}/" in resumed_log
    assert "step 1/" not in resumed_log, "the resumed pod trained from the start"
    comparison = compare_files(
        tmp_path / "weights" / "low.pt", tmp_path / "weights" / "reference.pt"
    )
    assert comparison.equal, comparison
