"""HF's Trainer resumed under the shim goes on as if never stopped: the losses it logs, the
program's own callback's books, and the demo's verdict, which is not fooled by the best
checkpoint.

Real processes (a tiny GPT-2 with dropout, CPU), the shim on PYTHONPATH, no sidecar: an
uninterrupted run, a run held at step ``CUT`` and stopped there by SIGTERM (its JIT
checkpoint), and two resumes of that checkpoint: one as it is, one whose training after
the resume differs (``PERTURB``: the resumed process draws its dropout masks from another
random state, as a resume that restored a random state wrongly would). Evaluations every
5 steps, ``load_best_model_at_end`` and ``EarlyStoppingCallback``: the eval set asks for
the token after the one the model learns to predict, so it gets worse as the model
learns, and the best checkpoint is the first one,
from before the preemption, and the best model both resumes hand over equals the
uninterrupted run's whatever their training did after the resume.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from local.demo.loghistory import compare_logs
from local.demo.loghistory import read as read_log
from local.demo.weights import compare_files, compare_saved
from shim.layout import ENV_DEMO_FINAL_WEIGHTS, ENV_DEMO_HOLD_AT_STEP, demo_log_path
from tests.shim.support import PYTHON, ShimEnv, Spawn, Spawner

# The module's runs are made once (a module fixture): its tests on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hf-loop-books")]
CUT = 12  # the JIT checkpoint's step; the first log after it (15) averages steps 11 to 15

SCRIPT = """
import json, os, sys
import torch
from transformers import (EarlyStoppingCallback, GPT2Config, GPT2LMHeadModel, Trainer,
                          TrainerCallback, TrainingArguments, set_seed)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, seed, count, shift):
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(64, (count, 16), generator=generator)
        self.shift = shift

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        row = self.rows[index]
        return {"input_ids": row, "labels": (row + self.shift) % 64}


class Record(TrainerCallback):
    "The program's own books: every loss logged and the evaluations, written at the end."

    def __init__(self, path):
        self.path = path
        self.losses = []
        self.evaluations = 0
        self.best = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append([state.global_step, logs["loss"]])

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluations += 1
        loss = metrics["eval_loss"]
        self.best = loss if self.best is None else min(self.best, loss)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            with open(self.path, "w") as out:
                json.dump({"losses": self.losses, "evaluations": self.evaluations,
                           "best": self.best}, out)


class Perturb(TrainerCallback):
    "A resume gone wrong: other dropout masks from the first step on."

    def __init__(self):
        self.done = False

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.done:
            self.done = True
            torch.manual_seed(999)


out = sys.argv[1]
set_seed(5)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                   n_head=2, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.1))
args = TrainingArguments(
    output_dir=out, max_steps=40, per_device_train_batch_size=4, learning_rate=3e-3,
    logging_steps=5, eval_strategy="steps", eval_steps=5, save_strategy="steps",
    save_steps=5, load_best_model_at_end=True, metric_for_best_model="eval_loss",
    use_cpu=True, report_to="none", disable_tqdm=True, seed=5,
)
callbacks = [Record(os.path.join(out, "record.json")),
             EarlyStoppingCallback(early_stopping_patience=3)]
if os.environ.get("PERTURB"):
    callbacks.append(Perturb())
trainer = Trainer(model=model, args=args, train_dataset=Tokens(1, 16, 0),
                  eval_dataset=Tokens(1, 16, 1), callbacks=callbacks)
trainer.train()
trainer.save_model()
print("done at step", trainer.state.global_step, flush=True)
"""


def train(spawn: Spawn, env: ShimEnv, out: Path, extra: dict[str, str]) -> Any:
    script = env.root / "train.py"
    script.write_text(SCRIPT)
    return spawn([PYTHON, str(script), str(out)], {**env.env, **extra})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each run's output directory (model, record.json, the shim's weights and log)."""
    root = tmp_path_factory.mktemp("hf-loop-books")
    spawn = Spawner(root)
    try:
        outputs = {}
        reference_env = ShimEnv(root / "reference")
        outputs["reference"] = root / "out-reference"
        reference = train(
            spawn,
            reference_env,
            outputs["reference"],
            {ENV_DEMO_FINAL_WEIGHTS: str(outputs["reference"] / "weights.pt")},
        )
        cut_env = ShimEnv(root / "cut")
        cut = train(spawn, cut_env, root / "out-cut", {ENV_DEMO_HOLD_AT_STEP: str(CUT)})
        cut.wait_for(f"holding at step {CUT}", timeout=300)
        cut.signal(signal.SIGTERM)
        assert cut.wait(timeout=300) == 143, cut.output()[-3000:]
        assert reference.wait(timeout=300) == 0, reference.output()[-3000:]
        resumes = {}
        for name, extra in (("resumed", {}), ("perturbed", {"PERTURB": "1"})):
            env = ShimEnv(root / name)
            shutil.copytree(cut_env.checkpoints, env.checkpoints)
            outputs[name] = root / f"out-{name}"
            weights = str(outputs[name] / "weights.pt")
            resumes[name] = train(
                spawn, env, outputs[name], {**extra, ENV_DEMO_FINAL_WEIGHTS: weights}
            )
        for run in resumes.values():
            assert run.wait(timeout=300) == 0, run.output()[-3000:]
            said = run.output()
            assert f"resuming from {root}" in said and f"checkpoint-{CUT}" in said
            assert "the loop's books are back as they were at the checkpoint" in said
            assert "the loss since the last log, Record[0]" in said
            assert "HF's stateful callbacks are back" in said  # EarlyStoppingCallback's count
        return outputs
    finally:
        spawn.close()


def log(output: Path) -> list[dict[str, Any]]:
    return read_log(Path(demo_log_path(str(output / "weights.pt"))))


def test_a_resumed_run_logs_what_the_uninterrupted_run_logged(runs: dict[str, Path]) -> None:
    """Every loss at every logging step, the evaluations, the run's train_loss and flos."""
    reference, resumed = log(runs["reference"]), log(runs["resumed"])
    losses = [(e["step"], e["loss"]) for e in reference if "loss" in e]
    assert [step for step, _ in losses][:4] == [5, 10, 15, 20]  # 15: the first after the cut
    assert [(e["step"], e["loss"]) for e in resumed if "loss" in e] == losses
    comparison = compare_logs(resumed, reference)
    assert comparison.equal, comparison.detail()
    assert "train_runtime" in comparison.left_out  # time, not training
    assert any("train_loss" in entry for entry in reference)
    assert compare_files(runs["resumed"] / "weights.pt", runs["reference"] / "weights.pt").equal


def test_the_programs_own_callback_keeps_its_books_across_the_resume(
    runs: dict[str, Path],
) -> None:
    reference = json.loads((runs["reference"] / "record.json").read_text())
    resumed = json.loads((runs["resumed"] / "record.json").read_text())
    assert reference["evaluations"] >= 4 and reference["losses"][0][0] == 5
    assert resumed == reference


def test_the_verdict_is_not_fooled_by_an_equal_best_checkpoint(runs: dict[str, Path]) -> None:
    """The perturbed resume hands over the same best model (from before the preemption), but
    its training after the resume differed: the last step's weights and the log say so."""
    [model] = [p.name for p in runs["reference"].glob("model.safetensors")]
    assert compare_saved(runs["reference"] / model, runs["perturbed"] / model) == []
    weights = compare_files(runs["perturbed"] / "weights.pt", runs["reference"] / "weights.pt")
    assert not weights.equal
    comparison = compare_logs(log(runs["perturbed"]), log(runs["reference"]))
    assert not comparison.equal
    assert any(d.startswith("step 15: loss") for d in comparison.differing), comparison.differing
