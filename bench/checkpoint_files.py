"""A real HF Trainer checkpoint directory of a chosen size, made by the bench workload.

The transfer benchmark moves what a trainer actually writes (safetensors
weights, optimizer.pt, scheduler, RNG state, trainer_state.json), not
synthetic files, so the mix of large and tiny objects is realistic.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.workload import shape_for_state_bytes
from local.background import REPO_ROOT

VOCAB_SIZE = 8192
SEQ_LEN = 32


def make_checkpoint(work: Path, state_bytes: int) -> Path:
    """Train one step of a model with about `state_bytes` of weights+AdamW, save, return the dir."""
    hidden_size, layers = shape_for_state_bytes(state_bytes, VOCAB_SIZE, SEQ_LEN)
    output = work / "hf-output"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.workload",
            "--output-dir",
            str(output),
            "--hidden-size",
            str(hidden_size),
            "--layers",
            str(layers),
            "--vocab-size",
            str(VOCAB_SIZE),
            "--seq-len",
            str(SEQ_LEN),
            "--max-steps",
            "1",
            "--save-steps",
            "1",
        ],
        check=True,
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return output / "checkpoint-1"


def directory_bytes(path: Path) -> int:
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())
