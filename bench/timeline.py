"""Reading the JSON-lines timeline bench/workload.py writes."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Event:
    event: str
    step: int
    t: float
    rank: int


def read(path: Path, rank: int = 0) -> list[Event]:
    """The events of one rank, in file order; a torn last line (process killed) is skipped."""
    events: list[Event] = []
    if not path.exists():
        return events
    for line in path.read_text().splitlines():
        try:
            body = json.loads(line)
        except ValueError:
            continue
        if body.get("rank", 0) == rank:
            events.append(Event(body["event"], body["step"], body["t"], body.get("rank", 0)))
    return events


def times(events: list[Event], name: str) -> dict[int, float]:
    """step -> time of the first `name` event of that step."""
    found: dict[int, float] = {}
    for item in events:
        if item.event == name:
            found.setdefault(item.step, item.t)
    return found


def steps_per_second(events: list[Event], skip: int) -> float:
    """Steady-state rate: step ends after the first `skip` steps (warm-up excluded)."""
    ends = sorted((step, t) for step, t in times(events, "step_end").items() if step > skip)
    if len(ends) < 2:
        raise ValueError("fewer than two steady-state steps in the timeline")
    return (len(ends) - 1) / (ends[-1][1] - ends[0][1])


def blocked_seconds(events: list[Event], save_step: int, saves: Iterable[int] = ()) -> float:
    """How much longer the loop took around a save than around other steps.

    The gap between the end of step k and the begin of step k+1 holds the
    Trainer's own bookkeeping and, at a save step, the save (or, when the save
    is written in the background, what of it stays at the boundary); the
    median gap of the other steps is subtracted. Added to it: how much longer
    than the median step the step after the save took, which is where a
    background save's remaining cost lands (its optimizer step waiting for a
    copy, its writer competing for the cores). ``saves``: every save step of
    the run, kept out of both medians.
    """
    ends = times(events, "step_end")
    begins = times(events, "step_begin")
    gaps = {step: begins[step + 1] - t for step, t in ends.items() if step + 1 in begins}
    if save_step not in gaps:
        raise ValueError(f"no step after the save at step {save_step}")
    skip = set(saves) | {save_step}
    others = [gap for step, gap in gaps.items() if step not in skip and step > 1]
    baseline = statistics.median(others) if others else 0.0
    durations = {step: t - begins[step] for step, t in ends.items() if step in begins}
    usual = [d for step, d in durations.items() if step - 1 not in skip and step > 1]
    after = durations.get(save_step + 1)
    excess = max(0.0, after - statistics.median(usual)) if after is not None and usual else 0.0
    return gaps[save_step] - baseline + excess
