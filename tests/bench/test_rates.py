"""A training run's rate is kept when it only aborted at exit after its last step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.rates import Rates, TrainingRun, torchrun_rate

# Stands in for torchrun: rank 0's step_end events every 10 ms, then an exit as told.
RUN = """
import json, sys, time
path, steps, ending = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(path, "a") as timeline:
    for step in range(1, steps + 1):
        time.sleep(0.01)
        event = {"event": "step_end", "step": step, "t": time.monotonic()}
        timeline.write(json.dumps(event) + "\\n")
if ending == "abort":
    sys.stderr.write("  exitcode  : -6 (pid: 1)  (SIGABRT)\\n")
    sys.exit(1)
if ending == "fail":
    sys.stderr.write("Traceback: something else\\n")
    sys.exit(1)
"""


def run(tmp_path: Path, steps_done: int, ending: str, last_step: int = 8) -> TrainingRun:
    path = tmp_path / f"timeline-{ending}-{steps_done}.jsonl"
    argv = [sys.executable, "-c", RUN, str(path), str(steps_done), ending]
    return torchrun_rate(argv, {}, path, last_step=last_step, skip=2)


def test_a_clean_run_gives_its_rate(tmp_path: Path) -> None:
    measured = run(tmp_path, 8, "ok")
    assert not measured.aborted_at_exit
    assert 10 < measured.steps_per_second < 100  # a step every 10 ms, give or take


def test_an_abort_after_the_last_step_keeps_the_rate_and_is_counted(tmp_path: Path) -> None:
    rates = Rates(("with", "without"))
    rates.add("with", run(tmp_path, 8, "ok"))
    rates.add("without", run(tmp_path, 8, "abort"))
    assert rates.aborts == {"with": 0, "without": 1}
    assert all(len(samples) == 1 for samples in rates.samples.values())
    assert rates.abort_note().endswith("with 0 of 1, without 1 of 1")


def test_an_abort_before_the_last_step_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="SIGABRT"):
        run(tmp_path, 5, "abort")


def test_any_other_failure_fails(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="something else"):
        run(tmp_path, 8, "fail")
