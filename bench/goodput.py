"""Goodput under preemption: one job run to its end through the same preemptions.

The HF Trainer workload (bench/workload.py, about 500 MB of state, a few
hundred steps; `--quick`: 50 MB, 60 steps) is preempted at the same seeded
random steps (`preemption_steps`, one in each of `PREEMPTIONS` equal spans of
the run) and restarted each time, for every subject. Every attempt is a pod
of one PyTorchJob run by the local pod runner against the embedded S3 server
(bench/podjob.py), a new pod with fresh volumes each time:
- jitckpt: the pod injected by `mutate()`; its sidecar restores the newest
  valid checkpoint and the trainer starts when the sidecar's startupProbe
  passes; the script's own periodic saves every `JITCKPT_SAVE_EVERY` steps
  (written in the background, uploaded by the sidecar) and the JIT checkpoint
  at SIGTERM.
- jitckpt JIT only: the same with no periodic saves, only the JIT checkpoint.
- periodic, N = 10 and 50: plain HF saves every N steps, each uploaded with
  `s5cmd` in `on_save` before training goes on; the pod's command downloads
  the newest complete one with `s5cmd` and starts the script, which calls
  `resume_from_checkpoint` (bench/peer_pod.py, bench/peer_store.py). SIGTERM
  ends the script, as it does one that does not handle it.
- hf-jit: transformers' `enable_jit_checkpoint`; the pod's command uploads
  that checkpoint with `s5cmd cp` once the script has exited, in the grace
  period; restarts as the periodic peers do.
- uninterrupted: the same run with no saves and no preemption, the floor.
A preemption is the pod runner's termination (preStop, SIGTERM, the grace
period) once the attempt's timeline shows the step ended; a preempted
attempt ends when its pod is gone (jitckpt: its sidecar exited after
committing; the peers: the script exited and, for hf-jit, its upload
finished). The last attempt ends when its script exits: what follows
(jitckpt uploading the trained model) is not training, and no peer does it.
Wall time to finish is the sum of the attempts, from each pod's start
(restore included) to its end; the gaps a scheduler leaves between pods are
not counted, for any subject. Steps trained twice: for each preemption, the
last step the attempt ended minus the step the next one resumed after. Time
lost per preemption: (wall time - the floor's) / the number of preemptions.
Each subject saving as a peer does is also set against that peer alone (the
"same saves" figures): jitckpt JIT only against HF's JIT, jitckpt with its
saves every 50 against HF's saves every 50, so what is compared is how a
checkpoint is taken, moved and restored, not how often.

    python -m bench.goodput [--quick] [--reps N]
"""

from __future__ import annotations

import itertools
import random
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import harness, timeline
from bench.harness import BenchOptions
from bench.podjob import PodJob, PodTimes, node_for
from bench.results import Case, Series
from bench.training_run import ModelShape, workload_argv

NAME = "goodput"
BUCKET = "bench-goodput"
SEED = 25
PREEMPTIONS = 3
JITCKPT_SAVE_EVERY = 50
JITCKPT = "jitckpt"
JITCKPT_JIT_ONLY = "jitckpt JIT only"
JITCKPT_SUBJECTS = (JITCKPT, JITCKPT_JIT_ONLY)
PERIODIC = {10: "hf periodic saves every 10 + s5cmd", 50: "hf periodic saves every 50 + s5cmd"}
HF_JIT = "hf enable_jit_checkpoint + s5cmd cp"
FLOOR = "uninterrupted, no saves (floor)"
PREEMPTED = (JITCKPT, JITCKPT_JIT_ONLY, *PERIODIC.values(), HF_JIT)
# jitckpt's subject and the peer that saves as often (the "same saves" figures).
SAME_SAVES = ((JITCKPT_JIT_ONLY, HF_JIT), (JITCKPT, PERIODIC[JITCKPT_SAVE_EVERY]))
MB = 1_000_000


@dataclass(frozen=True)
class Attempt:
    """One pod's life: from its start to its end, and the steps it trained."""

    seconds: float
    resumed_after: int  # the step its training began after (0: from the start)
    reached: int  # the last step it ended
    first_step_seconds: float  # from its start to its first training step's begin
    restore_seconds: float  # from its start to its trainer process's start
    download_seconds: float | None = None  # the peers' `s5cmd cp` of the checkpoint restored
    started_at: float = 0.0  # its pod's start, ``time.monotonic()``: the others are from here
    # A start taken apart (bench/time_to_resume.py), from the pod's start: jitckpt's agent
    # ready (its startupProbe may pass), the script's first line, its imports done.
    sidecar_ready_seconds: float | None = None
    script_start_seconds: float | None = None
    imported_seconds: float | None = None


@dataclass(frozen=True)
class Goodput:
    """A whole job under the preemptions, from its attempts."""

    attempts: list[Attempt]

    @property
    def seconds(self) -> float:
        return sum(a.seconds for a in self.attempts)

    @property
    def preemptions(self) -> int:
        return len(self.attempts) - 1

    def steps_trained_twice(self) -> int:
        """Steps an attempt ended that the next one trained again."""
        pairs = itertools.pairwise(self.attempts)
        return sum(max(0, done.reached - after.resumed_after) for done, after in pairs)

    def lost_per_preemption(self, floor_seconds: float) -> float:
        return (self.seconds - floor_seconds) / max(1, self.preemptions)


def preemption_steps(seed: int, max_steps: int, count: int) -> list[int]:
    """``count`` increasing steps, one drawn in each of ``count`` equal spans of the run
    (its first and last tenth left out, so every attempt trains and the last one too)."""
    rng = random.Random(seed)
    low, high = max(1, max_steps // 10), max_steps - max(1, max_steps // 10)
    span = (high - low) / count
    if span < 1:
        raise ValueError(f"{count} preemptions do not fit in {max_steps} steps")
    return [rng.randrange(low + round(i * span), low + round((i + 1) * span)) for i in range(count)]


def attempt_of(times: PodTimes, path: Path) -> Attempt:
    """One attempt from its pod's times and its trainer's timeline."""
    events = timeline.read(path)
    begins = timeline.times(events, "step_begin")
    ends = timeline.times(events, "step_end")
    if not begins or not ends:
        raise RuntimeError(f"no step in {path}")
    first = min(begins)
    marks = {item.event: item.t - times.started for item in events if item.step == 0}
    return Attempt(
        times.ended - times.started,
        first - 1,
        max(ends),
        begins[first] - times.started,
        times.trainer_started - times.started,
        times.download_seconds,
        times.started,
        None if times.sidecar_ready is None else times.sidecar_ready - times.started,
        marks.get("script_start"),
        marks.get("imported"),
    )


@dataclass
class JobRunner:
    """One subject's job: its attempts, pods of one job through the local pod runner, each
    on a fresh volume, one store prefix."""

    subject: str
    shape: ModelShape
    max_steps: int
    s3_env: dict[str, str]
    work: Path

    @property
    def root(self) -> str:
        """The peers' store prefix (jitckpt's job root is the webhook's, under its
        destination)."""
        return f"s3://{BUCKET}/{self.subject_key}"

    @property
    def subject_key(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.subject)[:40].strip("-").lower()

    def argv(self, out: Path, timeline_path: Path) -> list[str]:
        """The trainer container's command for this subject, with what it does on restart."""
        if self.subject == FLOOR:
            return workload_argv(self.shape, out, timeline_path, max_steps=self.max_steps)
        if self.subject in JITCKPT_SUBJECTS:
            every = JITCKPT_SAVE_EVERY if self.subject == JITCKPT else 0
            return workload_argv(
                self.shape, out, timeline_path, max_steps=self.max_steps, save_steps=every,
            )  # fmt: skip
        every = next((n for n, name in PERIODIC.items() if name == self.subject), 0)
        mode = "hf-jit" if self.subject == HF_JIT else "none"
        argv = workload_argv(
            self.shape, out, timeline_path, max_steps=self.max_steps, save_steps=every,
            on_sigterm=mode,
        )  # fmt: skip
        upload = ["--upload-to", self.root] if every else []
        return [*argv, "--resume", *upload]

    def run(self, stops: Sequence[int | None]) -> Goodput:
        node = node_for(self.work / "node", self.s3_env)
        jitckpt = self.subject in JITCKPT_SUBJECTS
        destination = f"s3://{BUCKET}/{self.subject_key}" if jitckpt else None
        job = PodJob(node, self.subject_key, self.s3_env, destination)
        attempts = []
        for number, stop_at in enumerate(stops):
            here = self.work / f"attempt-{number}"
            here.mkdir(parents=True)
            path = here / "timeline.jsonl"
            command = self.argv(here / "output", path)
            peer_times = None
            if not jitckpt and self.subject != FLOOR:
                peer_times = here / "peer-times.json"
                command = self._peer_command(command, here / "output", peer_times)
            times = job.attempt(command, path, stop_at, 600 + self.max_steps * 10, peer_times)
            attempts.append(attempt_of(times, path))
        return Goodput(attempts)

    def _peer_command(self, argv: list[str], output: Path, times: Path) -> list[str]:
        """The peer's container: restore with `s5cmd`, then the script (bench/peer_pod.py)."""
        upload = ["--upload-at-exit"] if self.subject == HF_JIT else []
        return [
            sys.executable, "-m", "bench.peer_pod", "--root", self.root,
            "--output-dir", str(output), "--times", str(times), *upload, "--", *argv,
        ]  # fmt: skip


def run(options: BenchOptions) -> list[Case]:
    from local.s3server import LocalS3

    label, state_bytes, max_steps = ("50 MB", 50 * MB, 60) if options.quick else (
        "500 MB", 500 * MB, 300
    )  # fmt: skip
    shape = ModelShape.for_state(label, state_bytes)
    stops = preemption_steps(SEED, max_steps, PREEMPTIONS)
    reps = options.repetitions(1, 1)
    subjects = (FLOOR, *PREEMPTED)
    jobs: dict[str, list[Goodput]] = {s: [] for s in subjects}
    with LocalS3() as s3:
        for rep in range(reps):
            for subject in subjects[rep % len(subjects) :] + subjects[: rep % len(subjects)]:
                s3.reset()
                s3.create_bucket(BUCKET)
                plan: list[int | None] = [None] if subject == FLOOR else [*stops, None]
                with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
                    runner = JobRunner(subject, shape, max_steps, s3.credentials_env(), Path(tmp))
                    job = runner.run(plan)
                jobs[subject].append(job)
                _say(f"rep {rep} {subject}: {job.seconds:.1f} s, attempts {job.attempts}")
    return cases(label, shape, max_steps, stops, jobs)


def _say(message: str) -> None:
    print(f"[bench] goodput {message}", file=sys.stderr, flush=True)


def cases(
    label: str, shape: ModelShape, max_steps: int, stops: list[int], jobs: dict[str, list[Goodput]]
) -> list[Case]:
    """The four figures, each subject's samples; the floor's wall time is the reference's."""
    floor = [job.seconds for job in jobs[FLOOR]]
    floor_median = sorted(floor)[len(floor) // 2]
    case = (
        f"{label} state (h={shape.hidden_size}, layers={shape.layers}), {max_steps} steps, "
        f"preempted after steps {', '.join(map(str, stops))}"
    )
    params = {"preempted_after": stops, "seed": SEED, "jitckpt_save_steps": JITCKPT_SAVE_EVERY}
    note = (
        "goodput: wall time = the attempts summed, each from its pod's start (restore "
        "included) to its end (jitckpt: the agent gone after the JIT commit; peers: the "
        "trainer gone and, for hf-jit, its s5cmd cp done); the floor trains without saves"
    )

    def figure(metric: str, unit: str, value: Callable[[Goodput], float], with_floor: bool) -> Case:
        names = [*PREEMPTED, FLOOR] if with_floor else list(PREEMPTED)
        series = [
            Series(
                name,
                [value(job) for job in jobs[name]],
                {**params, "attempts": [[a.__dict__ for a in job.attempts] for job in jobs[name]]},
            )
            for name in names
        ]
        return Case(NAME, case, metric, unit, True, series, note=note)

    def same_saves(ours: str, peer: str) -> Case:
        series = [
            Series(name, [job.lost_per_preemption(floor_median) for job in jobs[name]], params)
            for name in (ours, peer)
        ]
        return Case(
            NAME, f"{case}; same saves as the peer", "time lost per preemption", "s", True,
            series, reference=ours, note=note,
        )  # fmt: skip

    return [
        *(same_saves(ours, peer) for ours, peer in SAME_SAVES),
        figure("wall time to finish", "s", lambda job: job.seconds, True),
        figure("wall time ÷ uninterrupted", "x", lambda job: job.seconds / floor_median, False),
        figure("steps trained twice", "steps", lambda job: job.steps_trained_twice(), False),
        figure(
            "time lost per preemption",
            "s",
            lambda job: job.lost_per_preemption(floor_median),
            False,
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.goodput", run, __doc__))
