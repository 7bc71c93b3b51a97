"""A Lightning Fabric training loop written as Fabric's own examples are.

``fabric.launch()``, ``fabric.setup()`` of the model and optimizer,
``setup_dataloaders`` (Fabric puts in its ``DistributedSampler``),
``fabric.backward``, ``clip_gradients``, a scheduler stepped every batch, a
dataset that augments at random in 2 worker processes, a step counter of its
own, and ``fabric.save`` of the trained state and that counter at the end
(rank 0 writes it). With ``--persistent`` the workers live across epochs
(``persistent_workers=True``, which Lightning's own warning suggests). It
knows nothing of jitckpt.

    torchrun --nnodes 2 ... fabric_loop.py --epochs 2 --persistent
"""

import argparse
import random

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Noisy(Dataset):
    """Fixed points; every read adds numpy noise and maybe flips the sign (augmentation)."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(3)
        self.points = torch.randn(size, 10, generator=generator)
        self.targets = self.points[:, :2].sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int):
        noise = torch.from_numpy(np.random.normal(0.0, 0.1, size=10).astype("float32"))
        point = self.points[index] + noise
        return (-point if random.random() < 0.5 else point), self.targets[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--output", default="fabric_model.ckpt")
    parser.add_argument("--persistent", action="store_true")
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cpu", strategy="ddp", num_nodes=2, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(7)

    model = nn.Sequential(nn.Linear(10, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.02, total_steps=args.epochs * 12
    )
    model, optimizer = fabric.setup(model, optimizer)
    loader = DataLoader(
        Noisy(192), batch_size=8, shuffle=True, num_workers=2, persistent_workers=args.persistent
    )
    loader = fabric.setup_dataloaders(loader)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for points, targets in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(points), targets)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            total += loss.item()
        fabric.print(f"epoch {epoch} mean loss {total / len(loader):.5f}")

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": step}
    fabric.save(args.output, state)


if __name__ == "__main__":
    main()
