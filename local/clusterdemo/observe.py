"""How the cluster demo watches its jobs: every pod's statuses as the API server held
them, the jobs' conditions, the trainers' logs on the nodes, the timeline of the
preemption, and what the cluster held when a wait ran out."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, watch

from local.clusterdemo.jobs import KUEUE, NAMESPACE, JobKind

T = TypeVar("T")


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
            except Exception:  # the stream closed under it: watch again, soon
                self._stopped.wait(0.5)

    def start(self) -> PodRecorder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()

    def of_job(self, kind: JobKind, job: str) -> list[list[Any]]:
        """Each pod of ``job``, first created first, as the list of its states."""
        pods = [
            states
            for states in self.seen.values()
            if (states[0].metadata.labels or {}).get(kind.pod_label) == job
        ]
        return sorted(pods, key=lambda states: states[0].metadata.creation_timestamp)


def container(pod: Any, name: str) -> Any:
    statuses = (pod.status.container_statuses or []) + (pod.status.init_container_statuses or [])
    return next((s for s in statuses if s.name == name), None)


def progress(node_root: Path, kind: JobKind, job: str, step: int) -> Callable[[], bool]:
    """Whether the trainer of ``job`` (any instance of its pod) has logged step ``step``."""
    logs = f"*/pods/{NAMESPACE}_{kind.trainer_pod(job)}_*/containers/{kind.container}/log"

    def read() -> bool:
        for log in node_root.glob(logs):
            if f"step {step}/" in log.read_text(errors="replace"):
                return True
        return False

    return read


def succeeded(custom: client.CustomObjectsApi, kind: JobKind, name: str) -> Callable[[], bool]:
    """Whether the job ``name`` holds its kind's condition of a good end."""

    def read() -> bool:
        job: Any = custom.get_namespaced_custom_object(
            kind.group, kind.version, NAMESPACE, kind.plural, name
        )
        conditions = (job.get("status") or {}).get("conditions") or []
        return any(c["type"] == kind.succeeded and c["status"] == "True" for c in conditions)

    return read


def cluster_state(api: client.ApiClient, node_root: Path, kind: JobKind) -> str:
    """What a failure needs: the jobs' and workloads' conditions, each pod's phase and
    containers, the last lines of each container's log."""
    custom, lines = client.CustomObjectsApi(api), []
    for group, version, plural in ((kind.group, kind.version, kind.plural),
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


_STEP = re.compile(r"step ([0-9]+)/")


def logged_steps(log: Path) -> list[int]:
    """The steps a trainer's log says it ended (the bundled script's ``step N/M`` lines)."""
    return [int(n) for n in _STEP.findall(log.read_text(errors="replace"))]


class SavedCheckpoints:
    """A job's own periodic saves in its persistent output directory (a job without
    jitckpt): ``valid_at[step]`` is when ``checkpoint-<step>`` was first seen whole
    (HF's ``trainer_state.json`` in it, which the Trainer writes last)."""

    def __init__(self, directory: Path, interval: float = 0.1) -> None:
        self.directory = directory
        self.interval = interval
        self.valid_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="saved-checkpoints", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for state in self.directory.glob("checkpoint-*/trainer_state.json"):
                step = state.parent.name.removeprefix("checkpoint-")
                if step.isdigit():
                    self.valid_at.setdefault(int(step), time.time())

    def start(self) -> SavedCheckpoints:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Timeline:
    """When each moment of ``low``'s preemption was first seen (time.time()), and the
    steps that say what it cost: the last step its preempted pod ended, the checkpoint
    it resumed from (the newest valid at its re-admission), and in the pod after it,
    the first step after that checkpoint and the first beyond the preempted one."""

    evicted: float | None = None
    readmitted: float | None = None
    trainer_started: float | None = None  # the next pod's trainer container, its log begun
    resumed_step: float | None = None
    progressed: float | None = None
    preempted_at_step: int | None = None
    checkpoint_step: int | None = None
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def follow(
        self,
        api: client.ApiClient,
        node_root: Path,
        kind: JobKind,
        valid_at: dict[int, float],
    ) -> threading.Thread:
        """Follow ``low``; ``valid_at``: when each of its checkpoints became valid."""
        custom = client.CustomObjectsApi(api)
        logs = f"*/pods/{NAMESPACE}_{kind.trainer_pod('low')}_*/containers/{kind.container}/log"
        first_logs: set[Path] = set()

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

        def readmission(now: float) -> None:
            self.readmitted = now
            # the preempted pod is gone by then: its log is whole
            self.preempted_at_step = max(
                (step for log in first_logs for step in logged_steps(log)), default=0
            )
            before = [step for step, at in valid_at.items() if at <= now]
            self.checkpoint_step = max(before, default=0)

        def later_pods(now: float) -> None:
            later = [log for log in node_root.glob(logs) if log not in first_logs]
            if self.trainer_started is None and later:
                self.trainer_started = now
            steps = {step for log in later for step in logged_steps(log)}
            if self.resumed_step is None and (self.checkpoint_step or 0) + 1 in steps:
                self.resumed_step = now
            if self.progressed is None and (self.preempted_at_step or 0) + 1 in steps:
                self.progressed = now

        def loop() -> None:
            while not self._stop.wait(0.1):
                now, seen = time.time(), conditions()
                if self.evicted is None and seen.get("Evicted") == "True":
                    self.evicted = now
                    first_logs.update(node_root.glob(logs))
                elif (
                    self.evicted is not None
                    and self.readmitted is None
                    and (seen.get("Admitted") == "True" and seen.get("Evicted") != "True")
                ):
                    readmission(now)
                if self.readmitted is not None:
                    later_pods(now)

        thread = threading.Thread(target=loop, name="timeline", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
