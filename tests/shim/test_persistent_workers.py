"""DataLoader workers that persist across epochs (``persistent_workers=True``)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.shim.support import PYTHON, REPO, ShimEnv, Spawn, assert_stood_down, checkpoint_steps
from tests.shim.test_datareplay import JITTER

HF_PERSISTENT_SCRIPT = """
import random, sys
import numpy as np
import torch
from transformers import Trainer, TrainingArguments, set_seed
from local.demo import train_tiny

output, weights, mode = sys.argv[1], sys.argv[2], sys.argv[3]


class Augmented(train_tiny.SyntheticTokens):
    # Augmentation in the workers, from each of their generators: a random shift (torch), a
    # random token (numpy), a random position for it (Python's random).
    def __getitem__(self, index):
        row = self.tokens[index].roll(int(torch.randint(8, ())))
        row[random.randrange(len(row))] = int(np.random.randint(200))
        return {"input_ids": row, "labels": row.clone()}


class Streamed(torch.utils.data.IterableDataset):
    # A stream the loader cannot find its place in again.
    def __init__(self, tokens):
        self.tokens = tokens

    def __iter__(self):
        for row in self.tokens:
            yield {"input_ids": row, "labels": row.clone()}


args = train_tiny.parse_args(["--output-dir", output, "--step-sleep", "0.3"])
set_seed(args.seed)
augmented = Augmented(args.seed, args.vocab_size)
trainer = Trainer(
    model=train_tiny.build_model(args),
    args=TrainingArguments(
        output_dir=output, max_steps=40, per_device_train_batch_size=16, use_cpu=True,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=args.seed,
        learning_rate=1e-3, dataloader_num_workers=2, dataloader_persistent_workers=True,
    ),
    train_dataset=Streamed(augmented.tokens) if mode == "streamed" else augmented,
    callbacks=train_tiny.make_callbacks(args.step_sleep),
)
result = trainer.train()
print(f"train() returned at step {result.global_step}", flush=True)
torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, weights)
"""


def _hf_script(tmp_path: Path) -> str:
    script = tmp_path / "persistent.py"
    script.write_text(HF_PERSISTENT_SCRIPT)
    return str(script)


@pytest.mark.slow
def test_hf_trainer_with_persistent_workers_it_cannot_follow_is_refused_as_everywhere_else(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """Persistent workers over a stream the shim cannot find its place in again: no resume
    can be exact, HF's own batch skipping included. The shim stands down in the words
    Lightning's and the plain loop's integrations use, before the first step, and SIGTERM
    ends the run as it would without jitckpt (no JIT checkpoint to resume wrongly)."""
    script = _hf_script(tmp_path)
    runs = {}
    for name, env in (("plain", shim_env.without_shim()), ("shim", shim_env.env)):
        weights = str(tmp_path / f"{name}.pt")
        run = spawn([PYTHON, script, str(tmp_path / name), weights, "streamed"], env)
        run.wait_for("rank 0 step 3/", timeout=180)
        run.signal(signal.SIGTERM)
        runs[name] = (run.wait(timeout=120), run.output())
    code, output = runs["shim"]
    assert code == runs["plain"][0] == -signal.SIGTERM, output[-3000:]
    reason = "(persistent DataLoader workers of a loader whose place"
    assert_stood_down(output, reason, "rank 0 step 1/", shim_env.checkpoints)


@pytest.mark.slow
def test_hf_trainer_with_persistent_workers_resumes_bitwise_past_the_epoch(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    """2 persistent workers augmenting at random, 16 steps an epoch, 40 steps: stopped in the
    first epoch, resumed, the final weights equal the uninterrupted run's bitwise."""
    script = _hf_script(tmp_path)
    one_thread = {"OMP_NUM_THREADS": "1"}
    reference = spawn(
        [PYTHON, script, str(tmp_path / "a"), str(tmp_path / "reference.pt"), "exact"],
        {**shim_env.without_shim(), **one_thread},
    )
    cut = spawn(
        [PYTHON, script, str(tmp_path / "b"), str(tmp_path / "cut.pt"), "exact"],
        {**shim_env.env, **one_thread},
    )
    cut.wait_for("rank 0 step 5/", timeout=180)
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=120) == 143, cut.output()[-3000:]
    [step] = checkpoint_steps(shim_env.checkpoints)
    assert step < 16
    resumed = spawn(
        [PYTHON, script, str(tmp_path / "b"), str(tmp_path / "resumed.pt"), "exact"],
        {**shim_env.env, **one_thread},
    )
    assert resumed.wait(timeout=300) == 0, resumed.output()[-3000:]
    output = resumed.output()
    assert "the train data replays its epoch to batch" in output, output[-3000:]
    assert "train() returned at step 40" in output
    assert reference.wait(timeout=300) == 0, reference.output()[-3000:]
    a = torch.load(tmp_path / "reference.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def _answer(script: str, *args: str) -> Any:
    """What ``script`` printed last, as JSON (run in a process of its own)."""
    done = subprocess.run(
        [PYTHON, "-c", script, *args],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


# Train EPOCHS epochs over ``make()``, a record taken after batch ``argv[2]`` of epoch
# ``argv[1]`` (saved and read back as a checkpoint is); a new loader armed with it trains on:
# are its batches the uninterrupted run's from there, the later epochs' too?
RESUMED_EQUALS_UNINTERRUPTED = """
import io

EPOCHS, BATCHES = 3, 10


def train(loader, epochs, at=None):
    seen, record = [], None
    for epoch in range(epochs):
        for number, batch in enumerate(loader):
            seen.append(batch + torch.rand(1, dtype=torch.float64))  # the step's own draw
            if (epoch, number) == at:
                record = dataloaders.TRACKER.record(loader)
                record = {"loader": record, "rng": dataloaders.rngstate.capture()}
    return seen, record


epoch, number = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
assert dataloaders.TRACKER.problem_of(make()) is None
reference, record = train(make(), EPOCHS, (epoch, number))
buffer = io.BytesIO()
torch.save(record, buffer)
buffer.seek(0)
record = torch.load(buffer, weights_only=True)  # as a checkpoint is read back

torch.manual_seed(99)  # whatever the states are now: the resume puts back its own
random.seed(99)
resumed_loader = make()
assert dataloaders.TRACKER.arm(
    resumed_loader, record["loader"], lambda: dataloaders.rngstate.restore(record["rng"])
)
resumed, _ = train(resumed_loader, EPOCHS - epoch)
expected = reference[epoch * BATCHES + number + 1:]
print(json.dumps({
    "count": [len(resumed), len(expected)],
    "equal": [torch.equal(a, b) for a, b in zip(resumed, expected)],
}))
"""

PERSISTENT_REPLAY = (
    JITTER
    + """

def make():
    return DataLoader(Jitter(), batch_size=4, shuffle=True, num_workers=2,
                      persistent_workers=True, worker_init_fn=seed_worker)
"""
    + RESUMED_EQUALS_UNINTERRUPTED
)


@pytest.mark.parametrize(("epoch", "batch"), [(0, 2), (1, 3), (2, 6)])
def test_persistent_workers_resume_in_any_epoch_with_the_same_random_batches(
    epoch: int, batch: int
) -> None:
    """Two persistent workers augmenting at random; the place is recorded after the loop took
    batch ``batch`` of epoch ``epoch`` (the workers have prefetched beyond it), a new loader is
    armed with it: every batch after it, the later epochs' too, is bitwise the uninterrupted
    run's (each worker's states as of that batch, the round robin, the main process's draws)."""
    result = _answer(PERSISTENT_REPLAY, str(epoch), str(batch))
    assert result["count"][0] == result["count"][1] > 0
    assert all(result["equal"]), result["equal"]


ACCELERATE_FOLLOWED = """
import json
import torch
from torch.utils.data import DataLoader, TensorDataset
from shim import dataloaders
import accelerate.data_loader

dataloaders.install(torch)
dataloaders.install_accelerate(accelerate.data_loader)
from accelerate import Accelerator

loader = Accelerator(cpu=True).prepare(DataLoader(
    TensorDataset(torch.randn(16, 2)), batch_size=4, shuffle=True, num_workers=2,
    persistent_workers=True))
batches = iter(loader)
next(batches)
record = dataloaders.TRACKER.record(loader)
print(json.dumps({
    "problem": dataloaders.TRACKER.problem_of(loader),
    "workers": sorted(int(w) for w in (record.get("workers") or {}).get("states", {})),
}))
"""


def test_persistent_workers_under_accelerates_prepared_loader_are_followed() -> None:
    """A loop of the program's own over Accelerate's shard (which reads a batch ahead of
    the loop): the workers' states are recorded as for a plain DataLoader, for the first
    batch the loop has not taken (bitwise on 2 nodes: tests/e2e/test_datapath.py)."""
    answer = _answer(ACCELERATE_FOLLOWED)
    assert answer["problem"] is None
    assert answer["workers"] == [0, 1]


SHARD_REPLAY = (
    JITTER
    + """
import accelerate.data_loader
from accelerate import Accelerator

dataloaders.install_accelerate(accelerate.data_loader)
workers, persistent = int(sys.argv[3]), sys.argv[4] == "persistent"


def make():
    # A loader with a generator of its own: its shuffle (and, with workers, their base
    # seed) draws from it; 40 samples, batch 4: the sampler's remainder is drawn as the
    # pass's last index is asked for.
    return Accelerator(cpu=True).prepare(DataLoader(
        Jitter(), batch_size=4, shuffle=True, num_workers=workers,
        persistent_workers=persistent, worker_init_fn=seed_worker if workers else None,
        generator=torch.Generator().manual_seed(5)))
"""
    + RESUMED_EQUALS_UNINTERRUPTED
)


@pytest.mark.parametrize(
    ("workers", "kind", "batch"),
    [(0, "fresh", 9), (2, "fresh", 5), (2, "persistent", 5), (2, "persistent", 8)],
)
def test_a_resume_through_accelerates_shard_gets_the_next_epochs_shuffles_right(
    workers: int, kind: str, batch: int
) -> None:
    """Accelerate's shard reads a batch ahead: that read is made again from the states it was
    made from, and the loader's own generator is left as the first run's read left it. A
    read draws from it when it asks for the pass's last index (the sampler's remainder):
    with workers, index requests run ahead of the reads and a stop in the middle of the pass
    is such a read; without, the stop at the pass's last batch. Put back as it was before
    the read, every later epoch's shuffle would differ."""
    result = _answer(SHARD_REPLAY, "0", str(batch), str(workers), kind)
    assert result["count"][0] == result["count"][1] > 0
    assert all(result["equal"]), result["equal"]
