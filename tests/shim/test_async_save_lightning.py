"""Periodic Lightning saves written behind the training loop: the same files, a correct JIT
stop, and no checkpoint staged from a writer that did not finish.

The script is the user-style Lightning script of the end-to-end tests, unchanged,
with a wider hidden layer so a checkpoint is worth deferring (a few hundred KB for
the byte comparison; about 100 MB where a save must still be in flight when the
test acts). The writer (process or thread) writes ``model.ckpt``'s bytes into a
temporary file beside it (``model.ckpt.tmp-<pid>``) and renames it once whole, so
the test sees the writer mid-write while that file exists.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shim import asyncsave, writerproc
from tests.shim.support import PYTHON, Proc, ShimEnv, Spawn, checkpoint_steps
from tests.shim.test_async_save import BY_PROCESS, Disk, assert_staged_while_held_at_5
from tests.shim.test_lightning import HOLD, SCRIPT, _two_nodes, assert_bitwise_equal
from tests.shim.test_with_agent import uploaded
from tests.sidecar.agentproc import AgentProcess

RANK_FILE = "jitckpt_rank_0.pt"
# 16 inputs, 4 classes: about 84 bytes of parameters per hidden unit, three times that
# with AdamW's state.
SMALL = ["--hidden", "2048"]  # about 0.5 MB a checkpoint
LARGE = ["--hidden", "400000"]  # about 100 MB a checkpoint


def _wait_for_file(proc: Proc, path: Path, timeout: float = 120.0) -> None:
    """Poll closely for ``path`` (the run goes on: the window after it is short)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return
        if proc.popen.poll() is not None:
            break
        time.sleep(0.002)
    raise AssertionError(f"{path} never appeared; output:\n{proc.output()[-4000:]}")


def _wait_mid_write(proc: Proc, record: Path, timeout: float = 120.0) -> None:
    """Until the save that wrote ``record`` has its writer writing ``model.ckpt``'s bytes."""
    _wait_for_file(proc, record, timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.name.startswith("model.ckpt.tmp-") for p in record.parent.iterdir()):
            return  # the writer's temporary file, until it is renamed into place
        if proc.popen.poll() is not None:
            break
        time.sleep(0.001)
    raise AssertionError(f"no write in {record.parent}; output:\n{proc.output()[-4000:]}")


def test_background_save_writes_what_lightning_writes_and_resumes_bitwise(
    shim_env: ShimEnv, spawn: Spawn, tmp_path: Path
) -> None:
    # The same output directory for both runs, empty at each start: Lightning's
    # ModelCheckpoint state names it (and the logger's version directory in it).
    out = tmp_path / "out"
    common = [PYTHON, SCRIPT, "--output-dir", str(out), "--max-steps", "12", *SMALL]
    periodic = {"JITCKPT_SAVE_STEPS": "4"}
    sync_env = ShimEnv(tmp_path / "sync")
    sync = spawn(common, {**sync_env.env, **periodic, asyncsave.ENV_ASYNC_SAVE: "false"})
    assert sync.wait() == 0, sync.output()
    assert "periodic checkpoints are saved synchronously: JITCKPT_ASYNC_SAVE is false" in (
        sync.output()
    )
    out.rename(tmp_path / "sync-out")

    # Written by the writer process from the first save (opt-in: by default the writer
    # thread writes).
    background = spawn(common, {**shim_env.env, **periodic, **BY_PROCESS})
    assert background.wait() == 0, background.output()
    output = background.output()
    assert "periodic checkpoints are written behind the training loop" in output
    for step in (4, 8, 12):
        [written] = [line for line in output.splitlines() if f"checkpoint-{step} written" in line]
        assert "behind the training loop" in written and "by the writer process" in written
    assert checkpoint_steps(shim_env.checkpoints) == [4, 8, 12]
    # Byte for byte what Lightning's synchronous save wrote.
    for step in (4, 8, 12):
        mine = shim_env.checkpoints / f"checkpoint-{step}"
        theirs = sync_env.checkpoints / f"checkpoint-{step}"
        assert sorted(p.name for p in mine.iterdir()) == [RANK_FILE, "model.ckpt"]
        for name in (RANK_FILE, "model.ckpt"):
            assert (mine / name).read_bytes() == (theirs / name).read_bytes(), (step, name)
    assert_bitwise_equal(out / "final.ckpt", tmp_path / "sync-out" / "final.ckpt")

    # A run that resumes from checkpoint-4, written in the background, ends with the
    # weights of the uninterrupted run.
    for step in (8, 12):
        shutil.rmtree(shim_env.checkpoints / f"checkpoint-{step}")
    resumed_out = tmp_path / "resumed"
    resumed = spawn(
        [PYTHON, SCRIPT, "--output-dir", str(resumed_out), "--max-steps", "12", *SMALL],
        shim_env.env,
    )
    assert resumed.wait() == 0, resumed.output()
    assert f"resuming from {shim_env.checkpoints}/checkpoint-4" in resumed.output()
    assert_bitwise_equal(resumed_out / "final.ckpt", tmp_path / "sync-out" / "final.ckpt")


@pytest.mark.slow
def test_jit_stop_during_a_background_lightning_save_commits_a_correct_jit_checkpoint(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: object, spawn: Spawn, tmp_path: Path
) -> None:
    common = ["--max-steps", "12", "--no-validate", *LARGE]
    reference = spawn(
        [PYTHON, SCRIPT, "--output-dir", str(tmp_path / "reference"), *common],
        shim_env.without_shim(),
    )
    assert reference.wait(timeout=300) == 0, reference.output()
    # The writer thread from the first save: the writer process would start writing only
    # once it has imported torch, steps later, and the test needs the write it signals
    # during to be still running at the next step end. The writer process stopped by a
    # JIT save is shown with HF (tests/shim/test_async_save.py).
    cut = spawn(
        [PYTHON, SCRIPT, "--output-dir", str(tmp_path / "cut"), *common],
        {**shim_env.env, "JITCKPT_SAVE_STEPS": "4", writerproc.ENV_WRITER: writerproc.THREAD},
    )
    # SIGTERM while checkpoint-4's writer writes: the next step end agrees on the stop.
    _wait_mid_write(cut, shim_env.checkpoints / "checkpoint-4" / RANK_FILE)
    cut.signal(signal.SIGTERM)
    assert cut.wait(timeout=300) == 143, cut.output()
    output = cut.output()
    jit_step = int(output.split("stopping at step ")[1].split(" ")[0])
    assert jit_step in (5, 6)
    assert "checkpoint-4 was being written when the JIT save began" in output
    assert f"jit checkpoint-{jit_step} handed to the sidecar" in output
    # checkpoint-4 was either finished (and staged as a fallback) or dropped: never torn.
    for step in checkpoint_steps(shim_env.checkpoints):
        assert (shim_env.checkpoints / f"checkpoint-{step}" / "model.ckpt").is_file(), step
    agent.wait_for(lambda: agent.committed_step() == jit_step, 120, "the JIT commit")
    assert jit_step in uploaded(local_s3, agent.destination)  # type: ignore[arg-type]

    # The next run resumes from the JIT checkpoint and ends where the uninterrupted one did.
    resumed = spawn(
        [PYTHON, SCRIPT, "--output-dir", str(tmp_path / "resumed"), *common], shim_env.env
    )
    assert resumed.wait(timeout=300) == 0, resumed.output()
    assert f"resuming from {shim_env.checkpoints}/checkpoint-{jit_step}" in resumed.output()
    assert_bitwise_equal(tmp_path / "resumed" / "final.ckpt", tmp_path / "reference" / "final.ckpt")


def test_a_lightning_checkpoint_written_while_the_loop_holds_is_staged_before_the_stop(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: object, spawn: Spawn, tmp_path: Path
) -> None:
    """checkpoint-4 is saved after step 4's agreement and step 5's holds: the hold stages it."""
    command = [PYTHON, SCRIPT, "--output-dir", str(tmp_path / "out"), "--no-validate", *SMALL]
    run = spawn(
        [*command, "--max-steps", "12"],
        {**shim_env.env, "JITCKPT_SAVE_STEPS": "4", HOLD: "5"},
    )
    assert_staged_while_held_at_5(run, agent, local_s3)


@pytest.mark.slow
def test_a_lightning_writer_killed_mid_write_stages_nothing_and_is_never_resumed(
    shim_env: ShimEnv, agent: AgentProcess, local_s3: object, spawn: Spawn, tmp_path: Path
) -> None:
    common = [PYTHON, SCRIPT, "--max-steps", "12", "--no-validate", *LARGE]
    periodic = {"JITCKPT_SAVE_STEPS": "4"}
    reference = spawn(
        [*common, "--output-dir", str(tmp_path / "reference")], shim_env.without_shim()
    )
    assert reference.wait(timeout=300) == 0, reference.output()
    run = spawn([*common, "--output-dir", str(tmp_path / "out")], {**shim_env.env, **periodic})
    run.wait_for("periodic checkpoint-4 handed to the sidecar", timeout=300)
    _wait_mid_write(run, shim_env.checkpoints / "checkpoint-8" / RANK_FILE)
    run.signal(signal.SIGKILL)
    run.wait()
    output = run.output()
    assert "checkpoint-8" not in "".join(
        line for line in output.splitlines() if "handed to the sidecar" in line
    )
    # Killed before model.ckpt (Lightning's completion mark, renamed into place once whole).
    assert not (shim_env.checkpoints / "checkpoint-8" / "model.ckpt").exists()
    agent.wait_for(lambda: agent.committed_step() == 4, 120, "checkpoint-4 committed")
    assert "accepted checkpoint-8" not in agent.log()
    assert set(uploaded(local_s3, agent.destination)) == {4}  # type: ignore[arg-type]

    # The container restarts in the same pod: it resumes from checkpoint-4, never the torn 8.
    again = spawn([*common, "--output-dir", str(tmp_path / "again")], {**shim_env.env, **periodic})
    assert again.wait(timeout=300) == 0, again.output()
    assert f"resuming from {shim_env.checkpoints}/checkpoint-4" in again.output()
    # checkpoint-4's parameters were copied during step 5's forward and backward (the
    # optimizer step's closure): the values of the save's moment, so the run ends bitwise
    # where the uninterrupted one did.
    assert_bitwise_equal(tmp_path / "again" / "final.ckpt", tmp_path / "reference" / "final.ckpt")
    loaded = torch.load(
        shim_env.checkpoints / "checkpoint-12" / "model.ckpt", map_location="cpu", mmap=True
    )
    assert loaded["global_step"] == 12


@pytest.mark.slow
def test_two_nodes_write_in_the_background_and_agree_before_staging(tmp_path: Path) -> None:
    """DDP over two one-process nodes: global rank 0 defers model.ckpt, rank 1 writes only its
    rank file; both take part in every agreement (no hang), and each node keeps every
    checkpoint with what it wrote."""
    nodes = _two_nodes(
        tmp_path,
        29547,
        ["--output-dir", str(tmp_path / "out"), "--max-steps", "12", *SMALL],
        {"JITCKPT_SAVE_STEPS": "4"},
    )
    try:
        codes = [proc.wait(timeout=300) for _, proc in nodes]
    finally:
        for _, proc in nodes:
            if proc.popen.poll() is None:
                proc.popen.kill()
    outputs = [proc.output() for _, proc in nodes]
    assert codes == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert all("fit() returned at step 12" in output for output in outputs)
    for step in (4, 8, 12):
        assert f"checkpoint-{step} written behind the training loop" in outputs[0]
    (env0, _), (env1, _) = nodes
    for step in (4, 8, 12):
        assert sorted(p.name for p in (env0.checkpoints / f"checkpoint-{step}").iterdir()) == [
            RANK_FILE,
            "model.ckpt",
        ]
        assert [p.name for p in (env1.checkpoints / f"checkpoint-{step}").iterdir()] == [
            "jitckpt_rank_1.pt"
        ]


class Config:
    """A user's config object in a checkpoint: the snapshot cannot tell what it holds."""

    def __init__(self) -> None:
        self.width = 4


def test_a_checkpoint_the_snapshot_cannot_copy_is_written_at_once_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lightning writes its whole checkpoint in one call: an object the snapshot cannot copy
    makes that save synchronous, and the shim says so once."""
    saves = asyncsave.BackgroundSaves("lightning")
    saves.explain_unsupported = True
    saves.intercept(Disk, "write")
    path = tmp_path / "checkpoint-1" / "model.ckpt"
    path.parent.mkdir()
    checkpoint = {"state_dict": {"w": torch.ones(1 << 16)}, "hyper_parameters": Config()}
    saves.save(str(path.parent), 1, lambda: Disk.write(checkpoint, path))
    assert torch.load(path, weights_only=False)["state_dict"]["w"].sum() == 1 << 16  # now
    assert saves.held_bytes == 0
    err = capsys.readouterr().err
    assert "a lightning checkpoint holds a Config, which the snapshot cannot copy" in err
    staged: list[tuple[str, int]] = []
    saves.agree_and_stage(lambda directory, step: staged.append((directory, step)), block=False)
    assert staged == [(str(path.parent), 1)]


def test_configurations_the_snapshot_cannot_serve_keep_the_synchronous_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real Lightning trainers, as configured by users: Lightning's own TorchCheckpointIO and
    strategy save behind the loop; anything that writes differently stays synchronous."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy

    from shim.frameworks.lightning import saves as lightningsaves

    class MyCheckpointIO(TorchCheckpointIO):
        """A user's CheckpointIO (say, one that writes to an object store)."""

    class MyStrategy(SingleDeviceStrategy):
        def save_checkpoint(self, checkpoint: Any, filepath: Any, storage_options: Any = None):  # type: ignore[no-untyped-def]
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def blocker(**kwargs: Any) -> str | None:
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, **kwargs)
        return lightningsaves.blocker(trainer, Strategy)

    assert blocker() is None
    assert blocker(plugins=[AsyncCheckpointIO()]) == (
        "the CheckpointIO AsyncCheckpointIO writes the files"
    )
    assert blocker(plugins=[MyCheckpointIO()]) == "the CheckpointIO MyCheckpointIO writes the files"
    assert blocker(strategy=MyStrategy(device=torch.device("cpu"))) == (
        "the strategy MyStrategy saves through its own save_checkpoint"
    )
    monkeypatch.setenv(asyncsave.ENV_ASYNC_SAVE, "false")
    assert blocker() == "JITCKPT_ASYNC_SAVE is false"
