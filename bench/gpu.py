"""The GPU figures: periodic-save stall and SIGTERM to durable with the model on a GPU.

The same HF workload, subjects and measures as bench/stall.py and
bench/sigterm_to_durable.py, trained on the GPU (`BENCH_DEVICE=cuda`): there
jitckpt's snapshot goes to pinned host memory at the step boundary; the stall adds
jitckpt with its writer process (`JITCKPT_WRITER=auto`) beside it. Run it on a
machine with a CUDA GPU:

    python -m bench.gpu [--quick] [--reps N]

Results go to bench/results/gpu.json, one section per benchmark (`--only`
reruns one and keeps the other), and to the README's GPU block (its own
markers), never into the CPU table `make bench` regenerates. Each case is
recorded as soon as it is measured, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from bench import harness, results, sigterm_to_durable, stall, table
from bench.results import Case
from bench.workload import ENV_DEVICE

if TYPE_CHECKING:
    from local.s3server import LocalS3

NAME = "gpu"
RESULTS_PATH = results.RESULTS_PATH.with_name("gpu.json")
MB = 1_000_000

CaseFn = Callable[[str, int, int, "LocalS3"], Case]
# Steps between saves on the GPU: a step there takes milliseconds, and a save must be
# able to finish writing before the next one (bench/stall.py's hf_case).
GPU_SAVE_EVERY = {500 * MB: 40, 2000 * MB: 100}


def stall_case(label: str, state_bytes: int, reps: int, s3: LocalS3) -> Case:
    return stall.hf_case(
        label,
        state_bytes,
        reps,
        s3,
        GPU_SAVE_EVERY.get(state_bytes, 40),
        subjects=(*stall.SUBJECTS, stall.JITCKPT_PROCESS),
    )


def plan(options: harness.BenchOptions) -> list[tuple[CaseFn, str, int, int]]:
    """(case function, label, state bytes, repetitions), the cheaper cases first."""
    if options.quick:
        return [
            (stall_case, "50 MB", 50 * MB, options.repetitions(1, 1)),
            (sigterm_to_durable.size_case, "50 MB", 50 * MB, options.repetitions(1, 1)),
        ]
    return [
        (stall_case, "500 MB", 500 * MB, options.repetitions(2, 1)),
        (sigterm_to_durable.size_case, "50 MB", 50 * MB, options.repetitions(2, 1)),
        (sigterm_to_durable.size_case, "500 MB", 500 * MB, options.repetitions(2, 1)),
        (stall_case, "2 GB", 2000 * MB, options.reps or 1),
        (sigterm_to_durable.size_case, "2 GB", 2000 * MB, options.reps or 1),
    ]


def device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def main() -> int:
    arguments = harness.parser(__doc__ or NAME)
    arguments.set_defaults(results=RESULTS_PATH)
    arguments.add_argument(
        "--only", choices=("stall", "sigterm_to_durable"), default=None, help="one benchmark"
    )
    args = arguments.parse_args()
    options = harness.options_from(args)
    harness.stop_cleanly_on_sigterm()
    device = device_name()
    if device is None:
        print("[bench] gpu: no CUDA device here", file=sys.stderr)
        return 2
    os.environ[ENV_DEVICE] = "cuda"  # every trainer the cases start inherits it
    from local.s3server import LocalS3

    started = time.monotonic()
    measured: dict[str, list[Case]] = {}  # per benchmark: each is its own section
    with LocalS3() as s3:
        for case_fn, label, state_bytes, reps in plan(options):
            if args.only == "stall" and case_fn is not stall_case:
                continue
            if args.only == "sigterm_to_durable" and case_fn is stall_case:
                continue
            case = case_fn(label, state_bytes, reps, s3)
            case = dataclasses.replace(case, case=f"{device}: {case.case}")
            cases = measured.setdefault(case.benchmark, [])
            cases.append(case)
            document = results.record(
                case.benchmark,
                cases,
                command=harness.command_line("bench.gpu", options),
                wall_seconds=time.monotonic() - started,
                options={"quick": options.quick, "reps": options.reps, "device": device},
                path=options.results_path,
            )
            table.refresh(document, options.readme_path, table.GPU_MARKERS)
            for row in table.case_rows(case):
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
