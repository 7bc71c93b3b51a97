"""The cluster demo's flow: a PyTorchJob or a TrainJob preempted by Kueue and admitted again.

On a ``KubeflowCluster`` the flow creates only what users and platform teams
do: the namespace's opt-in (the embedded S3 store and its Secret), a
ClusterQueue whose quota holds one job, and three jobs of one kind of the
demo's HF Trainer script, unchanged:

1. ``reference``, alone, uninterrupted: its final weights are the truth;
2. ``low`` (low priority), the same training, until it has made progress;
3. ``high`` (high priority) arrives: Kueue evicts ``low``, whose pods the
   controllers delete with their grace period (the training-operator; or the
   Trainer suspending the JobSet, whose Jobs' pods the Job controller deletes);
   the shim stops at the next step and the sidecar commits the JIT checkpoint;
   ``high`` runs and finishes; Kueue admits ``low`` again, the controllers
   create new pods, the webhook injects
   them, the sidecar restores, and ``low`` ends with its weights compared
   bitwise with the reference's.

What the API server said of every pod is recorded (``observe.py``) (a deleted pod's last
status, its exit codes and termination messages, goes with it), and the
timeline: when ``low``'s eviction was seen, when its JIT checkpoint became
valid in the store, when it was admitted again, when its resumed trainer
logged its first step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from local.clusterdemo.jobs import (
    MAX_STEPS,
    NAMESPACE,
    PROGRESS_STEP,
    JobKind,
    opt_in,
    training,
)
from local.clusterdemo.observe import (
    PodRecorder,
    SavedCheckpoints,
    Timeline,
    cluster_state,
    container,
    progress,
    succeeded,
    wait,
)
from local.demo.destination import Destination
from local.demo.watch import CommitWatcher
from local.demo.weights import compare_files
from local.podrunner import Node
from shim.layout import JIT_EXIT_CODE
from webhook.injection import job_root
from webhook.status import AGENT


@dataclass
class FlowResult:
    """What the flow saw, as the JSON summary says it."""

    kind: str
    protected: bool  # jitckpt's; or the job's own periodic saves, not opted in
    jit_step: int | None
    preempted_exit_code: int | None
    resumed_exit_code: int | None
    high_exit_code: int | None
    pods_of_low: int
    weights_equal: bool
    differences: list[str]
    evicted_to_committed: float | None
    readmitted_to_first_step: float | None
    # the last step the preempted pod ended, and the checkpoint the next one resumed from
    preempted_at_step: int | None
    checkpoint_step: int | None
    # from the eviction to that checkpoint valid (negative: saved before the eviction)
    evicted_to_checkpoint: float | None
    # from the re-admission to the first step beyond the preempted one: progress regained
    readmitted_to_progress: float | None
    # from the re-admission to the next pod's trainer container started (its log begun)
    readmitted_to_trainer_start: float | None

    @property
    def steps_redone(self) -> int | None:
        if self.preempted_at_step is None or self.checkpoint_step is None:
            return None
        return self.preempted_at_step - self.checkpoint_step

    @property
    def ok(self) -> bool:
        ran = self.resumed_exit_code == 0 and self.high_exit_code == 0 and self.pods_of_low >= 2
        if not self.protected:
            return ran
        return (
            ran
            and self.jit_step is not None
            and self.preempted_exit_code == JIT_EXIT_CODE
            and self.weights_equal
        )

    def summary(self) -> dict[str, Any]:
        return {"ok": self.ok, "steps_redone": self.steps_redone, **vars(self)}


def run_flow(
    api: client.ApiClient,
    node_root: Path,
    kind: JobKind,
    *,
    workdir: Path,
    destination: Destination | None,
    say: Callable[[str], None],
    logs: Callable[[], str] = lambda: "",
    save_steps: int = 0,
) -> FlowResult:
    """The three jobs of ``kind`` on the cluster ``api`` reaches; ``workdir`` gets their
    outputs. ``destination`` None: the same jobs without jitckpt (the namespace not
    opted in), each saving every ``save_steps`` steps itself and resuming from its
    newest save, which its output directory keeps."""
    custom = client.CustomObjectsApi(api)
    (workdir / "weights").mkdir(parents=True, exist_ok=True)
    opt_in(api, destination)
    quota = "ClusterQueue one-job holds one job of 1 CPU, preempting lower priorities"
    if destination is not None:
        say(f"namespace {NAMESPACE} opted in (store {destination.uri}); {quota}")
    else:
        say(f"namespace {NAMESPACE}, not opted in: each job saves every {save_steps} steps "
            f"and resumes from its newest save itself; {quota}")  # fmt: skip
    recorder = PodRecorder(client.CoreV1Api(api)).start()
    watcher = _checkpoints(destination, workdir)
    timeline = Timeline()
    timeline.follow(api, node_root, kind, watcher.valid_at)

    def state() -> str:
        return f"{cluster_state(api, node_root, kind)}\n{logs()}"

    def create(name: str, priority: str, command: list[str]) -> None:
        job = kind.manifest(name, priority, command, workdir, keep_output=save_steps > 0)
        custom.create_namespaced_custom_object(
            kind.group, kind.version, NAMESPACE, kind.plural, job
        )

    def ended(name: str) -> Callable[[], bool]:
        return succeeded(custom, kind, name)

    title = kind.api_kind
    try:
        create("reference", "low", training("reference", workdir, save_steps))
        say(f"{title} reference (low priority): admitted by Kueue, trains uninterrupted")
        wait(ended("reference"), 240, "the reference's end", state)
        create("low", "low", training("low", workdir, save_steps))
        say(f"{title} low (low priority): admitted, training {MAX_STEPS} steps")
        wait(progress(node_root, kind, "low", PROGRESS_STEP), 180, "low's progress", state)
        create("high", "high", ["python", "-c", "print('high ran')"])
        say(f"step {PROGRESS_STEP} reached: {title} high (high priority) submitted")
        wait(ended("high"), 240, "high's end", state)
        say("high ran and finished (Kueue had preempted low for it)")
        wait(ended("low"), 300, "low's end after resuming", state)
    finally:
        recorder.stop()
        watcher.stop()
        timeline.stop()
    return _judge(
        recorder, watcher.valid_at, timeline, workdir, say,
        kind=kind, protected=destination is not None,
    )  # fmt: skip


def _checkpoints(
    destination: Destination | None, workdir: Path
) -> CommitWatcher | SavedCheckpoints:
    """What says when each of ``low``'s checkpoints became valid: the store jitckpt commits
    to, or the job's own output directory."""
    if destination is None:
        return SavedCheckpoints(workdir / "output" / "low").start()
    root = job_root(destination.uri, NAMESPACE, "low")
    view = Node(workdir / "store-view")
    return CommitWatcher(lambda: destination.open_store(root, view), 0.1).start()


def _judge(
    recorder: PodRecorder,
    valid_at: dict[int, float],
    timeline: Timeline,
    workdir: Path,
    say: Callable[[str], None],
    *,
    kind: JobKind,
    protected: bool,
) -> FlowResult:
    first, *later = recorder.of_job(kind, "low")
    preempted = container(first[-1], kind.container)
    sidecar = container(first[-1], AGENT)
    doc = (
        json.loads(sidecar.state.terminated.message) if sidecar and sidecar.state.terminated else {}
    )
    committed = doc.get("last_committed") or {}
    step = committed.get("step") if committed.get("kind") == "jit" else None
    (high, *_) = recorder.of_job(kind, "high") or [[None]]
    resumed = container(later[-1][-1], kind.container) if later else None

    def code(status: Any) -> int | None:
        terminated = status.state.terminated if status is not None else None
        return terminated.exit_code if terminated is not None else None

    weights = workdir / "weights"
    comparison = compare_files(weights / "low.pt", weights / "reference.pt")
    committed_at = valid_at.get(step) if step is not None else None
    checkpoint_at = (
        valid_at.get(timeline.checkpoint_step) if timeline.checkpoint_step is not None else None
    )

    def since(start: float | None, end: float | None) -> float | None:
        return end - start if start is not None and end is not None else None

    result = FlowResult(
        kind=kind.name,
        protected=protected,
        jit_step=step,
        preempted_exit_code=code(preempted),
        resumed_exit_code=code(resumed),
        high_exit_code=code(container(high[-1], kind.container)) if high[-1] is not None else None,
        pods_of_low=1 + len(later),
        weights_equal=comparison.equal,
        differences=comparison.differing[:5],
        evicted_to_committed=since(timeline.evicted, committed_at),
        readmitted_to_first_step=since(timeline.readmitted, timeline.resumed_step),
        preempted_at_step=timeline.preempted_at_step,
        checkpoint_step=timeline.checkpoint_step,
        evicted_to_checkpoint=since(timeline.evicted, checkpoint_at),
        readmitted_to_progress=since(timeline.readmitted, timeline.progressed),
        readmitted_to_trainer_start=since(timeline.readmitted, timeline.trainer_started),
    )
    if result.protected:
        committed_in = _seconds(result.evicted_to_committed)
        say(f"low's first pod: trainer exit {result.preempted_exit_code}, JIT checkpoint-{step} "
            f"committed {committed_in} after Kueue's eviction was seen")  # fmt: skip
    else:
        say(f"low's first pod: trainer exit {result.preempted_exit_code} after step "
            f"{result.preempted_at_step}; its newest save: checkpoint-{result.checkpoint_step} "
            f"({result.steps_redone} steps to redo)")  # fmt: skip
    first_step = _seconds(result.readmitted_to_first_step)
    beyond = _seconds(result.readmitted_to_progress)
    say(f"low admitted again: new pod, resumed from checkpoint-{result.checkpoint_step}; its "
        f"first step after it {first_step}, beyond the preempted one {beyond} after the "
        "re-admission")  # fmt: skip
    say("weights bitwise equal to the uninterrupted run's" if comparison.equal
        else f"weights differ: {', '.join(comparison.differing[:5])}")  # fmt: skip
    return result


def _seconds(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "(not seen)"
