"""Plain PyTorch loops under the shim: real scripts, real processes, real SIGTERM.

No sidecar here (the JIT checkpoint stays in the local dir, where the next
process finds it); the pod runner, the sidecar and the store are exercised
in tests/e2e/test_plainloop.py. The demo's hold (``JITCKPT_DEMO_HOLD_AT_STEP``)
stops the first run exactly at a step chosen by a seeded RNG.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from local.demo.weights import compare_saved
from tests.shim.support import (
    PYTHON,
    REPO,
    ShimEnv,
    Spawn,
    assert_attached_once,
    checkpoint_steps,
)

SCRIPTS = Path(__file__).resolve().parents[1] / "e2e" / "scripts"
SHUFFLED = SCRIPTS / "loop_shuffled.py"
CYCLE = SCRIPTS / "loop_cycle.py"
ACCELERATE = SCRIPTS / "loop_accelerate.py"
HOLD = "JITCKPT_DEMO_HOLD_AT_STEP"


def assert_bitwise_equal(left: Path, right: Path) -> None:
    a = torch.load(left, weights_only=True)
    b = torch.load(right, weights_only=True)
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def losses(output: str) -> list[str]:
    """The per-step losses the script printed ("epoch E step S loss L")."""
    return [
        line.split(" loss ")[1]
        for line in output.splitlines()
        if line.startswith("epoch ") and " step " in line
    ]


@pytest.mark.slow
def test_shuffled_loop_with_workers_and_dropout_resumes_bitwise(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """RandomSampler, two DataLoader workers, dropout, StepLR: stopped mid-epoch, resumed."""
    step = random.Random(1203).randint(12, 28)  # 3 epochs of 10 batches
    args = [PYTHON, str(SHUFFLED), "--epochs", "3"]
    reference = spawn(
        [*args, "--save-model", str(tmp_path / "reference.pt")], shim_env.without_shim()
    )
    cut = spawn(
        [*args, "--save-model", str(tmp_path / "cut.pt")], {**shim_env.env, HOLD: str(step)}
    )
    cut.wait_for(f"holding at step {step} ", timeout=180)
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    assert "training finished" not in cut.output() and not (tmp_path / "cut.pt").exists()
    assert_attached_once(cut.output(), "this training loop: 1 module(s)", shim_env.checkpoints)
    assert checkpoint_steps(shim_env.checkpoints) == [step]
    state_dir = shim_env.checkpoints / f"checkpoint-{step}" / "loop-state"
    assert sorted(p.name for p in state_dir.iterdir()) == ["node-0.json", "rank-00000.pt"]
    assert json.loads((state_dir / "node-0.json").read_text())["step"] == step
    assert reference.wait(timeout=180) == 0, reference.output()[-3000:]

    # The same script with another batch size: the checkpoint does not fit, training starts over.
    changed = spawn(
        [*args, "--batch-size", "32", "--save-model", str(tmp_path / "changed.pt")], shim_env.env
    )
    assert changed.wait(timeout=180) == 0, changed.output()[-3000:]
    assert f"cannot resume the training loop from checkpoint-{step}" in changed.output()
    assert "training starts over" in changed.output()
    assert len(losses(changed.output())) == 3 * 5  # every step of 3 epochs of 5 batches

    resumed = spawn([*args, "--save-model", str(tmp_path / "resumed.pt")], shim_env.env)
    assert resumed.wait(timeout=180) == 0, resumed.output()[-3000:]
    output = resumed.output()
    assert f"resumed at step {step}: DataLoader #0, pass {(step - 1) // 10}" in output
    assert output.count("training finished") == 1
    assert_bitwise_equal(tmp_path / "resumed.pt", tmp_path / "reference.pt")
    # The losses printed after the resume are the uninterrupted run's, batch for batch.
    assert losses(output) == losses(reference.output())[step:]


@pytest.mark.slow
def test_accelerate_loop_stopped_at_an_epoch_end_resumes_bitwise(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """The save point is the request that ends the pass: the resumed pass has nothing left."""
    args = [PYTHON, str(ACCELERATE)]
    reference = spawn([*args, "--output", str(tmp_path / "reference.pt")], shim_env.without_shim())
    cut = spawn([*args, "--output", str(tmp_path / "cut.pt")], {**shim_env.env, HOLD: "8"})
    cut.wait_for("holding at step 8 ", timeout=180)  # 24 batches, 3 per step: an epoch's end
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    assert_attached_once(cut.output(), "this training loop: ", shim_env.checkpoints)
    resumed = spawn([*args, "--output", str(tmp_path / "resumed.pt")], shim_env.env)
    assert resumed.wait(timeout=180) == 0, resumed.output()[-3000:]
    assert "resumed at step 8: DataLoader #1, pass 0, after batch 24" in resumed.output()
    assert reference.wait(timeout=180) == 0
    assert_bitwise_equal(tmp_path / "resumed.pt", tmp_path / "reference.pt")


@pytest.mark.slow
def test_cycle_loop_is_not_followed_trains_unchanged_and_sigterm_acts_as_without_shim(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    args = [PYTHON, str(CYCLE)]
    plain = spawn([*args, "--save-model", str(tmp_path / "plain.pt")], shim_env.without_shim())
    shimmed = spawn([*args, "--save-model", str(tmp_path / "shimmed.pt")], shim_env.env)
    assert shimmed.wait(timeout=180) == 0, shimmed.output()[-3000:]
    assert plain.wait(timeout=180) == 0
    assert_bitwise_equal(tmp_path / "shimmed.pt", tmp_path / "plain.pt")
    reasons = [
        line for line in shimmed.output().splitlines() if "cannot be resumed exactly" in line
    ]
    assert len(reasons) == 1 and "without a new batch from a DataLoader" in reasons[0]

    # Stopped while cycle still reads its first pass: found at the save point, no checkpoint,
    # and the process dies of SIGTERM as it would without the shim.
    stopped = spawn(
        [*args, "--save-model", str(tmp_path / "stopped.pt")], {**shim_env.env, HOLD: "2"}
    )
    stopped.wait_for("holding at step 2 ", timeout=180)
    stopped.signal(signal.SIGTERM)
    assert stopped.wait(timeout=120) == -signal.SIGTERM
    assert "itertools.cycle over a DataLoader" in stopped.output()
    assert checkpoint_steps(shim_env.checkpoints) == []


class _Exploit:
    """Unpickling this runs a command: what a tampered checkpoint in the store could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_never_loaded(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    state_dir = shim_env.checkpoints / "checkpoint-5" / "loop-state"
    state_dir.mkdir(parents=True)
    marker = tmp_path / "code-ran"
    torch.save({"format": 1, "step": 5, "payload": _Exploit(marker)}, state_dir / "rank-00000.pt")
    (state_dir / "node-0.json").write_text(json.dumps({"format": 1, "step": 5}))
    run = spawn(
        [
            PYTHON,
            str(SHUFFLED),
            "--epochs",
            "1",
            "--workers",
            "0",
            "--save-model",
            str(tmp_path / "model.pt"),
        ],
        shim_env.env,
    )
    assert run.wait(timeout=180) == 0, run.output()[-3000:]
    assert not marker.exists()
    assert "its state cannot be read" in run.output() and "training starts over" in run.output()
    assert len(losses(run.output())) == 10  # trained from the start


@pytest.mark.slow
def test_sigterm_after_the_last_step_acts_as_without_the_shim(
    shim_env: ShimEnv, spawn: Spawn
) -> None:
    """No step boundary comes after the signal: the shim gives up waiting and lets it act."""
    run = spawn([PYTHON, str(SCRIPTS / "loop_long_eval.py")], shim_env.env)
    run.wait_for("training done; evaluating", timeout=180)
    run.signal(signal.SIGTERM)
    assert run.wait(timeout=120) == -signal.SIGTERM  # the 600 s evaluation did not run out
    assert "SIGTERM acts as without jitckpt" in run.output()
    assert "evaluation done" not in run.output()
    assert checkpoint_steps(shim_env.checkpoints) == []


PROBLEMS = """
import json
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset
from shim import dataloaders

dataloaders.install(torch)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


class EveryOther(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return self.n // 2


data = TensorDataset(torch.randn(8, 2))
loaders = {
    "plain": DataLoader(data, batch_size=2, shuffle=True),
    "iterable": DataLoader(Stream(), batch_size=2),
    "persistent": DataLoader(data, batch_size=2, num_workers=1, persistent_workers=True),
    "persistent unordered": DataLoader(
        data, batch_size=2, num_workers=2, persistent_workers=True, in_order=False
    ),
    "own sampler": DataLoader(data, batch_size=2, sampler=EveryOther(8)),
}
tracks = {name: loader.__dict__[dataloaders.ATTR_TRACK] for name, loader in loaders.items()}
print(json.dumps({name: track.problem for name, track in tracks.items()}))
"""


def test_loaders_whose_place_cannot_be_replayed_are_named(shim_env: ShimEnv) -> None:
    done = subprocess.run(
        [PYTHON, "-c", PROBLEMS],
        env=shim_env.without_shim(),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    problems = json.loads(done.stdout.splitlines()[-1])
    assert problems["plain"] is None
    assert "IterableDataset" in problems["iterable"]
    assert problems["persistent"] is None  # their states are followed (``workerstates``)
    assert "persistent DataLoader workers with in_order=False" in problems["persistent unordered"]
    assert "sampler EveryOther" in problems["own sampler"]


TWO_RATES = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4, shuffle=True)
critic, generator = nn.Linear(4, 1), nn.Linear(4, 4)
critic_opt = torch.optim.SGD(critic.parameters(), lr=0.01)
generator_opt = torch.optim.SGD(generator.parameters(), lr=0.01)
for step, (real,) in enumerate(loader):
    critic_opt.zero_grad()
    (critic(generator(real).detach()).mean() - critic(real).mean()).backward()
    critic_opt.step()
    if step % 3 == 2:  # the generator steps once every 3 critic steps
        generator_opt.zero_grad()
        (-critic(generator(real)).mean()).backward()
        generator_opt.step()
print("trained", flush=True)
"""


@pytest.mark.slow
def test_two_optimizers_at_different_rates_are_not_followed(shim_env: ShimEnv) -> None:
    done = subprocess.run(
        [PYTHON, "-c", TWO_RATES],
        env=shim_env.env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    assert "trained" in done.stdout
    assert "cannot be resumed exactly (two optimizers step at different rates)" in done.stderr


OWN_RESUME = """
import json
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from shim import dataloaders

dataloaders.install(torch)
refused = []


class Listener(dataloaders.Listener):
    def plan_refused(self, reason):
        refused.append(reason)
        dataloaders.TRACKER.drop_plans()


dataloaders.TRACKER.listener = Listener()
sampler = DistributedSampler(TensorDataset(torch.randn(8, 2)), num_replicas=1, rank=0)
loader = DataLoader(sampler.dataset, batch_size=2, sampler=sampler)
track = loader.__dict__[dataloaders.ATTR_TRACK]
# The checkpoint: passes 0 and 1 trained at sampler epochs 1 and 2, pass 2 interrupted.
dataloaders.TRACKER.assign([{
    "index": 0, "iteration": 2, "yielded": 1, "exhausted": False, "trigger": True,
    "start": None, "training": [[0, 2]], "epochs": {0: [1], 1: [2], 2: [3]},
    "signature": track.signature,
}])
sampler.set_epoch(2)  # the script resumed by itself: its first pass is epoch 2
batches = list(iter(loader))
print(json.dumps({"refused": refused, "batches": len(batches)}))
"""


def test_a_script_that_resumes_by_itself_is_not_replayed(shim_env: ShimEnv) -> None:
    done = subprocess.run(
        [PYTHON, "-c", OWN_RESUME],
        env=shim_env.without_shim(),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert len(result["refused"]) == 1
    assert "pass 0 starts at sampler epoch [2], in the checkpoint at [1]" in result["refused"][0]
    assert result["batches"] == 4  # not replayed as a finished pass: the whole pass runs


@pytest.mark.slow
def test_accelerate_s_stateful_loader_over_a_stream_resumes_bitwise(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """``use_stateful_dataloader=True``: Accelerate's shard reads its StatefulDataLoader a
    batch ahead, so the place saved is the shard's own snapshot, not the loader's (which
    would skip a batch on resume, silently)."""
    args = [PYTHON, str(SCRIPTS / "loop_accelerate_streaming.py")]
    args += ["--corpus", str(tmp_path / "corpus.jsonl")]
    out = {
        name: ["--output", str(tmp_path / f"{name}.pt")] for name in ("reference", "cut", "resumed")
    }
    reference = spawn([*args, *out["reference"]], shim_env.without_shim())
    cut = spawn([*args, *out["cut"]], {**shim_env.env, HOLD: "7"})
    cut.wait_for("holding at step 7 ", timeout=180)  # 40 batches, 2 per step: mid-pass
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    resumed = spawn([*args, *out["resumed"]], shim_env.env)
    assert resumed.wait(timeout=180) == 0, resumed.output()[-3000:]
    assert "resumed at step 7: DataLoader #1, pass 0, after batch 14" in resumed.output()
    assert reference.wait(timeout=180) == 0
    assert_bitwise_equal(tmp_path / "resumed.pt", tmp_path / "reference.pt")
    assert losses_of(resumed.output()) == losses_of(reference.output())[14:]


def losses_of(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("loss ")]


@pytest.mark.slow
def test_a_loop_with_no_loader_called_per_epoch_resumes_its_whole_stack(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """word_language_model's shape: a module-level epoch loop dividing the global ``lr`` on a
    plateau calls ``train()``, whose loop walks a tensor in slices with a hidden state carried
    over. Stopped inside the second epoch, the resumed run goes on in that epoch of the outer
    loop too, and ends where the uninterrupted run ends, bitwise."""
    args = [PYTHON, str(SCRIPTS / "loop_epochs_own_batches.py"), "--epochs", "4"]
    reference = spawn([*args, "--save", str(tmp_path / "reference.pt")], shim_env.without_shim())
    cut = spawn([*args, "--save", str(tmp_path / "cut.pt")], {**shim_env.env, HOLD: "35"})
    cut.wait_for("holding at step 35 ", timeout=180)  # 25 batches an epoch: epoch 2, batch 9
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    assert checkpoint_steps(shim_env.checkpoints) == [35]
    said = [line for line in cut.output().splitlines() if "own variables are saved" in line]
    assert len(said) == 1 and "frame(s) whose loops call it" in said[0], cut.output()[-3000:]
    resumed = spawn([*args, "--save", str(tmp_path / "resumed.pt")], shim_env.env)
    assert resumed.wait(timeout=180) == 0, resumed.output()[-3000:]
    output = resumed.output()
    assert "resumed at step 35: the head of its loop in" in output, output[-3000:]
    assert reference.wait(timeout=180) == 0, reference.output()[-3000:]
    assert compare_saved(tmp_path / "reference.pt", tmp_path / "resumed.pt") == []

    def trained(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("| epoch")]

    assert trained(output) == trained(reference.output())[35:]
