"""A resume that cannot work is set aside: the job ends as it would without jitckpt.

``scripts/train_lightning_buggy.py --bug resume`` raises on every resume
(its checkpoint hooks disagree), before its first step. Two nodes, one pod
preempted; the demo starts the job's pods again after each run whose trainer
failed, as a restart policy would. Runs 2 and 3 resume from the JIT checkpoint
and fail; the sidecars set it aside, said once each; run 4 starts fresh (no
older checkpoint) and ends with the weights of the uninterrupted run. The
demo's verdict fails, naming each failed trainer's run and step, and
``jitckpt ls`` lists the checkpoint as set aside, with the reason.

The other side of the rule: the same script with ``--bug report`` fails
at the same step with or without a resume (a report written into a missing
directory), after the first step of the resumed run: the checkpoint is not blamed, and each restart
resumes from it again (and fails as it would without jitckpt). More cases of
both sides are in ``tests/sidecar/test_setaside.py``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.support import JITCKPT, jitckpt_ls

SCRIPT = Path(__file__).with_name("scripts") / "train_lightning_buggy.py"
MAX_STEPS = 12
PREEMPT_AT = 5  # mid-epoch (4 steps an epoch on two nodes)


def demo_with_restarts(tmp_path: Path, bug: str, bucket: str, restarts: int) -> dict[str, Any]:
    """``jitckpt demo`` of the script with ``bug``, two nodes, one pod preempted at
    ``PREEMPT_AT``, ``restarts`` restarts after failed runs: its summary (the verdict fails)."""
    command = [str(JITCKPT), "demo", "--script", str(SCRIPT), "--compare", "--json"]
    command += ["--keep", "--workdir", str(tmp_path / "demo"), "--preempt-nodes", "one"]
    command += ["--preempt-at-step", str(PREEMPT_AT), "--restarts", str(restarts)]
    command += ["--destination", f"s3://{bucket}/{bug}", "--", "--bug", bug]
    command += ["--max-steps", str(MAX_STEPS)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1400, check=False)
    lines = done.stdout.splitlines()
    assert len(lines) == 1, (done.stdout, done.stderr[-3000:])
    summary: dict[str, Any] = json.loads(lines[0])
    assert done.returncode == 1 and summary["ok"] is False
    return summary


@pytest.mark.slow
@pytest.mark.timeout(1500)  # five runs of two pods: the uninterrupted one, then 1 to 4
def test_a_resume_that_always_fails_is_set_aside_and_the_job_ends_as_without_it(
    tmp_path: Path, s3_bucket: str
) -> None:
    summary = demo_with_restarts(tmp_path, "resume", s3_bucket, 3)
    assert summary["failed_checks"] == ["no resumed trainer failed"], summary
    jit = summary["jit_checkpoint_step"]
    runs = summary["resumed_runs"]
    # Two failed resumes from the JIT checkpoint, then a fresh start: no crash loop.
    assert [r["restored_step"] for r in runs] == [jit, jit, None], runs
    assert [r["exit_codes"] for r in runs] == [[1, 1], [1, 1], [0, 0]], runs
    for run in runs[:2]:
        assert len(run["failures"]) == 2
        assert all(f"before its first step (resumed from step {jit})" in f for f in run["failures"])
        assert all(f"run {run['run']}: the trainer of " in f for f in run["failures"])
    assert summary["failed_trainers"] == runs[0]["failures"] + runs[1]["failures"]
    assert not runs[0]["set_aside"]
    assert [m["step"] for m in runs[1]["set_aside"]] == [jit, jit]
    for log in runs[1]["sidecar_logs"]:  # said once by each node's sidecar
        assert Path(log).read_text().count(f"checkpoint-{jit} set aside (") == 1
    for log in runs[2]["sidecar_logs"]:
        assert f"skipping checkpoint-{jit}: set aside: a trainer resumed from it" in (
            Path(log).read_text()
        )
    assert summary["final_exit_codes"] == [0, 0] and summary["final_step"] == MAX_STEPS
    assert summary["equal_to_uninterrupted"] is True

    code, document = jitckpt_ls(summary["destination"])
    rows = {row["step"]: row for row in document["checkpoints"]}
    assert rows[jit]["state"] == "set-aside", rows
    assert "exited with code 1 before completing a step, 2 times in a row" in rows[jit]["reason"]
    assert code == 1  # no valid checkpoint left to restore: said by the exit code


@pytest.mark.slow
@pytest.mark.timeout(1500)  # four runs of two pods: the uninterrupted one, then 1 to 3
def test_an_error_that_happens_without_a_resume_too_is_not_blamed_on_it(
    tmp_path: Path, s3_bucket: str
) -> None:
    summary = demo_with_restarts(tmp_path, "report", s3_bucket, 1)
    jit = summary["jit_checkpoint_step"]
    runs = summary["resumed_runs"]
    # Each run resumes from the JIT checkpoint and fails later, as the uninterrupted one does.
    assert [r["restored_step"] for r in runs] == [jit, jit], runs
    assert all(code == 1 for r in runs for code in r["exit_codes"]), runs
    assert all(f"(resumed from step {jit})" in f for f in summary["failed_trainers"])
    assert "uninterrupted run finished" in summary["failed_checks"]
    assert summary["set_aside"] == []
    for run in runs:
        for log in run["sidecar_logs"]:
            assert "set aside" not in Path(log).read_text()
    code, document = jitckpt_ls(summary["destination"])
    rows = {row["step"]: row for row in document["checkpoints"]}
    assert rows[jit]["state"] == "valid" and code == 0, rows
