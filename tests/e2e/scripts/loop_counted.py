"""A plain loop that counts the samples it trained on in a variable of its own.

The count is a Python variable: no checkpoint of any framework carries it,
so a run resumed mid-way counts only what it trained on after the resume,
while its weights are those of an uninterrupted run. The script saves both
at the end. It knows nothing about jitckpt.
"""

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
    for _epoch in range(2):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            samples_seen += len(y)

    torch.save({"model": model.state_dict(), "samples_seen": torch.tensor(samples_seen)}, "out.pt")
    print(f"training done: {samples_seen} samples", flush=True)


if __name__ == "__main__":
    main()
