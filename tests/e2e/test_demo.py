"""``jitckpt demo --json``, as a user runs it: the default story ends ``ok``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_default_demo_reports_ok(tmp_path: Path) -> None:
    jitckpt = Path(sys.executable).with_name("jitckpt")
    done = subprocess.run(
        [str(jitckpt), "demo", "--json", "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout  # exactly one JSON object on stdout
    summary = json.loads(lines[0])
    assert summary["ok"] is True, (summary, done.stderr[-3000:])
    assert done.returncode == 0
    assert summary["nnodes"] == 2
    assert summary["committed"] is True and summary["sigterm_to_committed_s"] > 0
    assert summary["kind"] == "PyTorchJob"
    assert summary["preempted_at_step"] == 12  # the default --preempt-at-step
    assert summary["jit_checkpoint_step"] in (12, 13)
    assert summary["resumed_from_step"] == summary["jit_checkpoint_step"]
    assert summary["final_step"] == 30
    assert summary["final_exit_codes"] == [0, 0]
    assert summary["trainer_exit_codes"] == [143, 143]  # terminated by SIGTERM: retryable
    assert summary["equal_to_uninterrupted"] is True
    assert summary["destination"].startswith("s3://")
    # the model the resumed run saved (train_tiny's save_model), in the store's final/
    model = summary["final_model"]
    assert model["valid"] is True and model["step"] == 30 and model["size"] > 0, model
    assert model["uri"].startswith(summary["destination"] + "/final/run-"), model
    # the account went to stderr: what was injected, the preemption, the verdict
    for phrase in ("webhook: injected", "preempting", "committed", "final model", "verdict: OK"):
        assert phrase in done.stderr
