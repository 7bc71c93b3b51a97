"""Random numbers in the data path resume exactly, under every framework the shim follows.

Each story is ``jitckpt demo --script S --nnodes 2 --preempt-nodes one
--compare --json`` on a user's script, unchanged: the augmentation or the
collator draws random numbers in DataLoader worker processes seeded by the
DataLoader or by ``worker_init_fn``, one of the two pods is preempted
mid-epoch, and the resumed run must equal the uninterrupted one: the demo's
verdict and the model file the script saved at its end, byte for byte.

Draws in the main process (noise, dropout, a collator without workers) are in
the other stories of every framework (``test_plainloop``, ``test_loop_state``,
``test_demo_scripts``, ``test_pretraining``); the scripts here take
``--workers 0`` for them when run by hand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.support import demo_summary

SCRIPTS = Path(__file__).with_name("scripts")


@dataclass(frozen=True)
class Case:
    name: str
    script: str
    step: int  # mid-epoch, and not the first step of a pass
    saved: str  # what the script writes, relative to its working directory
    args: list[str] = field(default_factory=list)


CASES = [
    # 192 samples / 2 ranks / batch 8: 12 steps an epoch, 3 epochs; persistent workers,
    # stopped in the first epoch: the resumed run's workers carry their states on.
    Case("plain-ddp-2-workers", "loop_augment_workers.py", 7, "augmented_model.pt"),
    # 160 samples / 2 ranks / batch 8: 10 steps an epoch, 3 epochs; persistent workers under
    # Accelerate's shard (which reads a batch ahead), stopped in the first epoch: the
    # workers' states as of the first batch the loop had not taken, carried into the next
    # epochs; and the shuffle's generator as the first run left it at the save (the workers'
    # requests for indices, ahead of the reads, drew the sampler's remainder before it).
    Case(
        "accelerate-2-persistent-workers",
        "loop_accelerate_augment.py",
        6,
        "accelerate_augment.pt",
        ["--workers", "2", "--persistent"],
    ),
    # 64 sentences / 2 ranks / batch 4: 8 steps an epoch, 3 epochs; persistent workers
    # (the collator masks in them), stopped in the first epoch.
    Case("hf-mlm-2-workers", "train_mlm_collator.py", 5, "mlm-out/model.safetensors"),
    # 160 samples / 2 ranks / batch 8: 10 steps an epoch, 3 epochs; stopped in the second
    # epoch, whose DistributedSampler epoch the resumed iterator must draw its order from.
    Case("lightning-2-workers", "train_lightning_augment.py", 13, "lightning_augment.pt"),
    # The same with the workers kept alive (persistent_workers=True), stopped in the first
    # epoch of three: their states as of the first batch not taken, carried into the next
    # epochs, whose samplers' epoch the resumed iterator is set to before it draws.
    Case(
        "lightning-2-persistent-workers",
        "train_lightning_augment.py",
        7,
        "lightning_augment.pt",
        ["--persistent"],
    ),
]


def run_demo_cli(case: Case, workdir: Path) -> dict:
    options = ["--nnodes", "2", "--preempt-nodes", "one", "--preempt-at-step", str(case.step)]
    return demo_summary(SCRIPTS / case.script, [*options, "--keep", "--", *case.args], workdir)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_random_data_path_resumes_bitwise(case: Case, tmp_path: Path) -> None:
    summary = run_demo_cli(case, tmp_path / "demo")
    context = json.dumps(summary)[-5000:]
    assert summary["jit_checkpoint_step"] == summary["resumed_from_step"] == case.step, context
    assert summary["equal_to_uninterrupted"] is True, context
    assert summary["ok"] is True, context
    work = tmp_path / "demo" / "work"
    reference, resumed = (work / run / "node-0" / case.saved for run in ("reference", "run-2"))
    assert resumed.read_bytes() == reference.read_bytes(), context
