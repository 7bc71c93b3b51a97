"""Preempt at a random step, resume, and end bitwise equal to a run never preempted.

The dimensions are the node count (1, 2), the destination (S3, pvc://), the
sidecar mode (native, legacy) and which pods get SIGTERM (all, one of two).
Running the full cross product would take far longer than the suite's
budget, so the combinations below form a pairwise covering array of the
three two-valued dimensions (nodes x store x mode): every pair of values of
any two dimensions runs together at least once, each with its own seed. The
second also sends SIGTERM to one pod of two only (both must stop at the same
step); the default demo runs 2 nodes, S3, native, all pods:

    1 node,  S3,     legacy, all pods
    2 nodes, S3,     native, one pod of two
    1 node,  pvc://, native, all pods
    2 nodes, pvc://, legacy, all pods

The step comes from a seeded RNG (the seed is in the test id, the step is
printed), so a failure can be replayed; the demo's pods hold there until the
SIGTERM, so the JIT checkpoint is at exactly that step. The trainer is the bundled script
behind a wrapper that prints the checkpoint directory when it starts: in the
resumed run it must already hold the restored checkpoint.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from local.demo.scenario import DemoOptions, run_demo
from tests.e2e.support import MAX_STEPS, SCRIPT, script_args, start_listings

# One worker for every case: the uninterrupted runs (session fixture) are made once.
pytestmark = pytest.mark.xdist_group("e2e-uninterrupted")


@dataclass(frozen=True)
class Combo:
    nnodes: int
    store: str  # "s3" or "pvc"
    mode: str  # "native" or "legacy"
    preempt_nodes: str  # "all" or "one"
    seed: int

    @property
    def id(self) -> str:
        return f"{self.nnodes}node-{self.store}-{self.mode}-{self.preempt_nodes}-seed{self.seed}"


COMBOS = [
    Combo(1, "s3", "legacy", "all", 1101),
    Combo(2, "s3", "native", "one", 2202),
    Combo(1, "pvc", "native", "all", 3303),
    Combo(2, "pvc", "legacy", "all", 4404),
]


@pytest.mark.slow
@pytest.mark.parametrize("combo", COMBOS, ids=[c.id for c in COMBOS])
def test_preempt_resume_equal(
    combo: Combo,
    tmp_path: Path,
    uninterrupted: Callable[[int], Path],
    request: pytest.FixtureRequest,
) -> None:
    nnodes, seed = combo.nnodes, combo.seed
    step = random.Random(seed).randint(3, MAX_STEPS // 2)
    print(f"seed {seed}: preempting at step {step}", file=sys.stderr)
    if combo.store == "s3":
        destination = f"s3://{request.getfixturevalue('s3_bucket')}/matrix"
    else:
        destination = "pvc://ckpt-claim/matrix"
    options = DemoOptions(
        script=SCRIPT,
        script_args=script_args(tmp_path),
        nnodes=nnodes,
        preempt_at_step=step,
        preempt_nodes=combo.preempt_nodes,
        destination=destination,
        sidecar_mode=combo.mode,
        compare=True,
        reference_weights=uninterrupted(nnodes),
        workdir=tmp_path / "demo",
        keep=True,
    )
    summary = run_demo(options, sys.stderr)
    context = f"seed {seed}, step {step}: {summary}"
    assert summary["ok"] is True, context
    jit = summary["jit_checkpoint_step"]
    assert jit == step, context
    assert summary["resumed_from_step"] == jit, context
    assert summary["equal_to_uninterrupted"] is True, context
    assert summary["trainer_exit_codes"] == [143] * nnodes, context
    assert summary["final_exit_codes"] == [0] * nnodes, context
    assert summary["final_step"] == MAX_STEPS, context  # the trainers' final progress report
    # Every node's sidecar committed the same JIT step, also the pod that got no SIGTERM.
    assert len(summary["termination_messages"]) == nnodes
    assert all(f"step {jit} (jit)" in m for m in summary["termination_messages"]), context
    # The resumed trainers found the restored checkpoint in place when they started.
    for log in summary["trainer_logs"]["resumed"]:
        listings = start_listings(Path(log))
        assert listings, f"no start listing in {log}"
        assert all(listing == [f"checkpoint-{jit}"] for listing in listings), (log, listings)
    # and the first run's trainers started with nothing to resume
    for log in summary["trainer_logs"]["preempted"]:
        assert all(listing == [] for listing in start_listings(Path(log))), log
