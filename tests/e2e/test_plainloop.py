"""Plain PyTorch loops through the pod runner: preempted at a random step, resumed, bitwise equal.

Each story is ``jitckpt demo`` with a user's script, unchanged: PyTorchJob
pods injected by the webhook's mutation, real sidecars, the embedded S3
server or a pvc:// destination, torchrun, gloo, real SIGTERM through the
preStop path. The step comes from a seeded RNG (in the test id), away from
epoch boundaries (mid-epoch). Besides the demo's own verdict (the shim's
final weights of the resumed run equal the uninterrupted run's), the model
file the script itself saves after training is compared byte for byte, and
that post-training code must have run once: at the end of the resumed run,
never in the preempted one.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from local.demo.scenario import DemoOptions, open_scenario, reference_run, run_demo
from local.demo.weights import compare_saved

# One worker for the module: its DDP reference run is made once.
# Its shared fixtures are session ones (tests/conftest.py says why).
pytestmark = pytest.mark.xdist_group("e2e-plainloop")

SCRIPTS = Path(__file__).with_name("scripts")
DDP_SCRIPT = SCRIPTS / "loop_ddp_mnist.py"
ACCELERATE_SCRIPT = SCRIPTS / "loop_accelerate.py"
SHUFFLED_SCRIPT = SCRIPTS / "loop_shuffled.py"
DDP_STEPS, DDP_STEPS_PER_EPOCH = 24, 8  # 256 samples, 2 ranks, batch 16, 3 epochs
DDP_MODEL = "mnist_cnn.pt"


def mid_epoch_step(seed: int, steps: int, per_epoch: int) -> int:
    rng = random.Random(seed)
    while True:
        step = rng.randint(2, steps - 2)
        if step % per_epoch:
            return step


def lines_with(log: str, text: str) -> int:
    return Path(log).read_text(errors="replace").count(text)


@dataclass(frozen=True)
class Reference:
    weights: Path  # what the shim captured at the end (the demo's --compare)
    model: Path  # what the script itself saved


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    """The DDP script on 2 ranks, never preempted (shared by every DDP story)."""
    workdir = tmp_path_factory.mktemp("ddp-reference")
    options = DemoOptions(
        script=DDP_SCRIPT, nnodes=2, destination="pvc://unused/reference", workdir=workdir
    )
    weights = workdir / "weights.pt"
    with open_scenario(options, sys.stderr) as scenario:
        run = reference_run(scenario, weights)
    assert run.exit_codes() == [0, 0], run.logs()
    yield Reference(weights, workdir / "work" / "reference" / "node-0" / DDP_MODEL)


@dataclass(frozen=True)
class Story:
    nnodes: int
    nproc: int
    preempt: str  # "all" or "one"
    store: str  # "s3" or "pvc"
    seed: int

    @property
    def id(self) -> str:
        return f"{self.nnodes}x{self.nproc}-{self.preempt}-{self.store}-seed{self.seed}"


DDP_STORIES = [Story(2, 1, "one", "s3", 1212), Story(1, 2, "all", "pvc", 2323)]


@pytest.mark.slow
@pytest.mark.parametrize("story", DDP_STORIES, ids=[s.id for s in DDP_STORIES])
def test_ddp_loop_preempted_mid_epoch_resumes_bitwise(
    story: Story, tmp_path: Path, ddp_reference: Reference, request: pytest.FixtureRequest
) -> None:
    step = mid_epoch_step(story.seed, DDP_STEPS, DDP_STEPS_PER_EPOCH)
    print(f"{story.id}: preempting at step {step}", file=sys.stderr)
    if story.store == "s3":
        destination = f"s3://{request.getfixturevalue('s3_bucket')}/loops"
    else:
        destination = "pvc://ckpt-claim/loops"
    options = DemoOptions(
        script=DDP_SCRIPT,
        nnodes=story.nnodes,
        nproc_per_node=story.nproc,
        preempt_at_step=step,
        preempt_nodes=story.preempt,
        destination=destination,
        reference_weights=ddp_reference.weights,
        workdir=tmp_path / "demo",
        keep=True,
    )
    summary = run_demo(options, sys.stderr)
    context = f"{story.id}, step {step}: {json.dumps(summary)[:3000]}"
    assert summary["ok"] is True, context
    assert summary["jit_checkpoint_step"] == summary["resumed_from_step"] == step, context
    assert summary["trainer_exit_codes"] == [143] * story.nnodes, context
    assert summary["final_step"] == DDP_STEPS, context
    assert summary["equal_to_uninterrupted"] is True, context
    # The script's own model file, saved by rank 0 after training, byte for byte.
    model = tmp_path / "demo" / "work" / "run-2" / "node-0" / DDP_MODEL
    assert model.read_bytes() == ddp_reference.model.read_bytes()
    # Post-training code: never in the preempted run, once in the resumed one.
    assert all(
        lines_with(log, "training done") == 0 for log in summary["trainer_logs"]["preempted"]
    )
    assert sum(lines_with(log, "training done") for log in summary["trainer_logs"]["resumed"]) == 1
    for log in summary["trainer_logs"]["resumed"]:
        assert lines_with(log, f"resumed at step {step}:") == story.nproc, log
    # The model and optimizer are in the store once, in shares every node reads; a rank
    # file is its rank's own: on two nodes each downloads the shares and its own files.
    if story.nnodes > 1:
        for log in summary["sidecar_logs"]["resumed"]:
            assert lines_with(log, "this node's files and the shared ones only") == 1, log
    # The loop runs in train(), called by main()'s epoch loop: both frames' books are saved,
    # and the batch in flight (data, target: stored again before any read) is not.
    for log in summary["trainer_logs"]["preempted"]:
        assert lines_with(log, "of the 1 frame(s) whose loops call it") == story.nproc, log
    if story.store != "s3":
        ranks = sorted((tmp_path / "demo").glob(f"**/checkpoint-{step}/loop-state/rank-*.pt"))
        assert ranks, context
        for rank_file in ranks:
            books = torch.load(rank_file, weights_only=True)["books"]
            assert {"data", "target"} <= set(books["dead"]), books["dead"]
            assert not {"data", "target"} & set(books["variables"]), rank_file


@pytest.mark.slow
def test_accelerate_loop_with_accumulation_preempted_resumes_bitwise(tmp_path: Path) -> None:
    """Two ranks of an Accelerate loop, 3 batches per optimizer step, a per-step schedule."""
    step = mid_epoch_step(3434, 12, 4)  # 192 samples / 2 ranks / batch 8 / 3 per step, 3 epochs
    options = DemoOptions(
        script=ACCELERATE_SCRIPT,
        nnodes=1,
        nproc_per_node=2,
        preempt_at_step=step,
        destination="pvc://ckpt-claim/accelerate",
        workdir=tmp_path / "demo",
        keep=True,
    )
    summary = run_demo(options, sys.stderr)
    context = f"step {step}: {json.dumps(summary)[:3000]}"
    assert summary["ok"] is True, context
    assert summary["jit_checkpoint_step"] == summary["resumed_from_step"] == step, context
    assert summary["final_step"] == 12, context
    assert summary["equal_to_uninterrupted"] is True, context
    work = tmp_path / "demo" / "work"
    saved = [work / run / "node-0" / "accelerate_model.pt" for run in ("reference", "run-2")]
    assert saved[0].read_bytes() == saved[1].read_bytes()


@pytest.mark.slow
def test_demo_cli_on_a_loop_with_no_loader_called_per_epoch_reports_ok(tmp_path: Path) -> None:
    """``jitckpt demo --script ... --compare --json`` as a user runs it, one pod, one process,
    on word_language_model's shape: a module-level epoch loop calls ``train()``, whose loop
    walks a tensor in slices with an LSTM's hidden state carried over, and divides the
    module global ``lr`` by 4 on a plateau. Preempted inside its second epoch, the resumed
    run ends where the uninterrupted one ends: its weights, ``lr`` and ``best_val_loss``."""
    step = 25 + mid_epoch_step(6161, 25, 25)  # 25 batches an epoch: inside the second
    jitckpt = Path(sys.executable).with_name("jitckpt")
    done = subprocess.run(
        [
            str(jitckpt),
            "demo",
            "--script",
            str(SCRIPTS / "loop_epochs_own_batches.py"),
            "--nnodes",
            "1",
            "--preempt-at-step",
            str(step),
            "--compare",
            "--json",
            "--keep",
            "--workdir",
            str(tmp_path / "demo"),
            "--",
            "--epochs",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    summary = json.loads(done.stdout)
    assert summary["ok"] is True, (summary, done.stderr[-3000:])
    assert done.returncode == 0
    assert summary["jit_checkpoint_step"] == summary["resumed_from_step"] == step
    assert summary["final_step"] == 75
    assert summary["equal_to_uninterrupted"] is True
    work = tmp_path / "demo" / "work"
    saved = [work / run / "node-0" / "out.pt" for run in ("reference", "run-2")]
    assert compare_saved(*saved) == []
    resumed = Path(summary["trainer_logs"]["resumed"][0]).read_text(errors="replace")
    assert f"resumed at step {step}: the head of its loop in" in resumed, resumed[-3000:]
