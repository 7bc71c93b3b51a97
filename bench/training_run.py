"""Starting bench/workload.py as a trainer process and watching its timeline."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import timeline
from bench.workload import shape_for_state_bytes
from local.background import Background

VOCAB_SIZE = 8192
SEQ_LEN = 32


@dataclass(frozen=True)
class ModelShape:
    """A GPT-2 shape picked for a target size of weights plus AdamW state."""

    label: str
    hidden_size: int
    layers: int

    @classmethod
    def for_state(cls, label: str, state_bytes: int) -> ModelShape:
        hidden_size, layers = shape_for_state_bytes(state_bytes, VOCAB_SIZE, SEQ_LEN)
        return cls(label, hidden_size, layers)


def workload_argv(
    shape: ModelShape,
    output_dir: Path,
    timeline_path: Path,
    *,
    max_steps: int = 100000,
    save_steps: int = 0,
    save_total_limit: int | None = None,
    on_sigterm: str = "none",
    workers: int = 0,
) -> list[str]:
    limit = [] if save_total_limit is None else ["--save-total-limit", str(save_total_limit)]
    loading = ["--workers", str(workers)] if workers else []
    return [
        sys.executable,
        "-m",
        "bench.workload",
        "--output-dir",
        str(output_dir),
        "--hidden-size",
        str(shape.hidden_size),
        "--layers",
        str(shape.layers),
        "--vocab-size",
        str(VOCAB_SIZE),
        "--seq-len",
        str(SEQ_LEN),
        "--max-steps",
        str(max_steps),
        "--save-steps",
        str(save_steps),
        "--on-sigterm",
        on_sigterm,
        "--timeline",
        str(timeline_path),
        *limit,
        *loading,
    ]


def wait_for_step(
    trainer: Background, timeline_path: Path, step: int, timeout: float = 600.0
) -> None:
    """Block until rank 0 of ``trainer`` ended `step` or a later one; fail if it died first."""

    def gone() -> str | None:
        process = trainer.process
        if process is not None and process.poll() is not None:
            return f"trainer exited {process.returncode}"
        return None

    wait_for_timeline_step(timeline_path, step, timeout, gone)


def wait_for_timeline_step(
    timeline_path: Path, step: int, timeout: float, gone: Callable[[], str | None]
) -> None:
    """Block until the timeline shows rank 0 ended `step` or a later one; fail as soon as
    ``gone()`` says why the trainer cannot get there (None: still running).

    A later one: a resumed run starts past `step` when the checkpoint it resumed
    from was written later than the stop was asked for (HF's JIT save on a fast
    step loop), and its first step is then the one to stop after."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = timeline.times(timeline.read(timeline_path), "step_end")
        if any(done >= step for done in ended):
            return
        reason = gone()
        if reason is not None:
            raise RuntimeError(f"{reason} before step {step}")
        time.sleep(0.05)
    raise TimeoutError(f"trainer did not reach step {step} in {timeout} s")
