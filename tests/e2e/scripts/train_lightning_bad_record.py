"""A Lightning script whose data has a bad record, written the way users write them.

It knows nothing about jitckpt. The dataset is read in order (no shuffle),
and a block of two records was truncated: reading either raises
``ValueError``, at the same step of every run, resumed or not. A failure of the training itself,
which a checkpoint must never be blamed for.

    torchrun --nnodes 2 ... train_lightning_bad_record.py --bad-record 70
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
from torch.utils.data import DataLoader, Dataset

FEATURES = 8


class Records(Dataset):
    """Decoded records; ``bad`` and the one after it are corrupt."""

    def __init__(self, count: int, bad: int) -> None:
        generator = torch.Generator().manual_seed(3)
        self.features = torch.randn(count, FEATURES, generator=generator)
        self.bad = bad

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index in (self.bad, self.bad + 1):
            raise ValueError(f"record {index}: truncated")
        row = self.features[index]
        return row, row.mean().unsqueeze(0)


class Fit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, 1)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        features, targets = batch
        return functional.mse_loss(self.net(features), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--bad-record", type=int, default=70)
    args = parser.parse_args()
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    pl.seed_everything(3)
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        num_nodes=nodes,
        accelerator="cpu",
        devices=1,
        strategy="ddp" if nodes > 1 else "auto",
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
    )
    data = DataLoader(Records(128, args.bad_record), batch_size=4)
    trainer.fit(Fit(), data)
    print(f"fit() returned at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
