"""Kueue's preemption on a real control plane: jitckpt against the same job without it.

Each run starts the cluster of `jitckpt demo --cluster` (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, two nodes run by `local/kubelet`,
Kueue, the training-operator, the Trainer with JobSet, jitckpt's webhook
from `deploy/`) and runs its flow (`local/clusterdemo/flow.py`): a reference
job trained uninterrupted, a low-priority job of the same HF Trainer script,
and a high-priority job that arrives once the first has ended step 6; Kueue
evicts the low one, and admits it again once the high one is done.

- jitckpt: the namespace opted in; the pod is deleted with its grace period,
  the shim stops at the next step, the sidecar commits the JIT checkpoint to
  the embedded S3; the new pod restores it.
- without: the namespace not opted in; the job saves every `SAVE_STEPS` steps
  itself (HF's `save_steps`) to an output directory kept across pods (a
  volume of its own), and its pod's command resumes from the newest save
  there (`resume_from_checkpoint`), the way a job protects itself today.

Measured per kind (PyTorchJob, TrainJob), the subjects alternating, each on a
cluster of its own: the steps the resumed job trains again (the preempted
pod's last step minus its checkpoint's), from Kueue's eviction seen to that
checkpoint valid (negative: saved before the eviction), and from the
re-admission seen to the resumed pod's first step after its checkpoint and to
its first step beyond the preempted one (the progress regained), and, to take
those apart, to its trainer container started (jitckpt's waits for the
sidecar's startupProbe: the store listed, the checkpoint chosen). A step here
is the script's `--step-sleep` of 0.3 s plus its compute: what a job loses is
its steps since the last save, at whatever a step costs, so the save interval
of a real job (minutes to hours) scales the figure and jitckpt's does not move.

    python -m bench.cluster_preemption [--quick] [--reps N]
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench import harness
from bench.harness import BenchOptions
from bench.results import Case, Series

NAME = "cluster_preemption"
SAVE_STEPS = 4
JITCKPT = "jitckpt"
WITHOUT = f"the same job without jitckpt (its own saves every {SAVE_STEPS} steps)"

if TYPE_CHECKING:  # the flow imports the kubernetes client: at run time, only when run
    from local.clusterdemo.flow import FlowResult


def one_run(kind: str, protected: bool) -> FlowResult:
    """The flow once, on a cluster of its own, for ``kind``; raises if it did not end well."""
    from local.clusterdemo.cluster import kubeflow_cluster
    from local.clusterdemo.flow import run_flow
    from local.clusterdemo.jobs import KINDS
    from local.demo.destination import Destination

    def say(line: str) -> None:
        print(f"[bench] {line}", file=sys.stderr, flush=True)

    destination = Destination.embedded() if protected else None
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp,
            kubeflow_cluster(Path(tmp)) as cluster,
        ):
            api = cluster.api()
            try:
                result = run_flow(
                    api, cluster.node_root, KINDS[kind], workdir=Path(tmp) / "jobs",
                    destination=destination, say=say, logs=cluster.logs,
                    save_steps=0 if protected else SAVE_STEPS,
                )  # fmt: skip
            finally:
                api.close()
    finally:
        if destination is not None:
            destination.close()
    if not result.ok:
        raise RuntimeError(f"{kind} {'with' if protected else 'without'} jitckpt: {result}")
    return result


FIGURES: tuple[tuple[str, str, Callable[[FlowResult], float | None]], ...] = (
    ("steps trained again after the re-admission", "steps",
     lambda r: float(r.steps_redone) if r.steps_redone is not None else None),
    ("Kueue's eviction to the checkpoint it resumes from, valid (negative: before it)", "s",
     lambda r: r.evicted_to_checkpoint),
    ("re-admission to the new pod's trainer started (its log begun)", "s",
     lambda r: r.readmitted_to_trainer_start),
    ("re-admission to the first step after the checkpoint", "s",
     lambda r: r.readmitted_to_first_step),
    ("re-admission to the first step beyond the preempted one (progress regained)", "s",
     lambda r: r.readmitted_to_progress),
)  # fmt: skip


def cases_of(kind: str, results: dict[str, list[FlowResult]]) -> list[Case]:
    """The figures of ``kind``, one case each, every subject's samples."""
    note = (
        "cluster_preemption: the flow of `jitckpt demo --cluster` on a real control plane "
        "(Kueue v0.17.1, training-operator v1.9.4, Trainer v2.2.0, JobSet v0.11.1), each run "
        "on a cluster of its own, subjects alternating; a step is 0.3 s of sleep plus its "
        "compute; times are when the flow's watchers (every 0.1 s) first saw each moment"
    )
    found, case = [], f"{kind}, the high-priority job at step 6 of 24"
    for metric, unit, value in FIGURES:
        series = []
        for subject, runs in results.items():
            samples = [value(run) for run in runs]
            if any(sample is None for sample in samples):
                raise RuntimeError(f"{kind} {subject}: a run without its {metric}: {runs}")
            series.append(Series(subject, [s for s in samples if s is not None]))
        found.append(Case(NAME, case, metric, unit, True, series, note=note))
    return found


def run(options: BenchOptions) -> list[Case]:
    kinds = ["pytorchjob"] if options.quick else ["pytorchjob", "trainjob"]
    reps = options.repetitions(3, 1)
    found: list[Case] = []
    for kind in kinds:
        results: dict[str, list[FlowResult]] = {JITCKPT: [], WITHOUT: []}
        for rep in range(reps):
            for protected in (True, False) if rep % 2 == 0 else (False, True):
                result = one_run(kind, protected)
                results[JITCKPT if protected else WITHOUT].append(result)
                print(f"[bench] {kind} rep {rep} protected={protected}: {result.summary()}",
                      file=sys.stderr, flush=True)  # fmt: skip
        found += cases_of(kind, results)
    return found


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.cluster_preemption", run, __doc__))
