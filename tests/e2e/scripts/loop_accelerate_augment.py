"""An Accelerate training loop whose Dataset augments every sample as it is read.

A small regression model on fixed synthetic points; ``__getitem__`` adds
torch noise and numpy jitter (in the main process with ``--workers 0``, in
the worker processes otherwise, kept alive across epochs with ``--persistent``,
as Accelerate's and torch's docs suggest for speed), a shuffled DataLoader
prepared by ``accelerator.prepare``. At the end the main process saves the model. It
knows nothing about jitckpt.

    torchrun --nnodes 2 ... loop_accelerate_augment.py --workers 2 --persistent
"""

import argparse

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset


class NoisyPoints(Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(11)
        self.points = torch.randn(size, 10, generator=generator)
        self.targets = self.points[:, :2].prod(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int):
        jitter = torch.from_numpy(np.random.uniform(-0.05, 0.05, size=10).astype("float32"))
        return self.points[index] + 0.1 * torch.randn(10) + jitter, self.targets[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--output", default="accelerate_augment.pt")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    set_seed(42)
    loader = DataLoader(
        NoisyPoints(160),
        batch_size=8,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.persistent,
    )
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for points, targets in loader:
            loss = nn.functional.mse_loss(model(points), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item()
        accelerator.print(f"epoch {epoch} mean loss {total / len(loader):.5f}")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.save(accelerator.unwrap_model(model).state_dict(), args.output)
        print(f"model saved to {args.output}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
