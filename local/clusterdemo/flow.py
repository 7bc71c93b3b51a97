"""The cluster demo's flow: a PyTorchJob preempted by Kueue and admitted again.

On a ``KubeflowCluster`` the flow creates only what users and platform teams
do: the namespace's opt-in (the embedded S3 store and its Secret), a
ClusterQueue whose quota holds one job, and three PyTorchJobs of the demo's
HF Trainer script, unchanged:

1. ``reference``, alone, uninterrupted: its final weights are the truth;
2. ``low`` (low priority), the same training, until it has made progress;
3. ``high`` (high priority) arrives: Kueue evicts ``low``, whose pods the
   operator deletes with their grace period; the shim stops at the next step and
   the sidecar commits the JIT checkpoint; ``high`` runs and finishes; Kueue
   admits ``low`` again, the operator creates new pods, the webhook injects
   them, the sidecar restores, and ``low`` ends with its weights compared
   bitwise with the reference's.

What the API server said of every pod is recorded (a deleted pod's last
status, its exit codes and termination messages, goes with it), and the
timeline: when ``low``'s eviction was seen, when its JIT checkpoint became
valid in the store, when it was admitted again, when its resumed trainer
logged its first step.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, watch

from local.demo.destination import SECRET_NAME, Destination
from local.demo.scenario import BUNDLED_SCRIPT, IMAGE_ENV
from local.demo.watch import CommitWatcher
from local.demo.weights import compare_files
from local.podrunner import Node
from shim.layout import JIT_EXIT_CODE
from webhook.injection import job_root
from webhook.status import AGENT

T = TypeVar("T")
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
        job: Any = custom.get_namespaced_custom_object(
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
        listed: Any = custom.list_namespaced_custom_object(group, version, NAMESPACE, plural)
        for item in listed["items"]:
            conditions = (item.get("status") or {}).get("conditions") or []
            summary = [(c["type"], c["status"], c.get("reason")) for c in conditions]
            lines.append(f"{plural} {item['metadata']['name']}: {summary}")
    pods: list[Any] = client.CoreV1Api(api).list_namespaced_pod(NAMESPACE).items
    for pod in pods:
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


class FlowError(RuntimeError):
    """The flow did not reach a state it waits for; the message says which, and what the
    cluster held then."""


def wait(
    read: Callable[[], T | None],
    timeout: float = 60.0,
    what: str = "",
    state: Callable[[], str] = lambda: "",
) -> T:
    """``read()``'s first true value, polled; ``FlowError`` with ``state()`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = read()
        if value:
            return value
        time.sleep(0.2)
    raise FlowError(f"not within {timeout:.0f} s: {what}\n{state()}")


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
        plural = doc["kind"].lower() + ("es" if doc["kind"].endswith("s") else "s")
        if "namespace" in doc["metadata"]:
            custom.create_namespaced_custom_object(group, version, NAMESPACE, plural, doc)
        else:
            custom.create_cluster_custom_object(group, version, plural, doc)


@dataclass
class Timeline:
    """When each moment of ``low``'s preemption was first seen (time.time())."""

    evicted: float | None = None
    readmitted: float | None = None
    resumed_step: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def follow(
        self, api: client.ApiClient, node_root: Path, resumed_from: Callable[[], int | None]
    ) -> threading.Thread:
        custom = client.CustomObjectsApi(api)

        def conditions() -> dict[str, str]:
            items: Any = custom.list_namespaced_custom_object(
                KUEUE, "v1beta2", NAMESPACE, "workloads"
            )
            for item in items["items"]:
                owners = item["metadata"].get("ownerReferences") or []
                if any(o.get("name") == "low" for o in owners):
                    found = (item.get("status") or {}).get("conditions") or []
                    return {c["type"]: c["status"] for c in found}
            return {}

        def loop() -> None:
            while not self._stop.wait(0.1):
                now, seen = time.time(), conditions()
                if self.evicted is None and seen.get("Evicted") == "True":
                    self.evicted = now
                elif (
                    self.evicted is not None
                    and self.readmitted is None
                    and (seen.get("Admitted") == "True" and seen.get("Evicted") != "True")
                ):
                    self.readmitted = now
                step = resumed_from()
                if (
                    self.readmitted is not None
                    and self.resumed_step is None
                    and step is not None
                    and progress(node_root, "low-master-0", step + 1)()
                ):
                    self.resumed_step = now

        thread = threading.Thread(target=loop, name="timeline", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()


@dataclass
class FlowResult:
    """What the flow saw, as the JSON summary says it."""

    jit_step: int | None
    preempted_exit_code: int | None
    resumed_exit_code: int | None
    high_exit_code: int | None
    pods_of_low: int
    weights_equal: bool
    differences: list[str]
    evicted_to_committed: float | None
    readmitted_to_first_step: float | None

    @property
    def ok(self) -> bool:
        return (
            self.jit_step is not None
            and self.preempted_exit_code == JIT_EXIT_CODE
            and self.resumed_exit_code == 0
            and self.high_exit_code == 0
            and self.pods_of_low >= 2
            and self.weights_equal
        )

    def summary(self) -> dict[str, Any]:
        return {"ok": self.ok, **{k: v for k, v in vars(self).items()}}


def run_flow(
    api: client.ApiClient,
    node_root: Path,
    *,
    workdir: Path,
    destination: Destination,
    say: Callable[[str], None],
    logs: Callable[[], str] = lambda: "",
) -> FlowResult:
    """The three jobs on the cluster ``api`` reaches; ``workdir`` gets their outputs."""
    custom = client.CustomObjectsApi(api)
    (workdir / "weights").mkdir(parents=True, exist_ok=True)
    opt_in(api, destination)
    say(f"namespace {NAMESPACE} opted in (store {destination.uri}); ClusterQueue one-job "
        "holds one job of 1 CPU, preempting lower priorities")  # fmt: skip
    recorder = PodRecorder(client.CoreV1Api(api)).start()
    root = job_root(destination.uri, NAMESPACE, "low")
    watcher = CommitWatcher(lambda: destination.open_store(root, Node(workdir / "store-view")), 0.1)
    watcher.start()
    timeline = Timeline()

    def jit_step() -> int | None:
        return min(watcher.valid_at) if watcher.valid_at else None

    timeline.follow(api, node_root, jit_step)

    def state() -> str:
        return f"{cluster_state(api, node_root)}\n{logs()}"

    def create(job: dict[str, Any]) -> None:
        custom.create_namespaced_custom_object("kubeflow.org", "v1", NAMESPACE, "pytorchjobs", job)

    try:
        create(pytorchjob("reference", "low", training("reference", workdir), workdir))
        say("PyTorchJob reference (low priority): admitted by Kueue, trains uninterrupted")
        wait(job_condition(custom, "reference", "Succeeded"), 240, "the reference's end", state)
        create(pytorchjob("low", "low", training("low", workdir), workdir))
        say(f"PyTorchJob low (low priority): admitted, training {MAX_STEPS} steps")
        wait(progress(node_root, "low-master-0", PROGRESS_STEP), 180, "low's progress", state)
        create(pytorchjob("high", "high", ["python", "-c", "print('high ran')"], workdir))
        say(f"step {PROGRESS_STEP} reached: PyTorchJob high (high priority) submitted")
        wait(job_condition(custom, "high", "Succeeded"), 240, "high's end", state)
        say("high ran and finished (Kueue had preempted low for it)")
        wait(job_condition(custom, "low", "Succeeded"), 300, "low's end after resuming", state)
    finally:
        recorder.stop()
        watcher.stop()
        timeline.stop()
    return _judge(recorder, watcher, timeline, workdir, say)


def _judge(
    recorder: PodRecorder,
    watcher: CommitWatcher,
    timeline: Timeline,
    workdir: Path,
    say: Callable[[str], None],
) -> FlowResult:
    first, *later = recorder.of_job("low")
    preempted = container(first[-1], "pytorch")
    sidecar = container(first[-1], AGENT)
    doc = (
        json.loads(sidecar.state.terminated.message) if sidecar and sidecar.state.terminated else {}
    )
    committed = doc.get("last_committed") or {}
    step = committed.get("step") if committed.get("kind") == "jit" else None
    (high, *_) = recorder.of_job("high") or [[None]]
    resumed = container(later[-1][-1], "pytorch") if later else None

    def code(status: Any) -> int | None:
        terminated = status.state.terminated if status is not None else None
        return terminated.exit_code if terminated is not None else None

    weights = workdir / "weights"
    comparison = compare_files(weights / "low.pt", weights / "reference.pt")
    committed_at = watcher.valid_at.get(step) if step is not None else None
    result = FlowResult(
        jit_step=step,
        preempted_exit_code=code(preempted),
        resumed_exit_code=code(resumed),
        high_exit_code=code(container(high[-1], "pytorch")) if high[-1] is not None else None,
        pods_of_low=1 + len(later),
        weights_equal=comparison.equal,
        differences=comparison.differing[:5],
        evicted_to_committed=(
            committed_at - timeline.evicted if committed_at and timeline.evicted else None
        ),
        readmitted_to_first_step=(
            timeline.resumed_step - timeline.readmitted
            if timeline.resumed_step and timeline.readmitted
            else None
        ),
    )
    committed_in = _seconds(result.evicted_to_committed)
    say(f"low's first pod: trainer exit {result.preempted_exit_code}, JIT checkpoint-{step} "
        f"committed {committed_in} after Kueue's eviction was seen")  # fmt: skip
    say(f"low admitted again: new pod, restored and resumed; its first step "
        f"{_seconds(result.readmitted_to_first_step)} after the re-admission")  # fmt: skip
    say("weights bitwise equal to the uninterrupted run's" if comparison.equal
        else f"weights differ: {', '.join(comparison.differing[:5])}")  # fmt: skip
    return result


def _seconds(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "(not seen)"
