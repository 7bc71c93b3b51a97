"""A benchmark job's attempts as pods, run by the local pod runner as a kubelet would.

Each attempt is the pod a PyTorchJob's controller creates for the job
(``local/demo/pytorchjob.py``, one node, one process), started by the pod
runner (``local/podrunner``) from the spec:
- jitckpt: the pod injected by ``mutate()``, as the admission webhook does in
  the cluster, in a namespace whose destination is the embedded S3 server; its
  native sidecar restores the newest valid checkpoint and the trainer starts
  when the sidecar's startupProbe passes, at the probe period the webhook
  wrote (the kubelet's, not a faster poll);
- the peers: the same pod as the user writes it, its container running
  ``bench/peer_pod.py`` (download with `s5cmd`, then the script), the S3
  credentials in its env.
A preemption is the runner's termination path (preStop, SIGTERM, the grace
period, SIGKILL). Times are ``time.monotonic()``, the clock of the script's
timeline; the runner's container times (wall clock) are converted to it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.training_run import wait_for_timeline_step
from local.background import REPO_ROOT
from local.demo.jobpods import JobSpec
from local.demo.jobrun import job_pods
from local.demo.scenario import IMAGE_ENV  # the demo's image: no downloads, one OpenMP thread
from local.podrunner import Node, ObjectStore, Pod, PodResult
from local.ports import free_port
from shim.layout import AGENT_CONTAINER
from webhook.config import WebhookConfig
from webhook.jobs import PT_CONTAINER
from webhook.mutate import NamespaceInfo, mutate

NAMESPACE = "bench"
SECRET_NAME = "bench-s3"
GRACE_SECONDS = 300


@dataclass(frozen=True)
class PodTimes:
    """When an attempt's pod started and ended (``time.monotonic()``, as the timeline)."""

    started: float
    trainer_started: float
    ended: float
    download_seconds: float | None = None
    sidecar_ready: float | None = None  # jitckpt: when its agent said "ready" (its log)


def node_for(root: Path, s3_env: dict[str, str]) -> Node:
    """The pod runner's node: its state under ``root``, the store's keys as a Secret."""
    return Node(
        root=root, objects=ObjectStore(secrets={SECRET_NAME: dict(s3_env)}), image_env=IMAGE_ENV
    )


def _to_monotonic(wall: float) -> float:
    return wall - (time.time() - time.monotonic())


@dataclass
class PodJob:
    """One job's pods, one attempt at a time; ``destination`` set: injected by jitckpt."""

    node: Node
    name: str
    s3_env: dict[str, str]
    destination: str | None = None  # the namespace's jitckpt destination; None: a peer

    @property
    def injected(self) -> bool:
        return self.destination is not None

    def namespace(self) -> NamespaceInfo:
        assert self.destination is not None
        annotations = {
            "jitckpt.io/destination": self.destination,
            "jitckpt.io/s3-secret": SECRET_NAME,
            "jitckpt.io/grace-period-seconds": str(GRACE_SECONDS),
        }
        return NamespaceInfo(NAMESPACE, {"jitckpt.io/injection": "enabled"}, annotations)

    def pod(self, command: Sequence[str]) -> dict[str, Any]:
        """The attempt's pod spec: the controller's pod, injected for jitckpt."""
        job = JobSpec(
            name=self.name,
            namespace=NAMESPACE,
            nnodes=1,
            nproc_per_node=1,
            command=list(command),
            master_port=free_port(),
            env={} if self.injected else dict(self.s3_env),
            working_dirs=[str(REPO_ROOT)],  # the image's WORKDIR: `python -m bench.…` resolves
        )
        spec = job_pods(job)[0]
        if not self.injected:
            spec["spec"]["terminationGracePeriodSeconds"] = GRACE_SECONDS
            return spec
        result = mutate(spec, self.namespace(), WebhookConfig())
        if not result.injected:
            raise RuntimeError(f"the webhook did not inject {self.name}: {result.message}")
        return result.pod

    def attempt(
        self,
        command: Sequence[str],
        timeline_path: Path,
        stop_at: int | None,
        timeout: float,
        peer_times: Path | None = None,
    ) -> PodTimes:
        """Run one pod; preempt it once its script ended step ``stop_at`` (None: let it
        finish). It ends when the pod is gone, or, run to the end, when its script exits
        (what happens after, such as jitckpt uploading the trained model, is not training)."""
        pod = Pod(self.node, self.pod(command))
        started = time.monotonic()
        pod.start()
        try:
            if stop_at is not None:
                gone = _pod_gone(pod, PT_CONTAINER)
                wait_for_timeline_step(timeline_path, stop_at, timeout, gone)
                pod.terminate()
            result = pod.wait(timeout)
        except BaseException:
            pod.kill()
            raise
        ended = time.monotonic()
        trainer = result.status(PT_CONTAINER)
        if trainer is None or trainer.started_at is None:
            raise RuntimeError(f"the trainer of {pod.name} never started: {_agent_log(result)}")
        if stop_at is None:
            if trainer.exit_code != 0:
                raise RuntimeError(
                    f"the last attempt exited {trainer.exit_code}: {_tail(trainer.log_path)}"
                )
            assert trainer.finished_at is not None
            ended = _to_monotonic(trainer.finished_at)
        if peer_times is not None:
            recorded = json.loads(peer_times.read_text())
            return PodTimes(
                started, recorded["trainer_started"], ended, recorded["download_seconds"]
            )
        ready = _agent_ready(result) if self.injected else None
        return PodTimes(started, _to_monotonic(trainer.started_at), ended, sidecar_ready=ready)


# The agent's log line once its startupProbe may pass (``sidecar/agent_cmd.py``'s format:
# logging's asctime, local time to the millisecond).
_READY_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO "
    + re.escape(f"{AGENT_CONTAINER} jitckpt.agent: ready")
    + "$"
)


def _agent_ready(result: PodResult) -> float | None:
    """When the pod's agent said it was ready (``time.monotonic()``): how long before the
    startupProbe that passed it could have passed. None when its log does not say."""
    status = result.status(AGENT_CONTAINER)
    if status is None or status.log_path is None or not status.log_path.exists():
        return None
    for line in status.log_path.read_text(errors="replace").splitlines():
        found = _READY_LINE.match(line)
        if found:
            wall = time.mktime(time.strptime(found[1], "%Y-%m-%d %H:%M:%S"))
            return _to_monotonic(wall + int(found[2]) / 1000)
    return None


def _tail(path: Path | None) -> str:
    return path.read_text(errors="replace")[-3000:] if path is not None and path.exists() else ""


def _agent_log(result: PodResult) -> str:
    return "; ".join(
        f"{name}: {_tail(status.log_path)}" for name, status in result.init_containers.items()
    )


def _pod_gone(pod: Pod, trainer: str) -> Callable[[], str | None]:
    """For ``wait_for_timeline_step``: why the pod's script cannot reach a step (it ended)."""

    def gone() -> str | None:
        if not pod.done:
            return None
        result = pod.wait(0)
        status = result.status(trainer)
        log = _tail(status.log_path) if status else _agent_log(result)
        return f"pod {pod.name} ended: {log}"

    return gone
