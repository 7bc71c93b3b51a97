"""Goodput's accounting: the seeded preemptions, steps trained twice, time lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.goodput import Attempt, Goodput, attempt_steps, preemption_steps


def test_preemptions_are_the_same_for_every_subject_and_spread_over_the_run() -> None:
    steps = preemption_steps(25, 300, 3)
    assert steps == preemption_steps(25, 300, 3)
    assert steps != preemption_steps(26, 300, 3)
    assert len(steps) == 3
    assert steps == sorted(set(steps))
    assert 30 <= steps[0] and steps[-1] < 270
    # one in each third of the run between its first and last tenth
    assert [(s - 30) * 3 // 240 for s in steps] == [0, 1, 2]


def test_too_many_preemptions_for_the_run_are_refused() -> None:
    with pytest.raises(ValueError):
        preemption_steps(25, 4, 3)


def test_steps_trained_twice_and_time_lost_per_preemption() -> None:
    job = Goodput(
        [
            Attempt(10.0, resumed_after=0, reached=17),  # last save at 10: 7 steps again
            Attempt(12.0, resumed_after=10, reached=34),  # resumed exactly where it stopped
            Attempt(11.0, resumed_after=34, reached=41),  # nothing saved since: from 34
            Attempt(9.0, resumed_after=34, reached=60),
        ]
    )
    assert job.seconds == 42.0
    assert job.preemptions == 3
    assert job.steps_trained_twice() == 7 + 0 + 7
    assert job.lost_per_preemption(30.0) == pytest.approx(4.0)


def test_an_uninterrupted_run_trains_nothing_twice() -> None:
    job = Goodput([Attempt(30.0, resumed_after=0, reached=60)])
    assert job.steps_trained_twice() == 0
    assert job.lost_per_preemption(30.0) == 0.0


def test_an_attempt_reads_where_it_began_and_ended_from_its_timeline(tmp_path: Path) -> None:
    path = tmp_path / "timeline.jsonl"
    events = [("step_begin", 11, 1.0), ("step_end", 11, 2.0), ("step_begin", 12, 2.1)]
    events += [("step_end", 12, 3.0), ("save_begin", 12, 3.0), ("step_begin", 13, 3.5)]
    path.write_text(
        "".join(json.dumps({"event": e, "step": s, "t": t}) + "\n" for e, s, t in events)
    )
    assert attempt_steps(path) == (10, 12)
