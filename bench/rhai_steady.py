"""What each subject of bench/rhai.py costs a job that is never preempted.

A checkpointing product is paid for at every step, preempted or not: its periodic saves
(the peer's are HF's synchronous `_save_checkpoint` followed by a background upload,
jitckpt's are staged to its sidecar without stalling the step) and the local volume the
staged copies need. Each subject trains the same run with a save every `SAVE_EVERY` steps
and HF's `save_total_limit` of 3 in all three: HF's Trainer alone (the job with no
product, its checkpoints kept locally), jitckpt, and the peer. Measured: steps per second
from the end of step 1 to the end of the last (the first step's warm-up left out), and the
local volume's peak (bench/volume.py) over the output directory and, for jitckpt, its
shared staging volume.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench import rhai, timeline
from bench.results import Case, Series
from bench.training_run import ModelShape, workload_argv
from bench.volume import VolumePeak
from local.background import Background

if TYPE_CHECKING:
    from local.s3server import LocalS3

HF_ALONE = "HF's Trainer alone (its own saves, kept locally)"
SUBJECTS = (HF_ALONE, rhai.JITCKPT, rhai.RHAI)
STEPS = 20
SAVE_EVERY = 5
SAVE_TOTAL_LIMIT = 3
PREFIX = "bench/steady"


@dataclass(frozen=True)
class Steady:
    """One uninterrupted run: its training speed, its local volume's peak, its exit."""

    steps_per_second: float | None  # None: fewer than two steps ended
    peak_bytes: int
    exit_code: int | None


def steps_per_second(timeline_path: Path, first: int = 1) -> float | None:
    """Steps ended per second of rank 0 from the end of step ``first`` to its last."""
    ended = timeline.times(timeline.read(timeline_path), "step_end")
    later = [step for step in ended if step > first]
    if first not in ended or not later:
        return None
    last = max(later)
    return (last - first) / (ended[last] - ended[first])


def _argv(shape: ModelShape, output: Path, timeline_path: Path) -> list[str]:
    return workload_argv(
        shape, output, timeline_path, max_steps=STEPS, save_steps=SAVE_EVERY,
        save_total_limit=SAVE_TOTAL_LIMIT,
    )  # fmt: skip


def _train(argv: list[str], env: dict[str, str], log: Path, roots: list[Path]) -> tuple[int, int]:
    """Run the trainer to its end under a volume sampler: (exit code, peak bytes)."""
    for root in roots:
        root.mkdir(parents=True, exist_ok=True)
    with VolumePeak(roots) as peak, Background(argv, env=env, log=log) as trainer:
        assert trainer.process is not None
        code = trainer.process.wait(timeout=1200)
    return code, peak.peak


def run_steady(
    subject: str, work: Path, shape: ModelShape, s3_env: dict[str, str], checkout: Path
) -> Steady:
    """``subject``'s run of `STEPS` steps, saving every `SAVE_EVERY`, never preempted."""
    from bench.jitckpt_node import JitckptNode
    from bench.sigterm_to_durable import BUCKET as JITCKPT_BUCKET

    output = work / "output"
    timeline_path = work / "timeline.jsonl"
    argv = _argv(shape, output, timeline_path)
    if subject == HF_ALONE:
        code, peak = _train(argv, dict(os.environ), work / "trainer.log", [output])
    elif subject == rhai.JITCKPT:
        destination = f"s3://{JITCKPT_BUCKET}/{PREFIX}"
        with JitckptNode(work / "node", destination, s3_env) as node:
            roots = [output, node.local_dir]
            code, peak = _train(argv, node.trainer_env(), work / "trainer.log", roots)
    else:
        path = work / "train.py"
        periodic = rhai.Periodic("steps", SAVE_EVERY, SAVE_TOTAL_LIMIT)
        remote = f"s3://{rhai.BUCKET}/{rhai.RHAI_PREFIX}"
        path.write_text(rhai.script(checkout, argv[3:], output, remote, periodic))
        command = [sys.executable, str(path)]
        code, peak = _train(command, rhai.trainer_env(s3_env), work / "trainer.log", [output])
    return Steady(steps_per_second(timeline_path), peak, code)


def steady_cases(
    label: str, state_bytes: int, reps: int, s3: LocalS3, checkout: Path
) -> list[Case]:
    """Each subject ``reps`` times, rotating: steps/s and the local volume's peak."""

    shape = ModelShape.for_state(label, state_bytes)
    runs: dict[str, list[Steady]] = {s: [] for s in SUBJECTS}
    for rep, subject in rhai.rotated(SUBJECTS, reps):
        rhai.fresh_buckets(s3)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="bench-rhai-steady-") as tmp:
            done = run_steady(subject, Path(tmp), shape, s3.credentials_env(), checkout)
        runs[subject].append(done)
        print(f"[bench] rhai steady {label} rep {rep} {subject}: {done}, "
              f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    case = (f"{label} state, {STEPS} steps never preempted, a save every {SAVE_EVERY} "
            f"(save_total_limit {SAVE_TOTAL_LIMIT}), 1 node")  # fmt: skip
    return steady_series(case, runs)


def steady_series(
    case: str, runs: dict[str, list[Steady]], benchmark: str = rhai.NAME
) -> list[Case]:
    """The two figures of runs never preempted, each subject of ``runs`` a series."""

    def codes(subject: str) -> dict[str, list[int | None]]:
        return {"exit_codes": [r.exit_code for r in runs[subject]]}

    def speeds(subject: str) -> list[float]:
        return [r.steps_per_second for r in runs[subject] if r.steps_per_second is not None]

    return [
        Case(benchmark, case, "training speed", "steps/s", False,
             [Series(s, speeds(s), codes(s)) for s in SUBJECTS],
             note="rhai: steps ended per second from the end of step 1 to the end of the "
             "last, the periodic saves included"),
        Case(benchmark, case, "local volume's peak", "MB", True,
             [Series(s, [r.peak_bytes / rhai.MB for r in runs[s]], codes(s)) for s in SUBJECTS],
             note="rhai: the most bytes on disk at once under the output directory (and "
             "jitckpt's staging volume), sampled every 0.1 s, each inode once"),
    ]  # fmt: skip
