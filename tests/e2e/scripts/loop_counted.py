"""A plain loop that counts what it trained on: in a variable, and in an iterator.

``samples_seen`` is a plain variable of the loop: a resume puts it back with
the loop's other books. ``batches`` is an ``itertools.count`` the loop draws
its batch numbers from: an iterator whose place no checkpoint can hold, so a
run resumed mid-way numbers only the batches after the resume, while its
weights and ``samples_seen`` are those of an uninterrupted run. The script
saves all three at the end. It knows nothing about jitckpt.
"""

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(96, 8, generator=generator)
    labels = (features[:, 0] > 0).long()
    loader = DataLoader(TensorDataset(features, labels), batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    samples_seen = 0
    batches = itertools.count(1)
    last_batch = 0
    for _epoch in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            samples_seen += len(y)
            last_batch = next(batches)

    torch.save(
        {
            "model": model.state_dict(),
            "samples_seen": torch.tensor(samples_seen),
            "batches": torch.tensor(last_batch),
        },
        "out.pt",
    )
    print(f"training done: {samples_seen} samples, {last_batch} batches", flush=True)


if __name__ == "__main__":
    main()
