"""Overheads of the shim: interpreter start, `import torch`, and each training step.

Start-up: the same command with and without the shim's environment
(PYTHONPATH at the shim, JITCKPT_DIR set), alternating, each run its own
process. Per step: `torchrun --nproc-per-node 2` (gloo) of bench/workload.py
with no periodic saves, with the shim (and a real agent, so the shim is fully
active and agrees the SIGTERM flag across ranks at every step end) and without.
A run that aborted at exit after its last step keeps its rate and is counted
(bench/rates.py).

    python -m bench.overheads [--quick] [--reps N]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import BenchOptions
from bench.jitckpt_node import JitckptNode
from bench.procs import tool
from bench.rates import Rates, TrainingRun, torchrun_rate
from bench.results import Case, Series
from local.background import REPO_ROOT

NAME = "overheads"
WITH = "with shim"
WITHOUT = "without shim"
STARTUP_COMMANDS = (("python -c pass", "pass"), ("python -c 'import torch'", "import torch"))
BUCKET = "bench-overheads"
WARMUP_STEPS = 5


def timed_run(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def startup_cases(options: BenchOptions, node: JitckptNode) -> list[Case]:
    cases = []
    plain = node.trainer_env_without_shim()
    shimmed = node.trainer_env()
    for label, code in STARTUP_COMMANDS:
        reps = options.repetitions(30, 10) if code == "pass" else options.repetitions(7, 5)
        samples: dict[str, list[float]] = {WITH: [], WITHOUT: []}
        argv = [sys.executable, "-c", code]
        timed_run(argv, plain)  # page cache warm for both
        for rep in range(reps):
            order = ((WITH, shimmed), (WITHOUT, plain))
            for subject, env in order if rep % 2 == 0 else order[::-1]:
                samples[subject].append(1000 * timed_run(argv, env))
        cases.append(
            Case(
                benchmark=NAME,
                case=label,
                metric="wall time",
                unit="ms",
                lower_is_better=True,
                series=[Series(s, samples[s]) for s in (WITH, WITHOUT)],
                reference=WITH,
            )
        )
    return cases


def training_rate(work: Path, env: dict[str, str], steps: int, port: int) -> TrainingRun:
    """Steady-state steps/s of rank 0 in a 2-rank gloo run of the workload."""
    path = work / f"timeline-{time.monotonic_ns()}.jsonl"
    return torchrun_rate(
        [
            tool("torchrun"),
            "--nproc-per-node",
            "2",
            "--master-port",
            str(port),
            "-m",
            "bench.workload",
            "--output-dir",
            str(work / "output"),
            "--hidden-size",
            "128",
            "--layers",
            "2",
            "--max-steps",
            str(steps),
            "--timeline",
            str(path),
        ],
        env,
        path,
        last_step=steps,
        skip=WARMUP_STEPS,
    )


def step_case(options: BenchOptions, node: JitckptNode, work: Path) -> Case:
    from local.ports import free_port

    # A step here is about 50 ms: 240 steps (about 12 s) and 7 runs a subject resolve a
    # difference of 1%, which 60 steps (3 s, a start's jitter) did not.
    reps = options.repetitions(7, 3)
    steps = 30 if options.quick else 240
    rates = Rates((WITH, WITHOUT))
    order = ((WITH, node.trainer_env()), (WITHOUT, node.trainer_env_without_shim()))
    for rep in range(reps):
        for subject, env in order if rep % 2 == 0 else order[::-1]:
            rates.add(subject, training_rate(work, env, steps, free_port()))
    return Case(
        benchmark=NAME,
        case=f"2 ranks gloo, {steps} steps, tiny GPT-2",
        metric="steps per second",
        unit="steps/s",
        lower_is_better=False,
        series=[
            Series(s, rates.samples[s], {"steps": steps, "warmup": WARMUP_STEPS})
            for s in rates.subjects
        ],
        reference=WITH,
        note="overheads: with shim = PYTHONPATH at the shim and JITCKPT_DIR set, a real "
        f"agent on LocalS3 behind it; {rates.abort_note()}",
    )


def run(options: BenchOptions) -> list[Case]:
    from local.s3server import LocalS3

    with (
        tempfile.TemporaryDirectory(prefix="bench-overheads-") as tmp,
        LocalS3() as s3,
    ):
        s3.create_bucket(BUCKET)
        work = Path(tmp)
        with JitckptNode(
            work / "node", f"s3://{BUCKET}/bench/overheads", s3.credentials_env()
        ) as node:
            cases = startup_cases(options, node)
            cases.append(step_case(options, node, work))
    return cases


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.overheads", run, __doc__))
