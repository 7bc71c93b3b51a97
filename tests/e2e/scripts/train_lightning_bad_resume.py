"""A Lightning script that cannot resume from its own checkpoints, written the way users write them.

It knows nothing about jitckpt. Its module keeps a feature scale in the
checkpoint through Lightning's checkpoint hooks, and a rename left the hooks
disagreeing: ``on_save_checkpoint`` writes ``feature_scale``,
``on_load_checkpoint`` reads ``feature_scales``. Training from scratch works;
every resume from a checkpoint raises ``KeyError`` before the first step, as
``fit(ckpt_path=...)`` would.

    torchrun --nnodes 2 ... train_lightning_bad_resume.py --max-steps 30
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 16


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.scale = torch.ones(FEATURES)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        features, targets = batch
        return functional.mse_loss(self.net(features * self.scale).squeeze(-1), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["feature_scale"] = self.scale.tolist()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.scale = torch.tensor(checkpoint["feature_scales"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=30)
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    args = parser.parse_args()

    class PrintSteps(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:  # type: ignore[no-untyped-def]
            print(f"rank {trainer.global_rank} step {trainer.global_step}", flush=True)

    pl.seed_everything(7)
    generator = torch.Generator().manual_seed(7)
    features = torch.randn(64, FEATURES, generator=generator)
    data = TensorDataset(features, features.sum(dim=1))
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        num_nodes=nodes,
        accelerator="cpu",
        devices=1,
        strategy="ddp" if nodes > 1 else "auto",
        callbacks=[PrintSteps()],
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(Regressor(), DataLoader(data, batch_size=8, shuffle=True))
    print(f"fit() returned at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
