"""Steps per second of one torchrun of a bench workload, read from its timeline.

A torchrun whose ranks finished every step and only then died of SIGABRT at
exit still measured its rate. That abort is torch's: a gloo worker thread
that must take the GIL while the interpreter finalizes (the shim waits for
those threads at exit, shim/glooexit.py; a run without the shim has no such
wait, and did abort in 2 of 10 runs here). So the rate is kept and the abort
is counted per subject, for the case's note; any other failure raises.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from bench import timeline
from local.background import REPO_ROOT

# torchrun's report of a rank killed by SIGABRT
ABORT_MARK = "exitcode  : -6"


@dataclass(frozen=True)
class TrainingRun:
    steps_per_second: float
    aborted_at_exit: bool  # every step done, then a rank died of SIGABRT


def torchrun_rate(
    argv: list[str], env: dict[str, str], path: Path, last_step: int, skip: int
) -> TrainingRun:
    """Run ``argv`` (a torchrun whose rank 0 writes ``step_end`` events to ``path``) and
    return its steady-state rate after the first ``skip`` steps."""
    completed = subprocess.run(
        argv,
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    events = timeline.read(path)
    aborted = completed.returncode != 0
    if aborted and not (
        ABORT_MARK in completed.stderr and last_step in timeline.times(events, "step_end")
    ):
        raise RuntimeError(f"torchrun exited {completed.returncode}: {completed.stderr[-3000:]}")
    return TrainingRun(timeline.steps_per_second(events, skip=skip), aborted)


@dataclass
class Rates:
    """Each subject's rates, in order, and how many of its runs aborted at exit."""

    subjects: tuple[str, ...]
    samples: dict[str, list[float]] = field(init=False)
    aborts: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.samples = {subject: [] for subject in self.subjects}
        self.aborts = dict.fromkeys(self.subjects, 0)

    def add(self, subject: str, run: TrainingRun) -> None:
        self.samples[subject].append(run.steps_per_second)
        self.aborts[subject] += run.aborted_at_exit

    def abort_note(self) -> str:
        counted = ", ".join(
            f"{subject} {self.aborts[subject]} of {len(self.samples[subject])}"
            for subject in self.subjects
        )
        return f"torchruns that aborted at exit after their last step (SIGABRT): {counted}"
