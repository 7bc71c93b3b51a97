"""One measurement for bench/data_replay.py: a mid-epoch resume of a loader with workers.

A ``Dataset`` that augments with numpy (random crop, flip, noise) and a
``collate_fn`` that draws a random mask, two worker processes seeded by a
``worker_init_fn``, a small CNN trained on CPU. The script, in one process
with the shim's DataLoader tracking installed:

1. trains one epoch uninterrupted (its wall time), recording the loader's
   place (``Tracker.record``) after half the epoch and the batch that came next;
2. resumes there as a resumed job would (``Tracker.arm``: the pass replayed
   through the workers) and times the first batch after the resume point,
   checking it equals the uninterrupted run's;
3. skips the same batches by index, in the same order (what
   ``skip_first_batches`` does: no data read, but the workers' random numbers
   are not where they were) and times its first batch, noting whether it is
   the same.

Prints one JSON object of seconds.

    python -m bench.replay_workload --samples 512
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

from shim import dataloaders, rngstate

SIDE = 48
CROP = 40


class Augmented(Dataset):
    def __init__(self, samples: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.images = torch.rand(samples, 3, SIDE, SIDE, generator=generator).numpy()
        self.labels = torch.randint(10, (samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        top, left = np.random.randint(0, SIDE - CROP + 1, size=2)
        image = self.images[index, :, top : top + CROP, left : left + CROP]
        if np.random.rand() < 0.5:
            image = image[:, :, ::-1]
        image = image + np.random.normal(0.0, 0.05, size=image.shape)
        return torch.from_numpy(image.astype("float32")), self.labels[index]


def masked(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.stack([image for image, _ in items])
    labels = torch.stack([label for _, label in items])
    return images * (torch.rand(images.shape[0], 1, CROP, CROP) > 0.1), labels


def seed_worker(worker_id: int) -> None:
    np.random.seed(torch.initial_seed() % 2**32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataloaders.install(torch)
    dataloaders.TRACKER.follow_only()
    torch.manual_seed(0)
    dataset = Augmented(args.samples)
    settings = {"num_workers": args.workers, "worker_init_fn": seed_worker, "collate_fn": masked}
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, **settings)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    half = len(loader) // 2

    record = None
    expected = None
    began = time.perf_counter()
    for number, (images, labels) in enumerate(loader):
        if number == half:
            expected = images
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if number == half - 1:
            record = dataloaders.TRACKER.record(loader)
    epoch = time.perf_counter() - began
    assert record is not None and expected is not None

    dataloaders.TRACKER.arm(loader, record, lambda: None)
    began = time.perf_counter()
    replayed = next(iter(loader))[0]
    replay = time.perf_counter() - began
    assert torch.equal(replayed, expected), "the replayed pass differs"

    rngstate.restore(record["start"]["rng"])  # the same order: the pass's start states
    torch.empty((), dtype=torch.int64).random_()  # (the workers' base seed came first)
    order = list(BatchSampler(RandomSampler(dataset), args.batch_size, drop_last=False))
    began = time.perf_counter()
    skipped = next(iter(DataLoader(dataset, batch_sampler=order[half:], **settings)))[0]
    skip = time.perf_counter() - began
    print(
        json.dumps(
            {
                "epoch": epoch,
                "replay": replay,
                "skip": skip,
                "skip_equal": bool(torch.equal(skipped, expected)),
            }
        )
    )


if __name__ == "__main__":
    main()
