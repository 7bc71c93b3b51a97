"""A Lightning script that augments its data at random in DataLoader worker processes.

Written the way users write them: ``seed_everything(seed, workers=True)`` so
that Lightning seeds each worker (``pl_worker_init_function``), a ``Dataset``
whose ``__getitem__`` jitters with torch, scales with numpy and flips with
Python's ``random``, two workers, a shuffled train DataLoader (Lightning
makes it a ``DistributedSampler`` on more than one node). After ``fit()``
global rank 0 saves the weights. It knows nothing about jitckpt.

    torchrun --nnodes 2 ... train_lightning_augment.py --epochs 3
"""

from __future__ import annotations

import argparse
import os
import random

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, Dataset


class AugmentedPoints(Dataset):
    """Fixed points and labels; every read is jittered, rescaled and maybe mirrored."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(11)
        self.points = torch.randn(size, 10, generator=generator)
        self.labels = (self.points[:, :2].sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        point = self.points[index] + 0.1 * torch.randn(10)
        point = point * float(np.random.uniform(0.9, 1.1))
        if random.random() < 0.5:
            point = point.flip(0)
        return point, self.labels[index]


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Dropout(0.2), nn.Linear(24, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        points, labels = batch
        loss = functional.cross_entropy(self.net(points), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--persistent", action="store_true", help="persistent_workers=True")
    parser.add_argument("--output", default="lightning_augment.pt")
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    parser.add_argument("--num-nodes", type=int, default=nodes)
    args = parser.parse_args()

    pl.seed_everything(42, workers=True)
    loader = DataLoader(
        AugmentedPoints(160),
        batch_size=8,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.persistent,
    )
    model = Classifier()
    strategy = "ddp" if args.num_nodes > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), args.output)
        print(f"saved the model to {args.output}", flush=True)


if __name__ == "__main__":
    main()
