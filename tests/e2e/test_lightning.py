"""PyTorch Lightning jobs through ``jitckpt demo``, the way a user runs it on their script.

The script (``scripts/train_lightning.py``) is an ordinary Lightning script:
dropout, a step-wise LR schedule, a shuffled DataLoader whose items get random
noise, validation at every epoch end, work after ``fit()``. Each demo runs it
as a PyTorchJob's pods through the webhook's mutation and the pod runner,
holds its ranks at a step drawn from a seeded RNG (the seed is in the test,
the step is printed), preempts, resumes in new pods, and compares the final
weights bitwise with a run never preempted:

- two nodes, SIGTERM to one pod only, imported as ``pytorch_lightning``, with
  Lightning's stateful callbacks on (``StochasticWeightAveraging`` over a
  OneCycle schedule stepped per step, ``ModelCheckpoint`` keeping the best two
  ``val_loss`` every 5 steps, ``LearningRateMonitor`` with a CSV logger),
  gradient accumulation and clipping, validation twice an epoch, stopped
  mid-epoch once SWA has started: the checkpoint the script saves after
  ``fit()`` (callbacks, schedulers, loops' counters) must equal the
  uninterrupted run's too;
- two nodes, SIGTERM to both, a ``pvc://`` destination and the legacy sidecar;
- one node with periodic saves every 5 steps, preempted between two of them:
  the periodic checkpoints are in the store (but those the JIT commit superseded
  before their upload ended, which the sidecar's log must name) and the resume is
  from the JIT one;
- two nodes, one pod preempted, a script whose every step reads the validation
  metric (``scripts/train_lightning_plateau.py``): the resumed run ends with the
  same weights and the same scheduler, ``ModelCheckpoint``, ``EarlyStopping``
  and metric state as the uninterrupted one.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.support import JITCKPT, jitckpt_ls

SCRIPT = Path(__file__).with_name("scripts") / "train_lightning.py"
MAX_STEPS = 30
EPOCH_STEPS = 12  # 96 samples in batches of 8
# Mid-epoch steps (a stop at an epoch's end is in tests/shim/test_lightning.py).
MID_EPOCH = [s for s in range(3, MAX_STEPS - 2) if s % EPOCH_STEPS]


def demo(tmp_path: Path, *args: str, script: Path = SCRIPT) -> dict[str, Any]:
    """``jitckpt demo --script SCRIPT --compare --json ARGS``: its summary."""
    command = [str(JITCKPT), "demo", "--script", str(script), "--compare", "--json"]
    command += ["--workdir", str(tmp_path / "demo"), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=500, check=False)
    lines = done.stdout.splitlines()
    assert len(lines) == 1, (done.stdout, done.stderr[-3000:])
    summary: dict[str, Any] = json.loads(lines[0])
    assert summary["ok"] is True, (summary, done.stderr[-4000:])
    assert done.returncode == 0
    return summary


def assert_preempted_and_resumed(summary: dict[str, Any], step: int, nnodes: int) -> int:
    """What every preempted Lightning demo must show; returns the JIT step."""
    jit = summary["jit_checkpoint_step"]
    assert jit in (step, step + 1), summary  # the requested step, or the next
    assert summary["resumed_from_step"] == jit
    assert summary["trainer_exit_codes"] == [143] * nnodes  # never a success
    assert summary["final_exit_codes"] == [0] * nnodes
    assert summary["final_step"] == MAX_STEPS
    assert summary["equal_to_uninterrupted"] is True
    assert all(f"step {jit} (jit)" in m for m in summary["termination_messages"]), summary
    for log in summary["trainer_logs"]["preempted"]:
        text = Path(log).read_text(errors="replace")
        assert f"stopping at step {jit} for a JIT checkpoint" in text
        assert "fit() returned" not in text  # the code after fit() never ran
    for log in summary["trainer_logs"]["resumed"]:
        text = Path(log).read_text(errors="replace")
        assert f"checkpoint-{jit}" in text and "resuming from" in text
        assert f"fit() returned at step {MAX_STEPS}" in text
    return int(jit)


# Lightning's stateful callbacks on a run of 5 epochs: 192 samples are 12 batches a rank
# on two nodes, 6 optimizer steps with 2 accumulated; SWA from epoch 1 (step 6) on.
CALLBACKS = [
    *("--samples", "192", "--max-epochs", "5", "--accumulate-grad-batches", "2"),
    *("--gradient-clip-val", "0.5", "--val-check-interval", "0.5"),
    *("--swa", "--schedule", "onecycle", "--best-every", "5", "--lr-monitor"),
]
SWA_MID_EPOCH = [s for s in range(7, MAX_STEPS - 1) if s % 6]
# Two nodes: SIGTERM to one pod only (S3, native sidecar, imported as pytorch_lightning,
# a wider model in pieces of 64 KiB, the callbacks), and to both pods (pvc://, legacy
# sidecar). Both nodes write the JIT checkpoint (copies); node 0 uploads a file smaller
# than two pieces.
TWO_NODES: dict[str, tuple[int, list[int], tuple[str, list[str], list[str]]]] = {
    "one-pod-s3-native-pytorch_lightning-callbacks": (
        5501,
        SWA_MID_EPOCH,
        (
            "one",
            ["--set", "piece-min-size=64Ki"],
            ["--package", "pytorch_lightning", "--hidden", "512", *CALLBACKS],
        ),
    ),
    "all-pods-pvc-legacy": (
        7703,
        MID_EPOCH,
        ("all", ["--destination", "pvc://ckpt-claim/lightning", "--sidecar-mode", "legacy"], []),
    ),
}


def two_node_demo(
    tmp_path: Path, seed: int, steps: list[int], case: tuple[str, list[str], list[str]], **kw: Path
) -> tuple[int, dict[str, Any]]:
    """Two nodes preempted at a step drawn from ``steps`` (the seed and step printed), as
    ``case`` says (which pods, demo arguments, script arguments): the step and the summary,
    checked as every preempted two-node demo must be."""
    preempt, demo_args, script_args = case
    step = random.Random(seed).choice(steps)
    print(f"seed {seed}: preempting at step {step}", file=sys.stderr)
    command = ["--keep", "--preempt-at-step", str(step), "--preempt-nodes", preempt, *demo_args]
    summary = demo(tmp_path, *command, "--", *script_args, **kw)
    assert summary["nnodes"] == 2 and summary["preempt_nodes"] == preempt
    assert_preempted_and_resumed(summary, step, 2)
    return step, summary


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TWO_NODES))
def test_two_nodes_preempted_resume_bitwise(case: str, tmp_path: Path) -> None:
    seed, steps, how = TWO_NODES[case]
    _, summary = two_node_demo(tmp_path, seed, steps, how)
    # What the script saved after fit() (trainer.save_checkpoint): callbacks, schedulers,
    # the loops' counters, value by value.
    saved = summary["saved_output"]
    assert saved["equal"] is True and saved["files"] == ["final.ckpt"], saved
    node0 = Path(summary["sidecar_logs"]["preempted"][0]).read_text(errors="replace")
    spread = re.search(r"(\d+) replicated files, (\d+) of their (\d+) pieces", node0)
    assert spread is not None and int(spread.group(1)) >= 1, node0[-3000:]  # model.ckpt
    if "piece-min-size=64Ki" in how[1]:  # node 1 uploaded a piece of it
        assert int(spread.group(2)) >= 1, node0[-3000:]


@pytest.mark.slow
def test_periodic_checkpoints_uploaded_and_a_stop_between_resumes_from_the_jit_one(
    tmp_path: Path, s3_bucket: str
) -> None:
    every = 5
    step = random.Random(6602).choice([s for s in MID_EPOCH if s > every and s % every])
    print(f"seed 6602: preempting at step {step}", file=sys.stderr)
    summary = demo(
        tmp_path,
        "--keep",
        "--nnodes",
        "1",
        "--preempt-at-step",
        str(step),
        "--destination",
        f"s3://{s3_bucket}/lightning",
        "--set",
        f"save-steps={every}",
    )
    jit = assert_preempted_and_resumed(summary, step, 1)
    code, document = jitckpt_ls(summary["destination"])
    assert code == 0
    kinds = {row["step"]: row["kind"] for row in document["checkpoints"] if row["state"] == "valid"}
    # A periodic checkpoint still queued or uploading when the JIT one was committed is
    # dropped, by design (the node is released sooner): only then may one be missing.
    sidecar_log = "".join(Path(p).read_text() for p in summary["sidecar_logs"]["preempted"])
    said = re.findall(r"dropping checkpoint-(\d+) \(periodic\): superseded", sidecar_log)
    dropped = {int(n) for n in said}
    assert f"uploading checkpoint-{jit} (jit" in sidecar_log  # the preempted pod's sidecar
    assert all(n < jit for n in dropped), sidecar_log
    periodic = [n for n in range(every, MAX_STEPS + 1, every) if n not in dropped]
    # Both runs' periodic checkpoints (before and after the stop) and the JIT one.
    assert kinds == {**dict.fromkeys(periodic, "periodic"), jit: "jit"}, document
    # What the script saved after fit() (trainer.save_checkpoint) is the final model.
    assert document["final"] is not None and document["final"]["state"] == "valid", document
    assert document["final"]["step"] == MAX_STEPS


PLATEAU_SCRIPT = SCRIPT.with_name("train_lightning_plateau.py")
# Its validation runs every 3 steps (6 batches, 2 accumulated per step); a stop
# between two validations resumes into steps that read val_loss before the next.
BETWEEN_VALIDATIONS = list(range(4, MAX_STEPS - 2, 3))
FINAL_STATE = "final state: "


def final_states(logs: list[str]) -> list[str]:
    """The ``final state:`` lines rank 0 printed (node 0's log)."""
    text = Path(logs[0]).read_text(errors="replace")
    return [line for line in text.splitlines() if line.startswith(FINAL_STATE)]


@pytest.mark.slow
def test_steps_reading_the_validation_metric_resume_bitwise(tmp_path: Path) -> None:
    case = ("one", [], ["--checkpoint-root", str(tmp_path / "shared")])
    _, summary = two_node_demo(tmp_path, 2808, BETWEEN_VALIDATIONS, case, script=PLATEAU_SCRIPT)
    resumed, uninterrupted = (
        final_states(summary["trainer_logs"][k]) for k in ("resumed", "uninterrupted")
    )
    assert len(resumed) == 1 and resumed == uninterrupted, (resumed, uninterrupted)
