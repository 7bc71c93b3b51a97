"""A single-process PyTorch training loop, written the way people write one.

A small MLP with dropout on a synthetic regression set (made from a fixed
seed, nothing downloaded), a shuffled DataLoader with two worker processes,
Adam and a StepLR schedule stepped once per epoch. At the end it evaluates,
prints a summary and saves the model. It knows nothing about jitckpt.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_dataset(seed: int, size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 16, generator=generator)
    weights = torch.randn(16, 1, generator=generator)
    targets = inputs @ weights + 0.1 * torch.randn(size, 1, generator=generator)
    return TensorDataset(inputs, targets)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--save-model", default="model.pt")
    args = parser.parse_args()

    torch.manual_seed(0)
    dataset = make_dataset(seed=1, size=160)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    loss_fn = nn.MSELoss()

    step = 0
    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            total += loss.item()
            step += 1
            print(f"epoch {epoch} step {step} loss {loss.item():.5f}", flush=True)
        scheduler.step()
        print(f"epoch {epoch} done, mean loss {total / len(loader):.5f}", flush=True)

    model.eval()
    with torch.no_grad():
        inputs, targets = dataset.tensors
        print(f"training finished: eval loss {loss_fn(model(inputs), targets).item():.6f}")
    torch.save(model.state_dict(), args.save_model)
    print(f"saved the model to {args.save_model}", flush=True)


if __name__ == "__main__":
    main()
