"""Step rates and save stalls read from a workload timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import timeline


def _write(path: Path, events: list[tuple[str, int, float, int]]) -> None:
    lines = [json.dumps({"event": e, "step": s, "t": t, "rank": r}) for e, s, t, r in events]
    path.write_text("\n".join(lines) + '\n{"event": "step_b')  # torn last line


def _steps(
    gaps: dict[int, float], durations: dict[int, float] | None = None
) -> list[tuple[str, int, float, int]]:
    """Steps of 1 s each (or ``durations[k]``); after step k the loop stands still
    gaps.get(k, 0.1) s."""
    events = []
    now = 0.0
    for step in range(1, 8):
        events.append(("step_begin", step, now, 0))
        now += (durations or {}).get(step, 1.0)
        events.append(("step_end", step, now, 0))
        events.append(("step_end", step, now + 50, 1))  # another rank, ignored
        now += gaps.get(step, 0.1)
    return events


def test_blocked_seconds_subtracts_the_usual_gap(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _write(path, _steps({4: 2.6}))
    events = timeline.read(path)
    assert all(e.rank == 0 for e in events)
    assert timeline.blocked_seconds(events, 4) == pytest.approx(2.5)
    assert timeline.blocked_seconds(events, 3) == pytest.approx(0.0)


def test_blocked_seconds_adds_what_the_next_step_took_too_long(tmp_path: Path) -> None:
    """A save written in the background: a short gap, then a step slowed by the writer."""
    path = tmp_path / "t.jsonl"
    _write(path, _steps({4: 0.3}, durations={5: 1.8}))
    events = timeline.read(path)
    assert timeline.blocked_seconds(events, 4, saves=[4]) == pytest.approx(0.2 + 0.8)
    # A step that ran faster than usual takes nothing off.
    _write(path, _steps({4: 0.3}, durations={5: 0.5}))
    assert timeline.blocked_seconds(timeline.read(path), 4, saves=[4]) == pytest.approx(0.2)


def test_blocked_seconds_needs_the_next_step(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _write(path, _steps({}))
    with pytest.raises(ValueError):
        timeline.blocked_seconds(timeline.read(path), 7)


def test_steps_per_second_skips_warmup(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _write(path, _steps({1: 30.0}))  # a slow first step must not count
    assert timeline.steps_per_second(timeline.read(path), skip=1) == pytest.approx(1 / 1.1)
