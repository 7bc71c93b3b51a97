"""Constants and helpers of the end-to-end tests (fixtures are in conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).with_name("scripts") / "train_listing.py"
JITCKPT = Path(sys.executable).with_name("jitckpt")
LISTING_PREFIX = "start listing: "
MAX_STEPS = 30


def script_args(workdir: Path) -> list[str]:
    return ["--output-dir", str(workdir / "out"), "--max-steps", str(MAX_STEPS)]


def jitckpt_ls(destination: str) -> tuple[int, dict[str, Any]]:
    """``jitckpt ls DESTINATION --json``: its exit code and document."""
    done = subprocess.run(
        [str(JITCKPT), "ls", destination, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, json.loads(done.stdout)


def start_listings(log: Path) -> list[list[str] | None]:
    """What every training process of a pod saw in the checkpoints dir when it started."""
    return [
        json.loads(line[len(LISTING_PREFIX) :])
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith(LISTING_PREFIX)
    ]


def demo_summary(script: Path, options: list[str], workdir: Path, timeout: int = 900) -> dict:
    """``jitckpt demo --script S --compare --json`` with ``options``: its summary, the tail
    of its stderr in ``_stderr``."""
    command = [str(JITCKPT), "demo", "--script", str(script), "--compare", "--json"]
    command += ["--workdir", str(workdir), *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    try:
        summary = json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no summary: {done.stdout[-2000:]} {done.stderr[-4000:]}")
    summary["_stderr"] = done.stderr[-4000:]
    return summary
