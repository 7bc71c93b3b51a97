"""Constants and helpers of the end-to-end tests (fixtures are in conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

SCRIPT = Path(__file__).with_name("scripts") / "train_listing.py"
LISTING_PREFIX = "start listing: "
MAX_STEPS = 30
STEP_SLEEP = 0.15  # per step, in every run: slow enough to preempt at a chosen step


def script_args(workdir: Path) -> list[str]:
    return [
        "--output-dir",
        str(workdir / "out"),
        "--max-steps",
        str(MAX_STEPS),
        "--step-sleep",
        str(STEP_SLEEP),
    ]


def start_listings(log: Path) -> list[list[str] | None]:
    """What every training process of a pod saw in the checkpoints dir when it started."""
    return [
        json.loads(line[len(LISTING_PREFIX) :])
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith(LISTING_PREFIX)
    ]
