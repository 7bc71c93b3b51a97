"""The shim's side of torchtitan's ``CheckpointManager``, on the real class in one process.

No training run: a tiny module, a torch optimizer and scheduler, a train state and a
loader state, saved and loaded by torchtitan's own DCP code (no process group).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torchtitan.components.checkpoint import CheckpointManager

from shim.frameworks.torchtitan import manager as titan


class Counter:
    """A stateful part torchtitan saves: the train state, the loader's place."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def parts() -> SimpleNamespace:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    return SimpleNamespace(
        model_parts=[model],
        optimizers=optimizer,
        lr_schedulers=scheduler,
        dataloader=Counter(7),
        train=Counter(3),
    )


def enabled_manager(trainer: SimpleNamespace, folder: Path, interval: int) -> Any:
    config = CheckpointManager.Config(
        enable=True, folder=str(folder), interval=interval, keep_latest_k=0
    )
    return CheckpointManager(
        config,
        dataloader=trainer.dataloader,
        model_parts=trainer.model_parts,
        optimizers=trainer.optimizers,
        lr_schedulers=trainer.lr_schedulers,
        states={"train_state": trainer.train},
        sd_adapter=None,
        base_folder="",
    )


def test_a_save_off_its_interval_is_torchtitans_own_step_dir_and_put_back_after(
    tmp_path: Path,
) -> None:
    trainer = parts()
    manager = enabled_manager(trainer, tmp_path / "ckpt", interval=10)
    saver = titan.Manager(manager)
    assert manager.save(3) is False  # torchtitan's own rule: not a step of its interval
    saver.save_now(3)
    directory = tmp_path / "ckpt" / "step-3"
    assert (directory / titan.DCP_METADATA).is_file()
    assert manager.interval == 10 and manager.load_only is False
    written = saver.take(str(directory))
    assert written is not None and written.step == 3 and written.done()
    assert not any(written.local()(name) for name in os.listdir(directory))  # one rank: shared


def test_load_from_points_torchtitans_load_at_the_restored_checkpoint(tmp_path: Path) -> None:
    trainer = parts()
    manager = enabled_manager(trainer, tmp_path / "own-folder", interval=10)
    saver = titan.Manager(manager)
    saver.save_now(5)
    saved = {k: v.clone() for k, v in trainer.model_parts[0].state_dict().items()}
    restored = tmp_path / "checkpoints" / "checkpoint-5"  # where the sidecar restores it
    restored.parent.mkdir()
    shutil.move(str(tmp_path / "own-folder" / "step-5"), restored)
    shutil.rmtree(tmp_path / "own-folder")
    with torch.no_grad():
        for parameter in trainer.model_parts[0].parameters():
            parameter.add_(1.0)
    trainer.train.value, trainer.dataloader.value = 0, 0

    assert saver.load_from(5, str(restored)) is True

    for name, value in trainer.model_parts[0].state_dict().items():
        assert torch.equal(value, saved[name]), name
    assert (trainer.train.value, trainer.dataloader.value) == (3, 7)
    assert manager.folder == str(tmp_path / "own-folder")  # pointed for that call only
    assert "_create_checkpoint_id" not in vars(manager)


def test_with_checkpointing_off_a_second_manager_saves_only_when_asked(tmp_path: Path) -> None:
    trainer = parts()
    trainer.dataloader = Counter(1)
    second = titan.second_manager(trainer, CheckpointManager, str(tmp_path / "jit"))
    assert second.enable and titan.missing(second) == ()
    assert second.save(4) is False and not (tmp_path / "jit").exists()
    titan.Manager(second).save_now(4)
    assert (tmp_path / "jit" / "step-4" / titan.DCP_METADATA).is_file()


def test_a_background_save_is_staged_once_its_future_is_done(tmp_path: Path) -> None:
    trainer = parts()
    saver = titan.Manager(enabled_manager(trainer, tmp_path, interval=1))
    future: Future = Future()
    saver.written["a/step-2"] = titan.Written(2, "a/step-2", sharded=False, result=future)
    saver.written["a/step-1"] = titan.Written(1, "a/step-1", sharded=False, result=None)
    assert [w.step for w in saver.finished()] == [1]
    future.set_result(None)
    assert [w.step for w in saver.finished()] == [2]
    assert saver.written == {}


def test_what_the_shim_needs_of_a_manager_and_a_model_only_last_save() -> None:
    assert titan.missing(CheckpointManager) == ()
    assert titan.missing(object) == titan.REQUIRED_METHODS
    assert titan.model_only_last_save(SimpleNamespace(last_save_model_only=True), True)
    assert not titan.model_only_last_save(SimpleNamespace(last_save_model_only=True), False)
    assert not titan.model_only_last_save(SimpleNamespace(last_save_model_only=False), True)
