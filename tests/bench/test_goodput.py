"""Goodput's accounting: the seeded preemptions, steps trained twice, time lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.goodput import (
    FLOOR,
    HF_JIT,
    JITCKPT,
    JITCKPT_JIT_ONLY,
    PERIODIC,
    Attempt,
    Goodput,
    JobRunner,
    attempt_of,
    cases,
    preemption_steps,
)
from bench.podjob import PodTimes
from bench.time_to_resume import floor_seconds
from bench.training_run import ModelShape


def test_preemptions_are_the_same_for_every_subject_and_spread_over_the_run() -> None:
    steps = preemption_steps(25, 300, 3)
    assert steps == preemption_steps(25, 300, 3)
    assert steps != preemption_steps(26, 300, 3)
    assert len(steps) == 3
    assert steps == sorted(set(steps))
    assert steps[0] >= 30 and steps[-1] < 270
    # one in each third of the run between its first and last tenth
    assert [(s - 30) * 3 // 240 for s in steps] == [0, 1, 2]


def test_too_many_preemptions_for_the_run_are_refused() -> None:
    with pytest.raises(ValueError):
        preemption_steps(25, 4, 3)


def _attempt(seconds: float, resumed_after: int, reached: int) -> Attempt:
    return Attempt(seconds, resumed_after, reached, first_step_seconds=5.0, restore_seconds=1.0)


def test_steps_trained_twice_and_time_lost_per_preemption() -> None:
    # the last save before the first preemption at 10: 7 steps again; then resumed exactly
    # where it stopped; then nothing saved since 34: 7 steps again
    attempts = [_attempt(10.0, 0, 17), _attempt(12.0, 10, 34), _attempt(11.0, 34, 41)]
    job = Goodput([*attempts, _attempt(9.0, 34, 60)])
    assert job.seconds == 42.0
    assert job.preemptions == 3
    assert job.steps_trained_twice() == 7 + 0 + 7
    assert job.lost_per_preemption(30.0) == pytest.approx(4.0)


def test_an_uninterrupted_run_trains_nothing_twice() -> None:
    job = Goodput(
        [Attempt(30.0, resumed_after=0, reached=60, first_step_seconds=5.0, restore_seconds=1.0)]
    )
    assert job.steps_trained_twice() == 0
    assert job.lost_per_preemption(30.0) == 0.0


def test_an_attempt_reads_where_it_began_and_ended_from_its_timeline(tmp_path: Path) -> None:
    path = tmp_path / "timeline.jsonl"
    events = [("step_begin", 11, 1.0), ("step_end", 11, 2.0), ("step_begin", 12, 2.1)]
    events += [("step_end", 12, 3.0), ("save_begin", 12, 3.0), ("step_begin", 13, 3.5)]
    path.write_text(
        "".join(json.dumps({"event": e, "step": s, "t": t}) + "\n" for e, s, t in events)
    )
    times = PodTimes(started=0.25, trainer_started=0.5, ended=4.25, download_seconds=0.25)
    attempt = attempt_of(times, path)
    assert attempt == Attempt(
        4.0, 10, 12, 0.75, restore_seconds=0.25, download_seconds=0.25, started_at=0.25
    )


def test_an_attempt_takes_its_start_apart_from_its_timeline_and_pod_times(
    tmp_path: Path,
) -> None:
    """The script's first line and its imports done (step 0 marks) and the agent's ready,
    each from the pod's start; a timeline or a pod without them leaves them unset."""
    path = tmp_path / "timeline.jsonl"
    events = [("script_start", 0, 2.0), ("imported", 0, 5.0), ("step_begin", 1, 6.0)]
    events += [("step_end", 1, 6.5)]
    path.write_text(
        "".join(json.dumps({"event": e, "step": s, "t": t}) + "\n" for e, s, t in events)
    )
    times = PodTimes(started=1.0, trainer_started=1.75, ended=7.0, sidecar_ready=1.5)
    attempt = attempt_of(times, path)
    assert (attempt.sidecar_ready_seconds, attempt.restore_seconds) == (0.5, 0.75)
    assert (attempt.script_start_seconds, attempt.imported_seconds) == (1.0, 4.0)
    assert attempt.first_step_seconds == 5.0


def test_the_resume_floor_is_the_download_plus_the_framework_load() -> None:
    # 0.5 s s5cmd ls + 1.5 s s5cmd cp before the process, 4 s from its start to step 1
    peer = Attempt(9.0, 2, 4, first_step_seconds=6.0, restore_seconds=2.0, download_seconds=1.5)
    assert floor_seconds(peer) == pytest.approx(1.5 + 4.0)
    with pytest.raises(ValueError):
        floor_seconds(Attempt(9.0, 0, 4, first_step_seconds=4.0, restore_seconds=0.0))


def test_each_jitckpt_subject_is_also_set_against_the_peer_that_saves_as_often(
    tmp_path: Path,
) -> None:
    """JIT only against HF's JIT, saves every 50 against HF's every 50: the "same saves"
    figures hold just the two, jitckpt's the reference; the JIT-only pod saves nothing
    periodically."""
    lost = {JITCKPT_JIT_ONLY: 3.0, HF_JIT: 6.0, JITCKPT: 5.0, PERIODIC[50]: 20.0, PERIODIC[10]: 9.0}
    jobs = {
        name: [Goodput([_attempt(10.0, 0, 20), _attempt(10.0 + s, 20, 40)])]
        for name, s in lost.items()
    }
    jobs[FLOOR] = [Goodput([_attempt(20.0, 0, 40)])]
    shape = ModelShape.for_state("50 MB", 50_000_000)
    same = [c for c in cases("50 MB", shape, 40, [20], jobs) if "same saves" in c.case]
    assert [(c.reference, [s.subject for s in c.series]) for c in same] == [
        (JITCKPT_JIT_ONLY, [JITCKPT_JIT_ONLY, HF_JIT]),
        (JITCKPT, [JITCKPT, PERIODIC[50]]),
    ]
    assert [c.ratios() for c in same] == [{HF_JIT: 0.5}, {PERIODIC[50]: 0.25}]
    runner = JobRunner(JITCKPT_JIT_ONLY, shape, 40, {}, tmp_path)
    argv = runner.argv(tmp_path / "out", tmp_path / "timeline.jsonl")
    assert argv[argv.index("--save-steps") + 1] == "0"
    argv = JobRunner(JITCKPT, shape, 40, {}, tmp_path).argv(tmp_path, tmp_path)
    assert argv[argv.index("--save-steps") + 1] == "50"
