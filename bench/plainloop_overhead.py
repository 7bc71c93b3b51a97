"""Per-step cost of following a plain PyTorch loop: the hooks and the stop agreement.

`torchrun --nproc-per-node 2` (gloo) of bench/loop_workload.py, a plain DDP
loop sized to about 20 steps a second on two CPU ranks, with the shim (and a
real agent behind it, so the shim is fully active: the optimizer-step hook,
the DataLoader tracking, the all-reduce agreement at every step, progress
reports) and without, alternating. The rate is rank 0's steady state. A
second case runs one rank of a tiny model (thousands of steps a second, no
agreement collective in a world of one): what the hooks alone cost a step.

    python -m bench.plainloop_overhead [--quick] [--reps N]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import BenchOptions
from bench.jitckpt_node import JitckptNode
from bench.procs import tool
from bench.rates import Rates, TrainingRun, torchrun_rate
from bench.results import Case, Series

NAME = "plainloop_overhead"
WITH = "with shim"
WITHOUT = "without shim"
BUCKET = "bench-plainloop"
WARMUP_STEPS = 10
TINY_MODEL = ["--hidden", "8", "--batch-size", "4"]


def training_rate(work: Path, env: dict[str, str], shape: list[str], steps: int) -> TrainingRun:
    path = work / f"timeline-{time.monotonic_ns()}.jsonl"
    return torchrun_rate(
        [
            tool("torchrun"),
            "--standalone",
            *shape,
            "--timeline",
            str(path),
        ],
        {**env, "OMP_NUM_THREADS": "1"},
        path,
        last_step=steps,
        skip=WARMUP_STEPS,
    )


def shapes(quick: bool) -> list[tuple[str, list[str], int]]:
    """(case, torchrun arguments, steps): the 20 steps/s DDP loop, and one rank of tiny
    steps."""
    steps = 100 if quick else 200
    tiny = 1000 if quick else 3000
    workload = ["-m", "bench.loop_workload"]
    return [
        (
            f"plain DDP loop, 2 ranks gloo, {steps} steps",
            ["--nproc-per-node", "2", *workload, "--steps", str(steps)],
            steps,
        ),
        (
            f"hooks alone: 1 rank, tiny model, {tiny} steps",
            ["--nproc-per-node", "1", *workload, "--steps", str(tiny), *TINY_MODEL],
            tiny,
        ),
    ]


def run(options: BenchOptions) -> list[Case]:
    from local.s3server import LocalS3

    reps = options.repetitions(5, 3)
    cases = []
    with tempfile.TemporaryDirectory(prefix="bench-plainloop-") as tmp, LocalS3() as s3:
        s3.create_bucket(BUCKET)
        work = Path(tmp)
        with JitckptNode(work / "node", f"s3://{BUCKET}/bench/loop", s3.credentials_env()) as node:
            order = ((WITH, node.trainer_env()), (WITHOUT, node.trainer_env_without_shim()))
            for label, shape, steps in shapes(options.quick):
                rates = Rates((WITH, WITHOUT))
                for rep in range(reps):
                    for subject, env in order if rep % 2 == 0 else order[::-1]:
                        rates.add(subject, training_rate(work, env, shape, steps))
                cases.append(
                    Case(
                        benchmark=NAME,
                        case=label,
                        metric="steps per second",
                        unit="steps/s",
                        lower_is_better=False,
                        series=[
                            Series(s, rates.samples[s], {"warmup": WARMUP_STEPS})
                            for s in rates.subjects
                        ],
                        reference=WITH,
                        note="plainloop_overhead: with shim = PYTHONPATH at the shim and "
                        "JITCKPT_DIR set, a real agent on LocalS3 behind it; the DDP loop runs "
                        f"at about 20 steps/s without it; {rates.abort_note()}",
                    )
                )
    return cases


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.plainloop_overhead", run, __doc__))
