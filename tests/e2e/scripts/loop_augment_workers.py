"""A DDP training loop whose data pipeline augments at random in DataLoader workers.

Written the way research code is: a ``Dataset`` that jitters and flips its
samples with numpy and Python's ``random`` as they are read, two worker
processes seeded by the usual ``worker_init_fn`` (numpy and ``random`` from
``torch.initial_seed()``) and kept alive across epochs (``persistent_workers``,
so their random states carry over from one epoch to the next), a
``collate_fn`` that draws a random per-batch scale, a ``DistributedSampler``
reshuffled each epoch. At the end rank 0 saves
the model. It knows nothing about jitckpt.

    torchrun --nnodes 2 ... loop_augment_workers.py --epochs 3
"""

import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class JitteredPoints(Dataset):
    """Fixed points; every read adds numpy noise and maybe flips the sign (augmentation)."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(3)
        self.points = torch.randn(size, 12, generator=generator)
        self.targets = self.points[:, :3].sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int):
        point = self.points[index] + torch.from_numpy(
            np.random.normal(0.0, 0.1, size=12).astype("float32")
        )
        if random.random() < 0.5:
            point = -point
        return point, self.targets[index]


def seed_worker(worker_id: int) -> None:
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def scale_batch(items):
    points = torch.stack([point for point, _ in items])
    targets = torch.stack([target for _, target in items])
    return points * (1.0 + 0.1 * torch.rand(1)), targets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--output", default="augmented_model.pt")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    dataset = JitteredPoints(192)
    sampler = DistributedSampler(dataset, shuffle=True, seed=5)
    loader = DataLoader(
        dataset,
        batch_size=8,
        sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        worker_init_fn=seed_worker,
        collate_fn=scale_batch,
    )
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.MSELoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for points, targets in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(points), targets)
            loss.backward()
            optimizer.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch} mean loss {total / len(loader):.5f}", flush=True)

    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        torch.save(model.module.state_dict(), args.output)
        print(f"saved the model to {args.output}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
