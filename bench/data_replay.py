"""What a mid-epoch resume costs a loader whose workers augment at random.

A resumed pass replays its trained batches through the DataLoader's worker
processes (``shim/dataloaders.py``) so each worker's generators draw what
they drew the first time: exact, but it reads the data again. This measures
that price for a numpy-augmenting ``Dataset`` and a random ``collate_fn`` in
two workers (bench/replay_workload.py, one fresh process per repetition),
resumed half-way through the epoch: the time to the first batch after the
resume point, against the uninterrupted epoch's wall time (training
included) and against skipping the same batches by index as
``skip_first_batches`` does (no data read, but the augmentation differs).

    python -m bench.data_replay [--quick] [--reps N]
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench import harness
from bench.harness import BenchOptions
from bench.results import Case, Series

NAME = "data_replay"
REPLAY = "jitckpt replay through workers (exact)"
EPOCH = "uninterrupted epoch"
SKIP = "skip by index (skip_first_batches; not exact)"


def measure(samples: int) -> dict[str, float]:
    command = [sys.executable, "-m", "bench.replay_workload", "--samples", str(samples)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(options: BenchOptions) -> list[Case]:
    reps = options.repetitions(5, 3)
    samples = 256 if options.quick else 768
    found: dict[str, list[float]] = {REPLAY: [], EPOCH: [], SKIP: []}
    same = 0
    for _ in range(reps):
        result = measure(samples)
        found[REPLAY].append(result["replay"])
        found[EPOCH].append(result["epoch"])
        found[SKIP].append(result["skip"])
        same += bool(result["skip_equal"])
    return [
        Case(
            benchmark=NAME,
            case=f"resume half-way through a {samples}-sample epoch, 2 workers, numpy "
            "augmentation and a random collate_fn",
            metric="seconds to the first batch after the resume point (epoch: whole epoch)",
            unit="s",
            lower_is_better=True,
            series=[Series(subject, found[subject]) for subject in (REPLAY, EPOCH, SKIP)],
            reference=REPLAY,
            note=f"data_replay: the replayed batch equalled the uninterrupted run's every time; "
            f"skipping by index gave the same batch {same} of {reps} times",
        )
    ]


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.data_replay", run, __doc__))
