"""torchtitan's own trainer through the demo: a JIT checkpoint through its CheckpointManager,
resumed bitwise, with its own checkpointing off and on.

``python -m torchtitan.train`` (its llama3 debug model, FSDP over 2 nodes) runs
unchanged but for the CPU adapter ``scripts/titan_train.py`` (device, attention,
reduction op, a missing torch call; nothing about saving, loading or data), on a
tokenizer and a JSONL dataset made here (``scripts/titan_assets.py``). Short runs
(the preemption at step 6 of 12) sized by torchtitan's own knobs (sequence length,
batch, steps, no activation checkpointing, float32 parameters). Both cases share one
uninterrupted reference: checkpointing does not change what is trained.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from local.demo.scenario import DemoOptions, open_scenario, reference_run, run_demo
from tests.e2e.scripts import titan_assets

# One worker for the module: its reference run is made once.
# Its shared fixtures are session ones (tests/conftest.py says why).
pytestmark = pytest.mark.xdist_group("e2e-torchtitan")

ADAPTER = Path(__file__).with_name("scripts") / "titan_train.py"
STEPS, PREEMPT_AT, INTERVAL = 12, 6, 4


def trainer_args(assets: titan_assets.Assets) -> list[str]:
    """torchtitan's own command line: its debug model, FSDP over the 2 nodes, a short run."""
    return [
        "--module",
        "llama3",
        "--config",
        "llama3_debugmodel",
        "--hf_assets_path",
        str(assets.tokenizer),
        "--dataloader.dataset_path",
        str(assets.dataset),
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        str(STEPS),
        "--training.mixed-precision-param",
        "float32",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.spmd_backend",
        "partial_dtensor",
        "--debug.seed",
        "39",
        "--metrics.disable-color-printing",
    ]


# tyro's subcommand for the activation checkpointing config: last on the line.
NO_ACTIVATION_CHECKPOINTING = ["activation-checkpoint:none"]
CHECKPOINTING = ["--checkpoint.enable", "--checkpoint.interval", str(INTERVAL)]
CHECKPOINTING += ["--checkpoint.folder", "ckpt"]


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> titan_assets.Assets:
    return titan_assets.build(tmp_path_factory.mktemp("titan-assets"))


@pytest.fixture(scope="session")
def reference(
    assets: titan_assets.Assets, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """The final weights of the run never preempted, checkpointing off (shared)."""
    workdir = tmp_path_factory.mktemp("titan-reference")
    options = DemoOptions(
        script=ADAPTER,
        script_args=trainer_args(assets) + NO_ACTIVATION_CHECKPOINTING,
        nnodes=2,
        destination="pvc://unused/reference",
        workdir=workdir,
    )
    weights = workdir / "weights.pt"
    with open_scenario(options, sys.stderr) as scenario:
        run = reference_run(scenario, weights)
    assert run.exit_codes() == [0, 0], run.logs()
    yield weights


def preempted(tmp_path: Path, args: list[str], reference: Path) -> dict:
    options = DemoOptions(
        script=ADAPTER,
        script_args=args + NO_ACTIVATION_CHECKPOINTING,
        nnodes=2,
        preempt_at_step=PREEMPT_AT,
        reference_weights=reference,
        workdir=tmp_path / "demo",
        keep=True,
    )
    summary = run_demo(options, sys.stderr)
    context = str({k: v for k, v in summary.items() if k != "sidecar_logs"})[:4000]
    assert summary["ok"] is True, context
    assert summary["jit_checkpoint_step"] == summary["resumed_from_step"] == PREEMPT_AT, context
    assert summary["trainer_exit_codes"] == [143, 143], context
    assert summary["final_step"] == STEPS, context
    assert summary["equal_to_uninterrupted"] is True, context
    return summary


def text(paths: list[str]) -> str:
    return "\n".join(Path(path).read_text(errors="replace") for path in paths)


def test_checkpointing_off_a_jit_checkpoint_through_its_manager_resumes_bitwise(
    tmp_path: Path, assets: titan_assets.Assets, reference: Path
) -> None:
    summary = preempted(tmp_path, trainer_args(assets), reference)
    first, second = (text(summary["trainer_logs"][run]) for run in ("preempted", "resumed"))
    assert "torchtitan's Trainer: SIGTERM saves at the next step" in first
    assert "checkpointing is off" in first
    assert "the plain-loop capture stands down" in first
    assert "gets no JIT" not in first + second
    assert f"JIT checkpoint-{PREEMPT_AT} saved; exiting with 143" in first
    assert f"resuming from /mnt/jitckpt/checkpoints/checkpoint-{PREEMPT_AT}" in second
    # torchtitan's own load() read it: its train_state says where training goes on.
    assert f"Training starts at step {PREEMPT_AT + 1}" in second


def test_checkpointing_on_its_step_dirs_are_uploaded_and_the_jit_one_resumes_bitwise(
    tmp_path: Path, assets: titan_assets.Assets, reference: Path
) -> None:
    summary = preempted(tmp_path, trainer_args(assets) + CHECKPOINTING, reference)
    first, second = (text(summary["trainer_logs"][run]) for run in ("preempted", "resumed"))
    assert "through its CheckpointManager (its folder " in first
    agents = text(summary["sidecar_logs"]["preempted"] + summary["sidecar_logs"]["resumed"])
    # torchtitan's step-N, before the preemption and after the resume (its last step too).
    for step in range(INTERVAL, STEPS + 1, INTERVAL):
        assert f"committed checkpoint-{step} (periodic" in agents, step
    assert f"committed checkpoint-{PREEMPT_AT} (jit" in agents
    assert f"Training starts at step {PREEMPT_AT + 1}" in second
