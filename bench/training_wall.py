"""Training wall time with frequent periodic saves: 60 steps, a save every 5.

The same HF workload (bench/workload.py, `save_total_limit=2`) under jitckpt
as it ships (the real shim and agent: saves written behind the loop, every
checkpoint uploaded to LocalS3 on the same cores), under jitckpt with
`JITCKPT_ASYNC_SAVE=false` (HF's synchronous save, the same uploads: the
issue's "same run with HF's synchronous saves"), and as plain transformers
(HF's synchronous save, nothing uploaded). One sample per run: from the begin
of the first step to the trainer process's exit, so a save still being
written when the loop ends is counted.

    python -m bench.training_wall [--quick] [--reps N]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from bench import harness, timeline
from bench.harness import BenchOptions
from bench.jitckpt_node import JitckptNode
from bench.results import Case, Series
from bench.training_run import ModelShape, workload_argv
from local.background import Background

NAME = "training_wall"
BUCKET = "bench-wall"
JITCKPT = "jitckpt"
JITCKPT_SYNC = "jitckpt, synchronous saves"
PLAIN = "plain transformers, synchronous saves"
SUBJECTS = (JITCKPT, JITCKPT_SYNC, PLAIN)
SAVE_EVERY = 5
SAVE_TOTAL_LIMIT = 2
MB = 1_000_000


def _run(argv: list[str], env: dict[str, str], work: Path, timeline_path: Path) -> float:
    """Seconds from the first step's begin to the trainer's exit."""
    with Background(argv, env=env, log=work / "trainer.log") as trainer:
        assert trainer.process is not None
        code = trainer.process.wait(timeout=1800)
        ended = time.monotonic()
    if code != 0:
        log = (work / "trainer.log").read_text()[-3000:]
        raise RuntimeError(f"trainer exited {code}: {log}")
    begins = timeline.times(timeline.read(timeline_path), "step_begin")
    return ended - begins[min(begins)]


def wall_seconds(subject: str, shape: ModelShape, steps: int, s3_env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-wall-") as tmp:
        work = Path(tmp)
        timeline_path = work / "timeline.jsonl"
        argv = workload_argv(
            shape,
            work / "output",
            timeline_path,
            max_steps=steps,
            save_steps=SAVE_EVERY,
            save_total_limit=SAVE_TOTAL_LIMIT,
        )
        if subject in (JITCKPT, JITCKPT_SYNC):
            with JitckptNode(work / "node", f"s3://{BUCKET}/bench/wall", s3_env) as node:
                env = node.trainer_env(async_save=subject == JITCKPT)
                return _run(argv, env, work, timeline_path)
        return _run(argv, dict(os.environ), work, timeline_path)


def run(options: BenchOptions) -> list[Case]:
    from local.s3server import LocalS3

    label, state_bytes, steps = (
        ("50 MB", 50 * MB, 20) if options.quick else ("500 MB", 500 * MB, 60)
    )
    reps = options.repetitions(1, 1)  # about two minutes a run at 500 MB on 2 cores
    shape = ModelShape.for_state(label, state_bytes)
    samples: dict[str, list[float]] = {s: [] for s in SUBJECTS}
    with LocalS3() as s3:
        for rep in range(reps):
            for subject in SUBJECTS if rep % 2 == 0 else SUBJECTS[::-1]:
                s3.reset()
                s3.create_bucket(BUCKET)
                seconds = wall_seconds(subject, shape, steps, s3.credentials_env())
                samples[subject].append(seconds)
                print(
                    f"[bench] wall {label} rep {rep} {subject}: {seconds:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    params = {"steps": steps, "save_steps": SAVE_EVERY, "save_total_limit": SAVE_TOTAL_LIMIT}
    return [
        Case(
            benchmark=NAME,
            case=f"{label} state (h={shape.hidden_size}, layers={shape.layers}), {steps} steps, "
            f"a save every {SAVE_EVERY}",
            metric="wall time",
            unit="s",
            lower_is_better=True,
            series=[Series(s, samples[s], params) for s in SUBJECTS],
            note="training_wall: first step begin to trainer exit; both jitckpt subjects "
            "upload every checkpoint to LocalS3 on the same cores meanwhile (saves behind "
            "the loop, or HF's synchronous save), plain transformers only saves",
        )
    ]


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.training_wall", run, __doc__))
