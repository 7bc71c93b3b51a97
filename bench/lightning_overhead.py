"""Per-step cost of the shim's Lightning integration: the same Lightning run with and without it.

`torchrun --nproc-per-node 2` (gloo, DDP) of bench/lightning_workload.py, no
periodic saves. With the shim, a real agent serves the node, so the
integration is fully active: at every optimizer step both ranks report
progress and agree on the SIGTERM flag (one all-reduce, in place of the
broadcast Lightning makes before every batch), and the train DataLoader's
sampler goes through the shim's resumable wrapper. Runs
alternate between the two subjects; the result is steady-state steps/s of
rank 0 after a warm-up.

    python -m bench.lightning_overhead [--quick] [--reps N]
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

NAME = "lightning_overhead"
WITH = "with shim"
WITHOUT = "without shim"
BUCKET = "bench-lightning"
WARMUP_STEPS = 5


def training_rate(work: Path, env: dict[str, str], steps: int, port: int) -> TrainingRun:
    """Steady-state steps/s of rank 0 in a 2-rank gloo Lightning run."""
    path = work / f"timeline-{time.monotonic_ns()}.jsonl"
    return torchrun_rate(
        [
            tool("torchrun"),
            "--nproc-per-node",
            "2",
            "--master-port",
            str(port),
            "-m",
            "bench.lightning_workload",
            "--output-dir",
            str(work / "output"),
            "--max-steps",
            str(steps),
            "--timeline",
            str(path),
        ],
        {**env, "OMP_NUM_THREADS": "1"},
        path,
        last_step=steps,
        skip=WARMUP_STEPS,
    )


def run(options: BenchOptions) -> list[Case]:
    from local.ports import free_port
    from local.s3server import LocalS3

    reps = options.repetitions(5, 3)
    steps = 60 if options.quick else 150
    rates = Rates((WITH, WITHOUT))
    with tempfile.TemporaryDirectory(prefix="bench-lightning-") as tmp, LocalS3() as s3:
        s3.create_bucket(BUCKET)
        work = Path(tmp)
        with JitckptNode(
            work / "node", f"s3://{BUCKET}/bench/lightning", s3.credentials_env()
        ) as node:
            order = ((WITH, node.trainer_env()), (WITHOUT, node.trainer_env_without_shim()))
            for rep in range(reps):
                for subject, env in order if rep % 2 == 0 else order[::-1]:
                    rates.add(subject, training_rate(work, env, steps, free_port()))
    return [
        Case(
            benchmark=NAME,
            case=f"Lightning DDP, 2 ranks gloo, {steps} steps, MLP 3x512",
            metric="steps per second",
            unit="steps/s",
            lower_is_better=False,
            series=[
                Series(s, rates.samples[s], {"steps": steps, "warmup": WARMUP_STEPS})
                for s in rates.subjects
            ],
            reference=WITH,
            note="lightning_overhead: with shim = PYTHONPATH at the shim and JITCKPT_DIR set, "
            f"a real agent on LocalS3 behind it; {rates.abort_note()}",
        )
    ]


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.lightning_overhead", run, __doc__))
