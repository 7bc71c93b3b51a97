"""Lightning's own stateful callbacks, each in a real run stopped mid-epoch and resumed.

The script is the user-style one of the end-to-end tests, unchanged: five
epochs of 12 batches, two accumulated per optimizer step (6 steps an epoch),
gradient clipping, validation twice an epoch. Each case adds one of Lightning's
callbacks that keep state. The run is stopped at step 14 (epoch 2, between two
validations), resumed in a new "pod" (the same paths, a fresh output
directory, as a restarted container has), and what the script saves after
``fit()`` with ``trainer.save_checkpoint`` (the weights, the optimizer and
scheduler states, every callback's ``state_dict`` and the loops' progress
counters, ``scheduler_progress`` among them) must equal the uninterrupted
run's, tensor by tensor and value by value; and so must the learning rates
``LearningRateMonitor`` logged over the whole run (its history, which the
script saves). ``ThroughputMonitor`` times the process it runs in, and the
resumed run is told so once. ``LearningRateFinder`` searches at fit's start and
sets the module's learning rate: the resumed run does not search again (its
search would load its own starting point over the resumed training state) and
gets the found rate back.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from local.demo.weights import compare_saved
from tests.shim.support import PYTHON, ShimEnv, Spawn, jit_lines

SCRIPT = str(Path(__file__).parents[1] / "e2e" / "scripts" / "train_lightning.py")
STOP = 14
HOLD = "JITCKPT_DEMO_HOLD_AT_STEP"
COMMON = [
    "--max-epochs",
    "5",
    "--accumulate-grad-batches",
    "2",
    "--gradient-clip-val",
    "0.5",
    "--val-check-interval",
    "0.5",
]
# Three runs a case; the callbacks Lightning resumes right by itself share one.
CALLBACKS = {
    # SWA from epoch 1 on, over a OneCycle schedule stepped per step (SWA swaps it out).
    "StochasticWeightAveraging": ["--swa", "--schedule", "onecycle"],
    # The backbone joins the optimizer at epoch 2's start (before the stop).
    "BackboneFinetuning": ["--backbone-finetuning", "2"],
    # ModelCheckpoint keeping the best two val_loss every 4 steps, EarlyStopping on
    # val_loss, LearningRateMonitor (with a CSV logger), ThroughputMonitor.
    "ModelCheckpoint-EarlyStopping-LearningRateMonitor-ThroughputMonitor": [
        *("--best-every", "4", "--early-stopping", "--lr-monitor", "--throughput"),
    ],
    # LearningRateFinder's search (16 steps) at fit's start, its suggestion the module's lr.
    "LearningRateFinder": ["--lr-finder", "16"],
    # Not Lightning's: the script's own callback, its books in plain attributes (a loss a
    # batch, a count of validations, the best val_loss), written out at on_train_end.
    "program-callback-books": ["--books"],
}


@pytest.mark.slow
@pytest.mark.parametrize("callback", list(CALLBACKS))
def test_callback_state_and_loop_counters_resume_mid_epoch_as_uninterrupted(
    callback: str, shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    args = [PYTHON, SCRIPT, "--output-dir", str(tmp_path / "out"), *COMMON, *CALLBACKS[callback]]
    runs = {}
    for name, env in (
        ("uninterrupted", shim_env.without_shim()),
        ("preempted", {**shim_env.env, HOLD: str(STOP)}),
        ("resumed", shim_env.env),
    ):
        run = spawn(args, env)
        if name == "preempted":
            run.wait_for(f"holding at step {STOP} until", timeout=180)
            run.signal(signal.SIGTERM)
        runs[name] = (run.wait(timeout=300), run.output())
        (tmp_path / "out").rename(tmp_path / name)  # the next pod starts with a fresh one
    assert runs["preempted"][0] == 143, runs["preempted"][1][-3000:]
    code, output = runs["resumed"]
    assert code == 0, output[-3000:]
    assert f"checkpoint-{STOP}" in output and "fit() returned at step 30" in output
    final = [tmp_path / name / "final.ckpt" for name in ("uninterrupted", "resumed")]
    assert compare_saved(*final) == []
    lines = jit_lines(output)
    assert [line for line in lines if "does not train as the uninterrupted" in line] == []
    if "--lr-monitor" in args:  # the whole run's learning rates, as it logged them
        logged = [tmp_path / name / "learning_rates.json" for name in ("uninterrupted", "resumed")]
        assert logged[0].read_text() == logged[1].read_text()
    # What cannot come back is said once: ThroughputMonitor times the process it runs in.
    again = [line for line in lines if "measures the resumed process only" in line]
    assert len(again) == ("--throughput" in args), lines
    assert all("ThroughputMonitor" in line for line in again)
    if "--books" in args:  # the script's own record of the whole run
        kept = [tmp_path / name / "books.json" for name in ("uninterrupted", "resumed")]
        assert json.loads(kept[0].read_text())["validations"] == 11  # 10 and the sanity check
        assert kept[0].read_text() == kept[1].read_text()
    if "--lr-finder" in args:  # the search set the learning rate the final checkpoint holds
        saved = torch.load(final[0], map_location="cpu", weights_only=False)
        assert saved["hyper_parameters"]["lr"] != 0.01
        assert "Finding best initial lr" not in output  # the resumed run did not search again
