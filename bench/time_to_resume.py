"""Time to resume: from a new pod's start to its first training step after the restore.

For each size, one job per subject is stopped after step `STOP_AFTER_STEP`
(SIGTERM; its checkpoint reaches the store) and started again as a new pod
through the local pod runner, the way bench/goodput.py runs every attempt
(the resumed pod is stopped a few steps later):
- jitckpt: the injected pod's sidecar starts and chooses the newest valid
  checkpoint; when the shim loads it (a framework save), the sidecar reports
  ready at once and the trainer starts during the download (the startupProbe,
  an exec that asks the sidecar every 50 ms, passes). The trainer's interpreter,
  imports and model construction run while the bytes arrive, and the shim
  waits for the restore only where the framework reads the checkpoint.
- peer: the pod's command runs `s5cmd ls` for the newest complete checkpoint,
  `s5cmd cp` of it, then the script with `resume_from_checkpoint` (HF's
  `enable_jit_checkpoint` wrote it at the SIGTERM, the pod's `s5cmd cp`
  uploaded it).
- floor: the peer's own `s5cmd cp` (bytes ÷ s5cmd's download throughput)
  plus the framework's own load, the peer's time from its script's start to
  its first step (the files in place): nothing of the restore can be faster
  than moving its bytes and loading them.
Measured to the first `step_begin` of the resumed run's timeline.

What every pod start pays: a new pod with nothing to restore (an empty store),
jitckpt's injected pod against the same pod without jitckpt (the script alone,
as goodput's floor runs it), from the pod's start to its first step, the
subjects alternating. The same starts taken apart, each from the pod's start:
jitckpt's agent ready (its log's "ready": the startupProbe may pass from then
on), the trainer's process start (the probe passed: its exec asks every 50 ms),
the script's first line (the interpreter and the shim's activation),
its imports done (torch and transformers, the shim's post-import hooks), the
first step (the model, the Trainer and the shim's hello); and the trainer's
own path, its process start to its first step (what the shim, and a sidecar
competing for the cores, add to it).

    python -m bench.time_to_resume [--quick] [--reps N]
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench import goodput, harness
from bench.goodput import BUCKET, HF_JIT, JITCKPT, JITCKPT_JIT_ONLY, Attempt, JobRunner
from bench.harness import BenchOptions
from bench.results import Case, Series
from bench.training_run import ModelShape

if TYPE_CHECKING:
    from local.s3server import LocalS3

NAME = "time_to_resume"
STOP_AFTER_STEP = 2
# The resumed pod is stopped too, a few steps on: its first step is all that is measured,
# and a run that reached its end before HF's JIT save (3 s after SIGTERM) saves nothing.
STOP_RESUMED_AFTER_STEP = STOP_AFTER_STEP + 3
MAX_STEPS = 100
PEER = "s5cmd cp + resume_from_checkpoint"
FLOOR = "s5cmd download + the framework's own load (floor)"
MB = 1_000_000
# A fresh start is stopped once it ended its first step: that step's begin is all it measures.
FRESH_STOP_AFTER_STEP = 1
WITHOUT = "the same pod without jitckpt"
# (metric, the attempt's figure): the stages of a start, each from the pod's start.
STAGES = (
    ("pod start to the trainer's process start", lambda a: a.restore_seconds),
    ("pod start to the script's first line", lambda a: a.script_start_seconds),
    ("pod start to the script's imports done", lambda a: a.imported_seconds),
)


def floor_seconds(peer: Attempt) -> float:
    """The peer's `s5cmd cp` plus the framework's own load: from its process start (the
    files in place, after `s5cmd ls` and `s5cmd cp`) to its first step."""
    if peer.download_seconds is None:
        raise ValueError("the peer restored nothing")
    return peer.download_seconds + peer.first_step_seconds - peer.restore_seconds


def resumed(subject: str, shape: ModelShape, s3_env: dict[str, str]) -> Attempt:
    """The second attempt of a job stopped after `STOP_AFTER_STEP`: the resumed pod."""
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        runner = JobRunner(subject, shape, MAX_STEPS, s3_env, Path(tmp))
        job = runner.run([STOP_AFTER_STEP, STOP_RESUMED_AFTER_STEP])
    attempt = job.attempts[1]
    if attempt.resumed_after < STOP_AFTER_STEP:
        raise RuntimeError(f"{subject} resumed after step {attempt.resumed_after}, not restored")
    return attempt


def fresh(subject: str, shape: ModelShape, s3_env: dict[str, str]) -> Attempt:
    """A job's first pod, nothing in the store: stopped once it ended its first step."""
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        runner = JobRunner(subject, shape, MAX_STEPS, s3_env, Path(tmp))
        return runner.run([FRESH_STOP_AFTER_STEP]).attempts[0]


def fresh_starts(label: str, shape: ModelShape, reps: int, s3: LocalS3) -> list[Case]:
    """What every pod start pays: jitckpt's pod with nothing to restore and the same pod
    without jitckpt, ``reps`` starts each, alternating, first step and stages."""
    names = {JITCKPT_JIT_ONLY: JITCKPT, goodput.FLOOR: WITHOUT}
    attempts: dict[str, list[Attempt]] = {JITCKPT: [], WITHOUT: []}
    for rep in range(reps):
        order = (
            (JITCKPT_JIT_ONLY, goodput.FLOOR) if rep % 2 == 0 else (goodput.FLOOR, JITCKPT_JIT_ONLY)
        )
        for subject in order:
            s3.reset()
            s3.create_bucket(BUCKET)
            attempt = fresh(subject, shape, s3.credentials_env())
            attempts[names[subject]].append(attempt)
            print(f"[bench] start {label} rep {rep} {names[subject]}: {attempt}", file=sys.stderr)
    case = f"{label} state (h={shape.hidden_size}, layers={shape.layers}), nothing to restore"
    note = (
        "time_to_resume: a new pod with nothing to restore through the local pod runner, "
        "subjects alternating; jitckpt's trainer starts at the startupProbe that passes "
        "(an exec at the sidecar's start that asks /readyz every 50 ms); the stages are each "
        "from the pod's start (agent ready: its log's 'ready' line)"
    )

    def figure(metric: str, value: Callable[[Attempt], float | None], who: list[str]) -> Case:
        series = []
        for name in who:
            samples = [value(a) for a in attempts[name]]
            if any(sample is None for sample in samples):
                raise RuntimeError(f"{name}: a start without its {metric}: {attempts[name]}")
            series.append(Series(name, [s for s in samples if s is not None]))
        return Case(NAME, case, metric, "s", True, series, note=note)

    both = [JITCKPT, WITHOUT]
    return [
        figure("new pod's start to its first step", lambda a: a.first_step_seconds, both),
        figure("pod start to jitckpt's agent ready", lambda a: a.sidecar_ready_seconds, [JITCKPT]),
        *(figure(metric, value, both) for metric, value in STAGES),
        figure(
            "the trainer's process start to its first step (its own path)",
            lambda a: a.first_step_seconds - a.restore_seconds,
            both,
        ),
    ]


def run(options: BenchOptions) -> list[Case]:
    from local.s3server import LocalS3

    fresh_label, fresh_bytes = ("50 MB", 50 * MB) if options.quick else ("500 MB", 500 * MB)
    sizes = [("50 MB", 50 * MB)]
    if not options.quick:
        sizes += [("500 MB", 500 * MB), ("2 GB", 2000 * MB)]
    reps = options.repetitions(3, 2)
    found: list[Case] = []
    with LocalS3() as s3:
        shape = ModelShape.for_state(fresh_label, fresh_bytes)
        found += fresh_starts(fresh_label, shape, options.repetitions(5, 5), s3)
        for label, state_bytes in sizes:
            shape = ModelShape.for_state(label, state_bytes)
            samples: dict[str, list[float]] = {JITCKPT: [], PEER: [], FLOOR: []}
            for rep in range(reps if state_bytes < 2000 * MB else min(reps, 1)):
                for subject in (JITCKPT, HF_JIT) if rep % 2 == 0 else (HF_JIT, JITCKPT):
                    s3.reset()
                    s3.create_bucket(BUCKET)
                    attempt = resumed(subject, shape, s3.credentials_env())
                    name = JITCKPT if subject == JITCKPT else PEER
                    samples[name].append(attempt.first_step_seconds)
                    if subject == HF_JIT:
                        samples[FLOOR].append(floor_seconds(attempt))
                    print(f"[bench] resume {label} rep {rep} {name}: {attempt}", file=sys.stderr)
            found.append(
                Case(
                    NAME,
                    f"{label} state (h={shape.hidden_size}, layers={shape.layers})",
                    "new pod's start to its first step after the restore",
                    "s",
                    True,
                    [Series(name, values) for name, values in samples.items()],
                    note="time_to_resume: a job stopped after step 2 started again as a new "
                    "pod through the local pod runner (jitckpt: once the sidecar has chosen the "
                    "checkpoint, the trainer starts at the kubelet's next 1 s startupProbe, "
                    "during the download, and waits for it where the framework reads it); "
                    "floor = the peer's s5cmd cp + its script's start to first step",
                )
            )
    return found


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.time_to_resume", run, __doc__))
