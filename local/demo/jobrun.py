"""One attempt of a job: its pods injected by ``mutate()`` and run by the pod runner.

This is what the cluster would do between ``kubectl apply`` and the pods
being gone: the controller's pods go through the webhook's mutation core
(the same function the admission server calls), the runner starts them, and
preemption goes through the runner's termination path (preStop hook,
SIGTERM, grace period, SIGKILL), as the kubelet's would.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from local.demo.jobpods import JobSpec
from local.demo.pytorchjob import replica_pod
from local.demo.trainjob import node_pod
from local.demo.watch import StatusPoller
from local.podrunner import Node, Pod, PodEvent, PodResult
from shim.layout import NO_JIT
from shim.log import PREFIX
from webhook.config import WebhookConfig
from webhook.jobs import PYTORCHJOB
from webhook.mutate import MutationResult, NamespaceInfo, mutate
from webhook.status import AGENT


def termination_doc(message: str) -> dict[str, Any]:
    """A sidecar's termination message as its JSON document (plain text: its message)."""
    try:
        doc = json.loads(message)
    except ValueError:
        return {"message": message}
    return doc if isinstance(doc, dict) else {"message": message}


def job_pods(job: JobSpec) -> list[dict[str, Any]]:
    """The trainer pods the job's controllers create, node rank 0 first."""
    make = replica_pod if job.kind == PYTORCHJOB else node_pod
    return [make(job, rank) for rank in range(job.nnodes)]


class JobError(RuntimeError):
    """The job did not get where the caller waited for it to get."""


@dataclass
class JobRun:
    node: Node
    job: JobSpec
    namespace: NamespaceInfo
    config: WebhookConfig
    on_event: Callable[[PodEvent], None] | None = None
    on_status: Callable[[str, dict[str, Any]], None] | None = None
    mutations: list[MutationResult] = field(default_factory=list)
    pods: list[Pod] = field(default_factory=list)
    sigterm_at: float | None = None  # wall clock of the first termination request
    preempted_at_step: int | None = None
    poller: StatusPoller | None = None
    results: list[PodResult] = field(default_factory=list)
    finished_at: float | None = None

    def start(self) -> JobRun:
        for generated in job_pods(self.job):
            result = mutate(generated, self.namespace, self.config)
            if not result.injected:
                raise JobError(f"the webhook did not inject {self.job.name}: {result.message}")
            self.mutations.append(result)
            self.pods.append(Pod(self.node, result.pod, on_event=self.on_event))
        for pod in self.pods:
            pod.start()
        ips = {pod.name: pod.ip for pod in self.pods}
        self.poller = StatusPoller(ips, on_update=self.on_status).start()
        return self

    @property
    def step(self) -> int:
        """The highest training step any sidecar has reported."""
        return self.poller.max_step if self.poller else 0

    def wait_for_step(self, step: int, timeout: float) -> int:
        """Block until the shim's progress reaches ``step``; return the step seen."""
        deadline = time.monotonic() + timeout
        while self.step < step:
            if all(pod.done for pod in self.pods):
                raise JobError(self._ended_before(step))
            if time.monotonic() > deadline:
                raise JobError(f"step {step} not reached in {timeout:.0f} s (at {self.step})")
            time.sleep(0.02)
        return self.step

    def _ended_before(self, step: int) -> str:
        """Why the job ended before ``step``: the shim left its training alone (so nothing
        held the job there), or it ended early."""
        said = self.gave_up() + self.unfollowed()
        if not said:
            return f"the job ended before step {step} (last step seen {self.step})"
        return (
            f"the shim gave up on this training, so nothing held it at step {step} and no "
            f"preemption happened (the job ran to its end; last step reported {self.step}): "
            + "; ".join(said)
        )

    def gave_up(self) -> list[str]:
        """What the shim said in the trainers' logs where it left the training alone, each
        reason once (the pid and the prefix taken off)."""
        found: list[str] = []
        for pod in self.pods:
            try:
                text = pod.container(self.trainer).log_path.read_text(errors="replace")
            except (KeyError, OSError):
                continue
            for line in text.splitlines():
                if not line.startswith(PREFIX) or NO_JIT not in line:
                    continue
                message = line.split(": ", 1)[-1]
                if message not in found:
                    found.append(message)
        return found

    def unfollowed(self) -> list[str]:
        """What the gone pods' sidecars say in their termination messages of a training
        process the shim did not follow (``unfollowed``), each once."""
        found: list[str] = []
        for pod in self.pods:
            if not pod.done:
                continue
            doc = termination_doc(pod.wait(0).message(AGENT))
            if doc.get("unfollowed"):
                found.append(f"the sidecar's termination message: {doc.get('message')}")
        return list(dict.fromkeys(found))

    def preempt(self, ranks: Sequence[int] | None = None) -> None:
        """Terminate the pods of these node ranks (all by default), as a preemption does."""
        self.preempted_at_step = self.step
        self.sigterm_at = time.time()
        chosen = range(len(self.pods)) if ranks is None else ranks
        for rank in chosen:
            self.pods[rank].terminate()

    def kill(self, rank: int) -> None:
        """The node under pod ``rank`` is lost: SIGKILL, no hooks, no grace."""
        self.sigterm_at = self.sigterm_at or time.time()
        self.pods[rank].kill()

    def wait(self, timeout: float) -> list[PodResult]:
        deadline = time.monotonic() + timeout
        try:
            for pod in self.pods:
                remaining = max(0.1, deadline - time.monotonic())
                try:
                    self.results.append(pod.wait(remaining))
                except TimeoutError:
                    running = "; ".join(pod.still_running())
                    for other in self.pods:
                        other.kill()
                    raise JobError(
                        f"pod {pod.name} still running after {timeout:.0f} s: {running}"
                    ) from None
        finally:
            if self.poller is not None:
                self.poller.stop()
        self.finished_at = time.time()
        return self.results

    @property
    def trainer(self) -> str:
        """The trainer container's name (``pytorch`` or ``node``, by the job's kind)."""
        return self.job.trainer_container

    def exit_codes(self, container: str | None = None) -> list[int | None]:
        return [result.exit_code(container or self.trainer) for result in self.results]

    def logs(self, container: str | None = None) -> list[str]:
        """Each pod's log of ``container``, the trainer by default (none for a pod that
        failed before that container started)."""
        statuses = [result.status(container or self.trainer) for result in self.results]
        return [str(status.log_path) for status in statuses if status is not None]

    def messages(self, container: str = AGENT) -> list[str]:
        return [result.message(container) for result in self.results]

    def max_steps(self) -> int | None:
        """The run's total steps as the trainers reported them (None: never reported)."""
        reported = {
            (doc.get("progress") or {}).get("max_steps")
            for doc in (self.poller.latest.values() if self.poller else [])
        }
        steps = [s for s in reported if isinstance(s, int) and s > 0]
        return max(steps) if steps else None
