"""Which state beside the training modules a plain loop's checkpoint carries, and its round trip.

Each case runs a small program in a fresh interpreter (the shim's hooks on
``nn.Module``, the optimizers and ``builtins.__build_class__`` stay out of
the test process), with ``loopstate.install`` done as the shim does it when
torch is imported, before the program's classes are defined.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from tests.shim.support import PYTHON, REPO, ShimEnv, Spawn, checkpoint_steps

PRELUDE = """
import copy, json, sys
import torch
from shim.frameworks.plain.layout import extrastate
from shim.frameworks.plain.layout import state as loopstate
loopstate.install(torch)
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
"""


def run(tmp_path: Path, body: str) -> dict:
    script = tmp_path / "program.py"
    script.write_text(PRELUDE + body)
    done = subprocess.run(
        [PYTHON, str(script)],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_only_what_training_changed_is_selected(tmp_path: Path) -> None:
    found = run(
        tmp_path,
        """
class Tracker:
    def __init__(self):
        self.mean, self.steps = torch.zeros(()), 0
    def state_dict(self):
        return {"mean": self.mean, "steps": self.steps}
    def load_state_dict(self, state):
        self.mean, self.steps = state["mean"], state["steps"]

net = torch.nn.Linear(4, 2)
teacher = torch.nn.Linear(4, 2).requires_grad_(False)  # frozen: never saved
ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
copied = copy.deepcopy(net)  # an EMA by hand, written through .data
norm = torch.nn.BatchNorm1d(4)  # running statistics, no version counter moves
idle, busy = Tracker(), Tracker()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
objects = loopstate.Objects()
watch = extrastate.Watch(objects.modules, objects.all_modules, objects.optimizers)
before = watch.select(objects.modules, objects.all_modules)
ema.update_parameters(net)
for mine, theirs in zip(copied.parameters(), net.parameters()):
    mine.data.mul_(0.5).add_(theirs.data)
norm(torch.randn(8, 4))
busy.steps += 1
after = watch.select(objects.modules, objects.all_modules)
print(json.dumps({
    "before": [n for n, _, _ in before.modules + before.objects],
    "after": [[n, i] for n, i, _ in after.modules + after.objects],
    "problem": after.problem,
    "watched": watch.count(),
}))
""",
    )
    assert found["before"] == []
    # Linear #0 is the frozen teacher, #1 the copy; Tracker #1 is the busy one.
    assert found["after"] == [
        ["AveragedModel", 0],
        ["Linear", 1],
        ["BatchNorm1d", 0],
        ["Tracker", 1],
    ]
    assert found["problem"] is None
    assert found["watched"] == [4, 2]


def test_state_that_cannot_be_put_back_is_named(tmp_path: Path) -> None:
    found = run(
        tmp_path,
        """
class ShadowWeights:  # an EMA without state_dict/load_state_dict
    def __init__(self, model):
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.last_loss = torch.zeros(())

net = torch.nn.Linear(4, 2)
shadow = ShadowWeights(net)
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
objects = loopstate.Objects()
watch = extrastate.Watch(objects.modules, objects.all_modules, objects.optimizers)
shadow.last_loss = torch.ones(())  # replaced, and a scalar: not taken for state
quiet = watch.select(objects.modules, objects.all_modules).problem
shadow.shadow["weight"].mul_(0.9)
problem = watch.select(objects.modules, objects.all_modules).problem
print(json.dumps({"quiet": quiet, "problem": problem}))
""",
    )
    assert found["quiet"] is None
    assert found["problem"].startswith("ShadowWeights.shadow['weight'], a tensor training changes")


def test_saved_state_goes_back_into_the_next_process_objects(tmp_path: Path) -> None:
    """Saved by one process, read and put back by another that built the same objects."""
    body = """
class Metrics:
    def __init__(self):
        self.losses = []
    def state_dict(self):
        return {"losses": list(self.losses)}
    def load_state_dict(self, state):
        self.losses = list(state["losses"])

class Accelerator:  # what register_for_checkpointing leaves behind, as Accelerate's class
    def __init__(self):
        self._custom_objects = []

registry = loopstate.Created()
loopstate.note_instances(Accelerator, registry)
extrastate.ACCELERATORS.append(registry)
torch.manual_seed(int(sys.argv[1]))
net = torch.nn.Linear(3, 3)
ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.5))
metrics, tracker = Metrics(), Metrics()
accelerator = Accelerator()
accelerator._custom_objects.append(metrics)
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
objects = loopstate.Objects()
if sys.argv[2] == "save":
    watch = extrastate.Watch(objects.modules, objects.all_modules, objects.optimizers)
    ema.update_parameters(net)
    metrics.losses.append(1.5)
    tracker.losses.append(2.5)
    objects.selection = watch.select(objects.modules, objects.all_modules)
    payload = loopstate.collect(objects, 5, 0, 1)
    payload.update(rng={}, loaders=[])
    loopstate.write(".", 0, payload)
else:
    saved = loopstate.read(".", 0)
    assert loopstate.mismatch(saved, objects, complete=True) is None
    loaded = loopstate.apply(saved, objects, complete=True)
print(json.dumps({
    "ema": ema.module.weight.tolist(),
    "n": int(ema.n_averaged),
    "metrics": metrics.losses,
    "tracker": tracker.losses,
}))
"""
    saved = run(tmp_path, body.replace("sys.argv[1]", "1").replace("sys.argv[2]", "'save'"))
    assert (tmp_path / "custom_checkpoint_0.pkl").is_file()  # Accelerate's own name and place
    loaded = run(tmp_path, body.replace("sys.argv[1]", "2").replace("sys.argv[2]", "'load'"))
    assert loaded == saved
    assert saved["n"] == 1 and saved["metrics"] == [1.5] and saved["tracker"] == [2.5]


@pytest.mark.slow
def test_an_ema_without_state_dict_gets_no_jit_checkpoint_and_sigterm_acts_as_before(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """Resuming would restart the hand-kept EMA from the initial weights: never, say it."""
    script = [PYTHON, str(REPO / "tests" / "e2e" / "scripts" / "loop_shadow_ema.py")]
    stopped = spawn(
        [*script, "--save-ema", str(tmp_path / "ema.pt")],
        {**shim_env.env, "JITCKPT_DEMO_HOLD_AT_STEP": "3"},
    )
    stopped.wait_for("holding at step 3 ", timeout=300)
    stopped.signal(signal.SIGTERM)
    assert stopped.wait(timeout=300) == -signal.SIGTERM, stopped.output()[-3000:]
    reasons = [
        line for line in stopped.output().splitlines() if "cannot be resumed exactly" in line
    ]
    assert len(reasons) == 1, stopped.output()[-3000:]
    assert "ShadowEMA.shadow['0.weight'], a tensor training changes" in reasons[0]
    assert checkpoint_steps(shim_env.checkpoints) == []
