"""Background saves of state on a GPU: the snapshot is pinned host memory, the file is what
the synchronous save writes (each storage recorded on its GPU). Skipped without CUDA.

Only torch, Lightning and the shim are needed (no S3 server, no agent), so the file
runs on a GPU machine with ``pytest --noconftest``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shim import asyncsave, devicetags, writerproc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REPO = Path(__file__).resolve().parents[2]


class Writer:
    """A framework's tensor writer, as the integration names it (``saves.intercept``)."""

    @staticmethod
    def write(tensors: dict[str, torch.Tensor], path: Path) -> None:
        torch.save(tensors, path)


@pytest.mark.parametrize("writer", [writerproc.THREAD, writerproc.PROCESS])
def test_gpu_storages_are_written_as_the_synchronous_save_writes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """By the writer thread and by the writer process (the snapshot moved from pinned to
    shared memory): the synchronous save's bytes, each storage on its device."""
    monkeypatch.setenv(writerproc.ENV_WRITER, writer)
    saves = asyncsave.BackgroundSaves("test")
    saves.intercept(Writer, "write")
    live = {
        "weight": torch.arange(1 << 18, dtype=torch.float32, device="cuda"),
        "host": torch.ones(1 << 16),
    }
    live["view"] = live["weight"][10:20]
    (tmp_path / "sync").mkdir()
    Writer.write(live, tmp_path / "sync" / "state.pt")  # the file's name is inside it
    directory = tmp_path / "checkpoint-1"
    directory.mkdir()
    saves.save(str(directory), 1, lambda: Writer.write(live, directory / "state.pt"))
    assert saves.pending(1) and saves.held_bytes > 0
    job = saves._job
    assert job is not None and job.by_process == (writer == writerproc.PROCESS)
    del job
    live["weight"].add_(1.0)  # queued after the copy on the same stream: the copy is older
    saves.wait()
    assert (directory / "state.pt").read_bytes() == (tmp_path / "sync" / "state.pt").read_bytes()
    loaded = torch.load(directory / "state.pt", weights_only=True)
    assert loaded["weight"].device.type == "cuda" and loaded["host"].device.type == "cpu"
    assert torch.equal(loaded["weight"].cpu(), torch.arange(1 << 18, dtype=torch.float32))
    assert devicetags.registered() == 0  # released with the snapshot


LIGHTNING_ON_GPU = """
import sys
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.BatchNorm1d(1024),
                                       torch.nn.ReLU(), torch.nn.Linear(1024, 4))

    def training_step(self, batch, index):
        points, labels = batch
        return torch.nn.functional.cross_entropy(self.net(points), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

if __name__ == "__main__":
    pl.seed_everything(0)
    torch.backends.cudnn.deterministic = True
    data = TensorDataset(torch.randn(256, 64), torch.randint(4, (256,)))
    trainer = pl.Trainer(max_steps=12, accelerator="gpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=sys.argv[1])
    trainer.fit(Model(), DataLoader(data, batch_size=16, shuffle=True))
    print("trained", flush=True)
"""


def _lightning(tmp_path: Path, name: str, extra: dict[str, str]) -> tuple[Path, str]:
    """Train on the GPU under the shim, a save every 4 steps: its checkpoints and stderr."""
    local = tmp_path / name
    script = tmp_path / "train_gpu.py"
    script.write_text(LIGHTNING_ON_GPU)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "shim"), str(REPO)]),
        "JITCKPT_DIR": str(local),
        "JITCKPT_SOCKET": str(tmp_path / "none.sock"),
        "JITCKPT_SAVE_STEPS": "4",
        **extra,
    }
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-3000:]
    return local / "checkpoints", done.stderr


def test_lightning_on_a_gpu_writes_what_its_synchronous_save_writes(tmp_path: Path) -> None:
    sync, _ = _lightning(tmp_path, "sync", {asyncsave.ENV_ASYNC_SAVE: "false"})
    background, said = _lightning(tmp_path, "background", {})
    for step in (4, 8, 12):
        assert f"checkpoint-{step} written behind the training loop" in said, said[-3000:]
    for step in (4, 8, 12):
        mine = (background / f"checkpoint-{step}" / "model.ckpt").read_bytes()
        assert mine == (sync / f"checkpoint-{step}" / "model.ckpt").read_bytes(), step
